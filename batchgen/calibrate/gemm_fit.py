"""Fit efficiency factors to measured points: GEMMs (compute, memory, kernel_s, pad_rows) and collectives
(link, collective_s, collective_per_peer_s).

The error that matters is relative (a 10 us kernel off by 5 us is as wrong as a 10 ms one off by 5 ms), so
the fits minimise the mean absolute log ratio of predicted to measured time: robust to the outliers that
wave quantisation and kernel-selection jumps put in every profile, and aimed at the median, which is what
the checks report. The parameters are few, bounded and cheap to evaluate on whole arrays, so a shrinking
grid search per coordinate is enough and needs no optimiser library; one parameter that only adds a fixed
time (kernel_s, collective_s) is started from its weighted least-squares value.

GEMMs are fitted in the two regimes the issue asks for: memory and kernel_s on the points whose roofline is
memory-bound, compute (and pad_rows) on the compute-bound ones, then all together from there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from batchgen.calibrate.vidur import CollectivePoints, GemmPoints
from batchgen.latency.gemm import gemm_seconds

Predict = Callable[[Mapping[str, float]], np.ndarray]


@dataclass(frozen=True)
class Bound:
    """Search interval of one parameter; `log` searches it on a log scale (for positive scale factors)."""

    lo: float
    hi: float
    log: bool = False

    def __post_init__(self) -> None:
        if not (self.lo <= self.hi) or (self.log and self.lo <= 0):
            raise ValueError(f"bad bound [{self.lo}, {self.hi}] (log={self.log})")


@dataclass(frozen=True)
class FitResult:
    """Fitted parameters and the absolute relative errors (fractions) of the fit's own points."""

    params: dict[str, float]
    abs_errors: np.ndarray

    @property
    def median_abs_error(self) -> float:
        return float(np.median(self.abs_errors))

    @property
    def p95_abs_error(self) -> float:
        return float(np.percentile(self.abs_errors, 95))


