"""Per-module efficiencies of the roofline, fitted to a calibration file (`python -m batchgen.profile`).

Each module's measured seconds are matched by the roofline itself (`batchgen.latency.Roofline`, evaluated at
candidate factors), so the fitted numbers mean exactly what the simulator will do with them. For a module the
roofline is max(FLOPs / (compute x peak), bytes / (memory x bandwidth)) + launches x kernel_s: the compute-bound
points pin `compute`, the memory-bound ones `memory`, the smallest ones `kernel_s`. The fit minimises the
squared relative error over a log grid of (compute, memory) refined twice around the best; kernel_s, linear
in the model, is solved in closed form at each candidate (clipped at 0). Copies fit (link, kernel_s) the same
way; the per-forward and per-boundary overheads are straight lines in the number of sequences.
`attention_padding` (top level: how much of the padded queries x longest-context work attention pays) is
chosen among 0, 0.25, ..., 1 by the two attention modules together. The top-level compute, memory and kernel_s
are one fit of every compute module at once (they price modules the file did not measure).
"""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from batchgen.latency.calibration_file import read
from batchgen.latency.efficiency import Efficiency
from batchgen.latency.roofline import Roofline
from batchgen.specs import HardwareSpec, ModelSpec

COMPUTE_MODULES = ("attention_decode", "attention_prefill", "dense_ffn", "shared_experts", "router", "experts",
                   "lm_head")
PADDINGS = (0.0, 0.25, 0.5, 0.75, 1.0)
_KERNEL_PROBE = 1e-3  # kernel_s used to read each point's launch count off the roofline


def _predictor(module: str, points: list[dict]) -> Callable[[Roofline], np.ndarray]:
    """Seconds the roofline gives for the measured points of `module`."""
    col = lambda name: np.array([p[name] for p in points], float)  # noqa: E731
    if module == "attention_decode":
        t, c, mb, mx = col("tokens"), col("context_sum"), col("micro_batches"), col("max_context")
        return lambda rl: np.asarray(rl.attention_decode(t, c, mb, mx), float)
    if module == "attention_prefill":
        t, sq, mb, mx, n = (col("tokens"), col("context_sq_sum"), col("micro_batches"), col("max_context"),
                            col("sequences"))
        return lambda rl: np.asarray(rl.attention_prefill(t, sq, mb, mx, n), float)
    if module == "experts":
        t = col("total_tokens")
        return lambda rl: np.asarray(rl.experts(t)[0], float)
    if module in ("h2d", "d2h"):
        n = col("bytes")
        return lambda rl: np.asarray(getattr(rl, module)(n), float)
    t = col("tokens")
    return lambda rl: np.asarray(getattr(rl, module)(t), float)


class _Fit:
    """One least-squares problem: measured seconds of some modules against the roofline at candidate factors."""

    def __init__(self, model: ModelSpec, gpu: HardwareSpec, base: Efficiency, parts: dict[str, list[dict]],
                 target: str | None, fields: tuple[str, ...]):
        """`target`: the module whose factors vary (None: the top level); `fields`: the fractions searched."""
        self.model, self.gpu, self.base, self.target, self.fields = model, gpu, base, target, fields
        self.parts = [(_predictor(m, pts), np.array([p["seconds"] for p in pts], float)) for m, pts in parts.items()]
        self.y = np.concatenate([y for _, y in self.parts])
        self.kernel_field = "kernel_s"
        zero = self._predict({f: 1.0 for f in fields}, 0.0)
        self.launches = (self._predict({f: 1.0 for f in fields}, _KERNEL_PROBE) - zero) / _KERNEL_PROBE

    def _eff(self, factors: dict, kernel_s: float) -> Efficiency:
        values = {**factors, self.kernel_field: kernel_s}
        if self.target is None:
            return Efficiency.from_dict({**self.base.to_dict(), **values})
        modules = {m: dict(f) for m, f in self.base.modules.items()}
        modules[self.target] = {**modules.get(self.target, {}), **values}
        return Efficiency.from_dict({**self.base.to_dict(), "modules": modules})

    def _predict(self, factors: dict, kernel_s: float) -> np.ndarray:
        rl = Roofline(self.model, self.gpu, self._eff(factors, kernel_s), ep_ranks=1, gpus_per_node=1)
        return np.concatenate([f(rl) for f, _ in self.parts])

    def solve(self, factors: dict) -> tuple[float, float]:
        """(kernel_s, relative SSE) at these fractions: kernel_s in closed form."""
        t0 = self._predict(factors, 0.0)
        a, r = self.launches / self.y, 1.0 - t0 / self.y
        k = max(float((a * r).sum() / (a * a).sum()), 0.0) if (a * a).sum() > 0 else 0.0
        return k, float(((t0 + k * self.launches) / self.y - 1.0) @ ((t0 + k * self.launches) / self.y - 1.0))

    def search(self, polish: bool = True) -> tuple[dict, float, float]:
        """Best (fractions, kernel_s, SSE): a log grid over 1e-3..1, then Nelder-Mead in log space from its best
        point (fractions capped at 1)."""
        axes = [np.linspace(-3.0, 0.0, 13) for _ in self.fields]
        best = None
        for values in np.array(np.meshgrid(*axes)).reshape(len(self.fields), -1).T:
            k, sse = self.solve(self._factors(values))
            # ties (an overhead-bound module pins no fraction): keep the first, i.e. the larger fractions
            if best is None or sse < best[1] * (1 - 1e-9):
                best = (values, sse)
        start = best[0]
        if polish:
            from scipy.optimize import minimize

            res = minimize(lambda v: self.solve(self._factors(v))[1], start, method="Nelder-Mead",
                           options={"xatol": 1e-4, "fatol": 1e-12, "maxiter": 400})
            if res.fun < best[1]:
                start = res.x
        factors = self._factors(start)
        k, sse = self.solve(factors)
        return factors, k, sse

    def _factors(self, log_values) -> dict:
        return {f: float(min(10 ** v, 1.0)) for f, v in zip(self.fields, np.clip(log_values, -6.0, 0.0))}

    def residuals(self, factors: dict, kernel_s: float) -> np.ndarray:
        return self._predict(factors, kernel_s) / self.y - 1.0


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """y ~ a + b x, relative least squares (weights 1/y), both clipped at 0."""
    w = 1.0 / np.maximum(y, 1e-12)
    a_mat = np.column_stack([np.ones_like(x), x]) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(a_mat, y * w, rcond=None)
    if b < 0:
        return float(np.median(y)), 0.0
    if a < 0:
        return 0.0, float((x * y * w * w).sum() / (x * x * w * w).sum())
    return float(a), float(b)


