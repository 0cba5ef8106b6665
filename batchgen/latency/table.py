"""A latency model that interpolates measured points (a calibration file from `python -m batchgen.profile`),
Vidur-style: piecewise-linear over each module's measured grid, in the coordinates its cost follows.

- attention_decode: (queries, padded work), padded work = queries x longest context rounded up to the
  executor's KV page (the padded batch it attends), or the sum of the contexts when the longest is unknown;
- attention_prefill: (prompt tokens, prompts x longest x longest rounded up to a page), or the sum of squares;
- dense_ffn, shared_experts, router, lm_head, step_overhead, boundary_overhead: over tokens (sequences);
- experts: over the tokens at the gate (one rank: an expert-parallel instance asks the fallback);
- h2d, d2h (and kv_restore, kv_append through them): over bytes per copy.

Micro-batches split the work evenly: mb calls of (tokens / mb, work / mb); of a layer's mb decode calls the
first is priced as measured after an eviction and the others as measured right after another call of that layer
(`warm` points, where the file has them): their weights are still in cache. 2-D modules interpolate linearly
over a Delaunay triangulation of the measured points (exact for a cost linear in both coordinates, which a
padded kernel's is); outside the measured hull they extrapolate linearly from the nearest measured point
along a global non-negative gradient, and 1-D modules along their end segments; never below 0. Anything the file
did not measure goes to `fallback` (a roofline).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

import numpy as np

from batchgen.latency.calibration_file import check_model, read, validate
from batchgen.latency.base import LatencyModel


def _out(a):
    a = np.asarray(a, dtype=float)
    return float(a) if a.ndim == 0 else a


class Curve:
    """Piecewise-linear y(x) through measured points (duplicates averaged), linear beyond both ends."""

    def __init__(self, x, y):
        x, y = np.asarray(x, float), np.asarray(y, float)
        self.x, inverse = np.unique(x, return_inverse=True)
        self.y = np.bincount(inverse, weights=y) / np.bincount(inverse)

    def __call__(self, q):
        q = np.asarray(q, float)
        x, y = self.x, self.y
        if x.size == 1:
            return np.full_like(q, y[0])
        out = np.interp(q, x, y)
        lo, hi = q < x[0], q > x[-1]
        out = np.where(lo, y[0] + (q - x[0]) * (y[1] - y[0]) / (x[1] - x[0]), out)
        out = np.where(hi, y[-1] + (q - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]), out)
        return np.maximum(out, 0.0)


class Surface:
    """y(u, v) linear over a Delaunay triangulation of the measured (u, v) (duplicates averaged); outside the
    hull the nearest measured point plus a global non-negative gradient. Collinear points fall back to a Curve
    over the coordinate that varies more."""

    def __init__(self, u, v, y):
        pts = np.column_stack([np.asarray(u, float), np.asarray(v, float)])
        pts, inverse = np.unique(pts, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        self.pts, self.y = pts, np.bincount(inverse, weights=np.asarray(y, float)) / np.bincount(inverse)
        self.scale = np.maximum(np.abs(pts).max(axis=0), 1e-300)
        self.inside = self.curve = self._grad = None
        from scipy.interpolate import LinearNDInterpolator
        from scipy.spatial import QhullError

        try:
            self.inside = LinearNDInterpolator(pts / self.scale, self.y)
        except (QhullError, ValueError):  # too few or collinear points: the curve along the longest axis below
            self.inside = None
        if self.inside is None:
            spread = np.ptp(pts / self.scale, axis=0)
            axis = int(np.argmax(spread))
            self.curve, self.axis = Curve(pts[:, axis], self.y), axis

    def __call__(self, u, v):
        u, v = np.broadcast_arrays(np.asarray(u, float), np.asarray(v, float))
        if self.curve is not None:
            return self.curve((u, v)[self.axis])
        q = np.column_stack([u.reshape(-1), v.reshape(-1)]) / self.scale
        out = self.inside(q)
        miss = np.isnan(out)
        if miss.any():
            out[miss] = self._plane(q[miss])
        return np.maximum(out, 0.0).reshape(u.shape)

    def _plane(self, q: np.ndarray) -> np.ndarray:
        """Outside the hull: the nearest measured point plus the global gradient (a non-negative least-squares
        plane a + b u + c v through every point, relative weights) times the way to the query: linear, and it
        never falls as work grows."""
        p = self.pts / self.scale
        if self._grad is None:
            from scipy.optimize import nnls

            w = 1.0 / np.maximum(self.y, 1e-12)
            self._grad = nnls(np.column_stack([np.ones(len(p)), p]) * w[:, None], self.y * w)[0][1:]
        near = np.argmin(((q[:, None, :] - p[None, :, :]) ** 2).sum(axis=2), axis=1)
        return self.y[near] + ((q - p[near]) * self._grad).sum(axis=1)


# which in-run ratio (batchgen.profile.in_run) scales each measured curve
_KIND = {"dense_ffn": "ffn", "shared_experts": "ffn", "router": "ffn", "lm_head": "head", "step": "step",
         "boundary": "step", "h2d": "copy", "d2h": "copy"}


class TablePredictor:
    """`LatencyModel` from measured points; `fallback` prices what was not measured (and gives the specs)."""

    def __init__(self, calibration: Mapping, fallback: LatencyModel, *, source: str = "calibration",
                 statistic: str = "seconds"):
        """statistic: which measured value to interpolate: `seconds` (the median) or `p10` (the fast end of
        the repeats, for a machine that other work slowed down while it was profiled)."""
        if statistic not in ("seconds", "p10"):
            raise ValueError(f"statistic={statistic!r}: choose seconds (median) or p10")
        data = validate(calibration, source)
        check_model(data, fallback.model, source)
        self.calibration, self.fallback, self.source = data, fallback, source
        self.page = int(data.get("settings", {}).get("page_tokens") or 1)
        self._digest = hashlib.sha1(json.dumps(data["modules"], sort_keys=True).encode()).hexdigest()[:16]
        mods = data["modules"]
        sec = lambda p: p.get(statistic, p["seconds"])  # noqa: E731
        self.statistic = statistic
        # measured inside real runs / predicted from the grid, per module kind (batchgen.profile.in_run)
        in_run = data.get("in_run") or {}
        self.scales = {k: float(v) for k, v in in_run.get("scales", {}).items()}
        # ratios by a call's size (in_run.ratios_by_size): decode attention and the LM head by sequences per call,
        # the FFN by tokens per call; a file without them: the FFN's decode and prefill ratios at their phases'
        # tokens per forward (in_run.tokens_per_forward). Interpolated in log size, clamped beyond the ends.
        sizes, by_size = in_run.get("tokens_per_forward") or {}, in_run.get("by_size") or {}
        self._sizes_key = (tuple(sorted((k, float(v)) for k, v in sizes.items())), json.dumps(by_size, sort_keys=True))
        phased = [(float(sizes[k]), self.scales[k]) for k in ("ffn_decode", "ffn_prefill") if k in sizes
                  and k in self.scales]
        tables = {"ffn": phased, **by_size}
        self._by_size = {k: (np.log([float(x) for x, _ in pts]), np.array([float(r) for _, r in pts]))
                         for k, pts in tables.items()
                         if len(pts) >= 2 and pts[0][0] > 0 and all(a[0] < b[0] for a, b in zip(pts, pts[1:]))}
        self._curves: dict[str, Curve] = {}
        self._surfaces: dict[str, Surface] = {}
        for name, coord in (("dense_ffn", "tokens"), ("shared_experts", "tokens"), ("router", "tokens"),
                            ("lm_head", "tokens"), ("experts", "total_tokens"), ("step", "sequences"),
                            ("boundary", "sequences"), ("h2d", "bytes"), ("d2h", "bytes")):
            pts = mods.get(name) or []
            if pts:
                self._curves[name] = Curve([p[coord] for p in pts], [sec(p) for p in pts])
        dec = [p for p in mods.get("attention_decode") or [] if p["micro_batches"] == 1 and not p.get("warm")]
        if dec:
            self._surfaces["attention_decode"] = Surface(
                [p["tokens"] for p in dec], [p["tokens"] * self._padded(p["max_context"]) for p in dec],
                [sec(p) for p in dec])
        # a layer's later decode calls of a forward (right after another one of that layer): None if not measured
        warm = [p for p in mods.get("attention_decode") or [] if p["micro_batches"] == 1 and p.get("warm")]
        self._warm_decode = (Surface([p["tokens"] for p in warm],
                                     [p["tokens"] * self._padded(p["max_context"]) for p in warm],
                                     [sec(p) for p in warm]) if warm else None)
        self._warm_tokens = max((p["tokens"] for p in warm), default=0)  # larger calls: priced as first calls
        pre = [p for p in mods.get("attention_prefill") or [] if p["micro_batches"] == 1]
        if pre:
            self._surfaces["attention_prefill"] = Surface(
                [p["tokens"] for p in pre],
                [p["sequences"] * p["max_context"] * self._padded(p["max_context"]) for p in pre],
                [sec(p) for p in pre])

    @classmethod
    def from_file(cls, path: str | Path, fallback: LatencyModel, statistic: str = "seconds") -> "TablePredictor":
        return cls(read(path), fallback, source=str(path), statistic=statistic)

    # ---- the protocol's attributes come from the fallback ----
    def __getattr__(self, name):
        if name in ("fallback", "calibration", "_curves", "_surfaces", "_warm_decode", "_by_size"):  # not yet set
            raise AttributeError(name)
        return getattr(self.fallback, name)

    @property
    def attention_padding(self) -> float:
        """Measured attention is the executor's padded kernel: it pays queries x the longest context."""
        return 1.0 if "attention_decode" in self._surfaces else self.fallback.attention_padding

    def key(self) -> tuple:
        return ("table", self._digest, tuple(sorted(self.scales.items())), self._sizes_key, self.page, self.statistic,
                self.fallback.key())

    def measured(self) -> list[str]:
        """Modules priced from measurements (the rest: the fallback)."""
        return sorted(set(self._curves) | set(self._surfaces))

    def _padded(self, max_context):
        """The context a padded attention call attends: the longest, rounded up to whole KV pages."""
        return np.ceil(np.asarray(max_context, float) / self.page) * self.page

    # ---- compute modules ----
    def attention_decode(self, tokens, context_sum, micro_batches=1, max_context=None):
        s = self._surfaces.get("attention_decode")
        if s is None:
            return self.fallback.attention_decode(tokens, context_sum, micro_batches, max_context)
        t, mb = np.asarray(tokens, float), np.maximum(np.asarray(micro_batches, float), 1.0)
        work = np.asarray(context_sum, float) if max_context is None else t * self._padded(max_context)
        first = s(t / mb, work / mb)
        later = first if self._warm_decode is None else np.where(
            t / mb <= self._warm_tokens, self._warm_decode(t / mb, work / mb), first)
        return _out(self._scale("attention_decode", np.where(t > 0, first + (mb - 1.0) * later, 0.0), t / mb))

    def attention_prefill(self, tokens, context_sq_sum, micro_batches=1, max_context=None, sequences=None):
        s = self._surfaces.get("attention_prefill")
        if s is None:
            return self.fallback.attention_prefill(tokens, context_sq_sum, micro_batches, max_context, sequences)
        t, mb = np.asarray(tokens, float), np.maximum(np.asarray(micro_batches, float), 1.0)
        if max_context is None or sequences is None:
            work = np.asarray(context_sq_sum, float)
        else:
            work = np.asarray(sequences, float) * np.asarray(max_context, float) * self._padded(max_context)
        return _out(self._scale("attention_prefill", np.where(t > 0, mb * s(t / mb, work / mb), 0.0)))

    def _scale(self, kind: str, seconds, size=None):
        """Measured-alone seconds as they come out inside a run (the profile's in-run ratio; 1 without one).
        Decode and prefill attention each have their own ratio (they differ inside runs:
        batchgen.profile.in_run); a file with only the combined `attention` ratio applies it to both. Where the
        file has ratios by size for the kind (`_by_size`), a call of `size` takes the one interpolated at it;
        else the kind's one ratio."""
        table = self._by_size.get(kind) if size is not None else None
        if table is not None:
            at, ratios = table
            return seconds * np.interp(np.log(np.maximum(size, 1.0)), at, ratios)
        fallback = self.scales.get("attention", 1.0) if kind.startswith("attention") else 1.0
        return seconds * self.scales.get(kind, fallback)

    def _curve(self, name: str, x, method: str):
        c = self._curves.get(name)
        if c is None:
            return getattr(self.fallback, method)(x)
        x = np.asarray(x, float)
        return _out(self._scale(_KIND[name], np.where(x > 0, c(x), 0.0), x))

    def dense_ffn(self, tokens):
        return self._curve("dense_ffn", tokens, "dense_ffn")

    def shared_experts(self, tokens):
        return self._curve("shared_experts", tokens, "shared_experts")

    def router(self, tokens):
        return self._curve("router", tokens, "router")

    def lm_head(self, tokens):
        return self._curve("lm_head", tokens, "lm_head")

    def experts(self, total_tokens):
        c = self._curves.get("experts")
        if c is None or self.fallback.ep_ranks != 1:  # measured on one device: the whole gate batch
            return self.fallback.experts(total_tokens)
        t = np.asarray(total_tokens, float)
        s = _out(self._scale("ffn", np.where(t > 0, c(t), 0.0), t))
        return s, s

    def local_experts(self, tokens):
        c = self._curves.get("experts")
        if c is None:  # nothing measured: the roofline's
            return self.fallback.local_experts(tokens)
        t = np.asarray(tokens, float)  # measured on one device holding every expert: what this asks
        return _out(self._scale("ffn", np.where(t > 0, c(t), 0.0), t))

    def step_overhead(self, sequences):
        return self._curve("step", sequences, "step_overhead")

    def boundary_overhead(self, sequences):
        c = self._curves.get("boundary")
        if c is None:
            return self.fallback.boundary_overhead(sequences)
        return _out(c(np.asarray(sequences, float)))

    # ---- copies ----
    def _copy(self, name: str, nbytes, copies):
        c = self._curves.get(name)
        if c is None:
            return getattr(self.fallback, name)(nbytes, copies)
        n, k = np.asarray(nbytes, float), np.maximum(np.asarray(copies, float), 1.0)
        return _out(np.where(n > 0, k * c(n / k), 0.0))

    def h2d(self, nbytes, copies=1):
        return self._copy("h2d", nbytes, copies)

    def d2h(self, nbytes, copies=1):
        return self._copy("d2h", nbytes, copies)

    def kv_restore(self, context_sum, micro_batches=1):
        """One layer's KV of `context_sum` tokens restored in `micro_batches` copies (measured h2d)."""
        return self.h2d(np.asarray(context_sum, float) * self.model.kv_bytes_per_token_per_layer, micro_batches)

    def kv_append(self, tokens, micro_batches=1):
        return self.d2h(np.asarray(tokens, float) * self.model.kv_bytes_per_token_per_layer, micro_batches)