def log_loss(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean |log(predicted / measured)|: relative, symmetric, robust."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.abs(np.log(np.asarray(predicted) / measured))
    return float(np.mean(np.where(np.isfinite(r), r, 50.0)))


def fit_params(predict: Predict, measured: np.ndarray, bounds: Mapping[str, Bound], start: Mapping[str, float],
               *, fixed: Mapping[str, float] | None = None, sweeps: int = 10, grid: int = 9) -> dict[str, float]:
    """Parameters within `bounds` that minimise log_loss(predict(params), measured), from `start`.

    Coordinate search: each sweep tries `grid` values of each parameter across a window around its current
    value (the whole bound at first) and keeps the best; the window halves once a sweep stops gaining.
    `fixed` parameters are passed to `predict` unchanged. Generic: any vectorised predict function of a few bounded
    parameters.
    """
    measured = np.asarray(measured, dtype=float)
    if measured.size == 0:
        raise ValueError("no points to fit")
    params = {**(fixed or {}), **{k: float(np.clip(start[k], b.lo, b.hi)) for k, b in bounds.items()}}
    best = log_loss(predict(params), measured)
    width = 1.0  # fraction of the bound's span (log span for log bounds)
    for _ in range(sweeps):
        for _repeat in range(4):  # coupled parameters walk a valley: repeat a width while it still gains
            before = best
            for name, b in bounds.items():
                for value in _window(params[name], b, width, grid):
                    trial = {**params, name: value}
                    loss = log_loss(predict(trial), measured)
                    if loss < best:
                        best, params = loss, trial
            if best > before * (1 - 1e-3):
                break
        width *= 0.5
    return params


def _window(x: float, b: Bound, width: float, grid: int) -> np.ndarray:
    if b.log:
        lo, hi = np.log(b.lo), np.log(b.hi)
        half = 0.5 * width * (hi - lo)
        c = np.log(x)
        return np.exp(np.linspace(max(lo, c - half), min(hi, c + half), grid))
    half = 0.5 * width * (b.hi - b.lo)
    return np.linspace(max(b.lo, x - half), min(b.hi, x + half), grid)


def additive_start(base: np.ndarray, measured: np.ndarray, lo: float = 0.0) -> float:
    """Weighted least squares (weights 1 / measured, i.e. relative error) of a constant added to `base`."""
    w = 1.0 / measured
    (c,), *_ = np.linalg.lstsq(w[:, None], w * (measured - base), rcond=None)
    return max(float(c), lo)


def abs_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """|predicted / measured - 1|, fractions."""
    return np.abs(np.asarray(predicted) / measured - 1.0)


# ---- GEMMs ----------------------------------------------------------------------------------------------

GEMM_BOUNDS = {"compute": Bound(0.2, 1.0), "memory": Bound(0.3, 1.0), "kernel_s": Bound(0.0, 30e-6)}
PAD_ROWS_BOUND = Bound(0.0, 512.0)
GEMM_START = {"compute": 0.7, "memory": 0.8, "kernel_s": 4e-6, "gemm_pad_rows": 64.0}


def predict_gemms(points: GemmPoints, hardware, params: Mapping[str, float], *, weight_bytes: float = 2.0,
                  act_bytes: float = 2.0) -> np.ndarray:
    """Seconds `gemm_seconds` predicts for every point on `hardware` (a HardwareSpec) with `params`
    (compute, memory, kernel_s, gemm_pad_rows)."""
    return gemm_seconds(points.m, points.k, points.n, peak_flops=hardware.flops_bf16, mem_bw=hardware.hbm_bw,
                        weight_bytes=weight_bytes, act_bytes=act_bytes, compute=params["compute"],
                        memory=params["memory"], kernel_s=params["kernel_s"],
                        pad_rows=params.get("gemm_pad_rows", 0.0), sm_count=hardware.sm_count)


def memory_bound(points: GemmPoints, hardware, compute: float = 0.7, memory: float = 0.8) -> np.ndarray:
    """Mask of the points whose plain roofline (no padding) is memory-bound at typical efficiencies."""
    flops_s = 2.0 * points.m * points.k * points.n / (compute * hardware.flops_bf16)
    bytes_s = 2.0 * (points.k * points.n + points.m * (points.k + points.n)) / (memory * hardware.hbm_bw)
    return bytes_s >= flops_s


def fit_gemms(points: GemmPoints, hardware, start: Mapping[str, float] | None = None) -> FitResult:
    """compute, memory, kernel_s (and gemm_pad_rows when hardware.sm_count == 0; else it stays 0) fitted to
    measured GEMMs: memory-bound regime, then compute-bound, then all together."""
    if len(points) == 0:
        raise ValueError("no GEMM points to fit")
    p = {**GEMM_START, **(start or {})}
    tiled = hardware.sm_count > 0
    if tiled:
        p["gemm_pad_rows"] = 0.0
    mem = memory_bound(points, hardware)
    regimes = [(mem, ("memory", "kernel_s")), (~mem, ("compute",) if tiled else ("compute", "gemm_pad_rows"))]
    for mask, names in regimes:
        if mask.sum() >= 3:
            sub = points.select(mask)
            if "kernel_s" in names:
                base = predict_gemms(sub, hardware, {**p, "kernel_s": 0.0})
                p["kernel_s"] = float(np.clip(additive_start(base, sub.seconds), *_span(GEMM_BOUNDS["kernel_s"])))
            p = fit_params(lambda q, s=sub: predict_gemms(s, hardware, q), sub.seconds, _bounds(names),
                           p, fixed=p, sweeps=8)
    names = tuple(GEMM_BOUNDS) + (() if tiled else ("gemm_pad_rows",))
    p = fit_params(lambda q: predict_gemms(points, hardware, q), points.seconds, _bounds(names), p, fixed=p,
                   sweeps=6)
    return FitResult(p, abs_errors(predict_gemms(points, hardware, p), points.seconds))


def _bounds(names) -> dict[str, Bound]:
    return {n: PAD_ROWS_BOUND if n == "gemm_pad_rows" else GEMM_BOUNDS[n] for n in names}


def _span(b: Bound) -> tuple[float, float]:
    return b.lo, b.hi


# ---- collectives ----------------------------------------------------------------------------------------

COLLECTIVE_BOUNDS = {"link": Bound(0.05, 1.0), "collective_s": Bound(0.0, 200e-6),
                     "collective_per_peer_s": Bound(0.0, 20e-6)}
COLLECTIVE_START = {"link": 0.75, "collective_s": 12e-6, "collective_per_peer_s": 0.4e-6}


def predict_collectives(points: CollectivePoints, hardware, params: Mapping[str, float]) -> np.ndarray:
    """Seconds of each collective, in the roofline's forms: an all-reduce is a ring, 2 (p - 1) / p of the
    bytes each way, plus collective_s + collective_per_peer_s * (p - 1); a send/recv moves the bytes once
    plus collective_s. The link is NVLink when all workers share a node, else the network (the slower)."""
    p, n = points.workers, points.bytes
    one_node = points.devices_per_node >= p
    bw = np.where(one_node, hardware.nvlink_bw, hardware.network_bw) * params["link"]
    ring = points.collective == "all_reduce"
    moved = np.where(ring, 2.0 * (p - 1) / p * n, n)
    latency = params["collective_s"] + np.where(ring, params["collective_per_peer_s"] * (p - 1), 0.0)
    with np.errstate(divide="ignore"):
        return latency + moved / bw


def fit_collectives(points: CollectivePoints, hardware, start: Mapping[str, float] | None = None) -> FitResult:
    """link, collective_s, collective_per_peer_s fitted to measured collectives on `hardware`."""
    if len(points) == 0:
        raise ValueError("no collective points to fit")
    spans_nodes = points.devices_per_node < points.workers
    if spans_nodes.any() and not hardware.network_bw > 0:
        raise ValueError(f"collectives across nodes were measured but hardware {hardware.name} has no network "
                         "(network_gbs == 0): use a hardware file with network_gbs, or only intra-node profiles")
    p = {**COLLECTIVE_START, **(start or {})}
    base = predict_collectives(points, hardware, {**p, "collective_s": 0.0})
    p["collective_s"] = float(np.clip(additive_start(base, points.seconds), *_span(COLLECTIVE_BOUNDS["collective_s"])))
    p = fit_params(lambda q: predict_collectives(points, hardware, q), points.seconds, COLLECTIVE_BOUNDS, p,
                   sweeps=10)
    return FitResult(p, abs_errors(predict_collectives(points, hardware, p), points.seconds))


def fit_collective_links(points: CollectivePoints, hardware) -> tuple[FitResult, FitResult | None]:
    """(NVLink fit, network fit): one fit of the collectives inside a node (the top-level link,
    collective_s, collective_per_peer_s) and, when the points cross nodes, a second of link and
    collective_s to those (the `network` module's override). One link fraction cannot serve both: Vidur's
    A100 cluster reaches about half of its NVLink but a quarter of its InfiniBand data-sheet rate."""
    inside = points.devices_per_node >= points.workers
    if not inside.any():
        raise ValueError("no collective inside one node (devices_per_node >= num_workers) to fit the NVLink "
                         "factors to; add an intra-node all_reduce.csv or send_recv.csv")
    nvlink = fit_collectives(points.select(inside), hardware)
    if inside.all():
        return nvlink, None
    across = points.select(~inside)
    per_peer = {"collective_per_peer_s": nvlink.params["collective_per_peer_s"]}
    p = {**nvlink.params}
    bounds = {k: b for k, b in COLLECTIVE_BOUNDS.items() if k != "collective_per_peer_s"}
    p = fit_params(lambda q: predict_collectives(across, hardware, q), across.seconds, bounds, p, fixed=per_peer)
    return nvlink, FitResult(p, abs_errors(predict_collectives(across, hardware, p), across.seconds))