def _err(res: np.ndarray) -> dict:
    return {"median_abs_pct": round(float(np.median(np.abs(res))) * 100, 2),
            "max_abs_pct": round(float(np.max(np.abs(res))) * 100, 2), "points": int(res.size)}


def fit_calibration(data: Mapping, hardware: HardwareSpec, *, name: str = "calibration") -> dict:
    """The efficiency-file dict fitted to a calibration dict (see module docstring)."""
    model = ModelSpec.from_dict(data["key"]["model"])
    # a layer's later attention calls (`warm` points) are the table's second surface, not the roofline's
    mods = {m: [p for p in pts if not p.get("warm")] for m, pts in data["modules"].items() if pts}
    compute = {m: mods[m] for m in COMPUTE_MODULES if m in mods}
    if not compute:
        raise ValueError(f"{name}: no compute module measured (need one of {', '.join(COMPUTE_MODULES)})")
    cpu = data["key"]["device"] == "cpu"
    base = Efficiency(gemm_pad_rows=0.0) if cpu else Efficiency()  # CPU GEMMs have no tile waves to pad
    residuals: dict[str, dict] = {}

    # attention_padding: the value under which the attention modules fit best
    attention = {m: compute[m] for m in ("attention_decode", "attention_prefill") if m in compute}
    if attention:
        def padding_sse(pad):
            b = Efficiency.from_dict({**base.to_dict(), "attention_padding": pad})
            return sum(_Fit(model, hardware, b, {m: p}, m, ("compute", "memory")).search(polish=False)[2]
                       for m, p in attention.items())
        base = Efficiency.from_dict({**base.to_dict(), "attention_padding": min(PADDINGS, key=padding_sse)})

    # top level: every compute module at once
    top = _Fit(model, hardware, base, compute, None, ("compute", "memory"))
    factors, kernel_s, _ = top.search()
    base = Efficiency.from_dict({**base.to_dict(), **factors, "kernel_s": kernel_s})
    out: dict = {k: _round(v) for k, v in factors.items()}
    out["kernel_s"] = kernel_s
    out["gemm_pad_rows"] = base.gemm_pad_rows
    out["attention_padding"] = base.attention_padding

    modules: dict[str, dict] = {}
    for m, pts in compute.items():
        fit = _Fit(model, hardware, base, {m: pts}, m, ("compute", "memory"))
        f, k, _ = fit.search()
        modules[m] = {**{n: _round(v) for n, v in f.items()}, "kernel_s": _round(k)}
        residuals[m] = _err(fit.residuals(f, k))
    copies = {m: mods[m] for m in ("h2d", "d2h") if m in mods}
    if copies:
        fit = _Fit(model, hardware, base, copies, "copy", ("link",))
        f, k, _ = fit.search()
        modules["copy"] = {**{n: _round(v) for n, v in f.items()}, "kernel_s": _round(k)}
        residuals["copy"] = _err(fit.residuals(f, k))
    for what in ("step", "boundary"):
        if what in mods:
            x = np.array([p["sequences"] for p in mods[what]], float)
            y = np.array([p["seconds"] for p in mods[what]], float)
            a, b = _line(x, y)
            out[f"{what}_s"], out[f"{what}_per_sequence_s"] = _round(a), _round(b)
            residuals[what] = _err((a + b * x) / np.maximum(y, 1e-12) - 1.0)
    out["kernel_s"] = _round(out["kernel_s"])
    out["modules"] = modules
    key = data["key"]
    out["source"] = {"device": key.get("device_name"), "hardware": hardware.name, "calibration": name,
                     "model": model.name, "dtype": key.get("dtype"), "threads": key.get("threads"),
                     "torch": key.get("torch"), "fitted": datetime.date.today().isoformat(),
                     "residuals": residuals}
    Efficiency.from_dict(out)  # what the simulator will load must load
    return out


def _round(v: float) -> float:
    return float(f"{v:.4g}")


def fit_calibration_file(path: str | Path, hardware: HardwareSpec | str) -> dict:
    """Fit the per-module efficiencies of `hardware` (a HardwareSpec or a conf/hardware name) to a calibration
    file; returns the efficiency-file dict (top-level factors, `modules`, `source` with fit residuals)."""
    if isinstance(hardware, str):
        from batchgen.specs.catalog import load_hardware
        hardware = load_hardware(hardware)
    return fit_calibration(read(path), hardware, name=Path(path).name)
