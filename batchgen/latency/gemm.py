"""Time of a weight GEMM on a GPU, following its output tiles and the waves they run in.

Why tiles. A GEMM kernel cuts the [m x n] output into tiles of BM x BN, one thread block each, and runs
them in waves of one tile per SM. A partial last wave costs a whole one, and a partial tile costs a whole
tile: so measured time is a staircase in m, not a line, and efficiency jumps by up to ~30% between
neighbouring token counts (Vidur's A100/H100 profiles). A roofline with a constant `pad_rows` can only
follow the staircase on average; following the tiles follows the steps.

Form (sm_count > 0). For each candidate kernel (a tile shape from cuBLAS' usual set, with split-K by 2 or
4 for the small ones, which is how cuBLAS fills the SMs when there are few output tiles):

    tiles    = ceil(rows / BM) * ceil(n / BN) * split            rows = m / calls (+ pad_rows) per call
    tile_s   = max(2 BM BN k_s / (compute * peak / sms),        k_s = ceil(k / split) + _K_FILL
                   (BM act + BN weight) k_s / (_L2_PER_HBM * hbm / sms))
    compute  = calls * ceil(tiles / sms) * tile_s
    memory   = (weights * calls + (m k + m n) act + split-K partials) / (memory * hbm)
    t        = (compute^2 + memory^2)^(1/2) + calls * kernel_s

and the kernel with the least time wins, as cuBLAS' heuristics aim to. The second term of `tile_s` is why
small tiles are not free: a tile re-reads its operands from L2 for every 2 BM BN / (BM + BN) FLOPs, and L2
bandwidth caps the FLOP rate of thin tiles, more so on GPUs whose FLOP/s outgrow their bandwidth (Hopper).
`_K_FILL` is the pipeline fill of a tile's main loop (a couple of k-blocks): it is why GEMMs with a short k
(an o_proj sharded 8 ways) reach less of the peak. Compute and memory overlap imperfectly: measured GEMMs
near the ridge (64-256 tokens) take up to ~30% longer than the larger of the two, which the 2-norm follows
and a max does not; the price is that the fitted `memory` is the bandwidth fraction before that loss, so
it comes out higher (0.88 A100, 0.96 H100) than a pure streaming kernel's. The three constants below were
chosen by a sweep over the Vidur profiles (A100 is insensitive to them; H100 wants _L2_PER_HBM >= 5 and the
2-norm), so they are fitted too, not data-sheet facts.

Form (sm_count == 0: unknown hardware or a CPU). The pad-rows roofline: every call costs `pad_rows` extra
rows of compute, the average of the staircase above.

`m` counts rows over all `calls` together (calls equal GEMMs of m / calls rows each, e.g. micro-batches
that each re-read the weights), matching the roofline's `tokens` and `micro_batches`.
"""
from __future__ import annotations

import numpy as np

# (BM, BN, split-K): output tile and number of k slices. Split-K only for small tiles: it is for small m.
_KERNELS = ((64, 64, 1), (64, 128, 1), (128, 64, 1), (128, 128, 1), (128, 256, 1), (256, 128, 1),
            (64, 64, 2), (64, 128, 2), (64, 64, 4), (64, 128, 4))
_L2_PER_HBM = 5.0  # L2 -> SM operand bandwidth / HBM bandwidth (see the docstring)
_K_FILL = 64.0  # k elements of pipeline fill and epilogue per tile
_OVERLAP_P = 2.0  # compute and memory overlap as a p-norm: the max as p -> inf, their sum at p = 1
_PARTIAL_BYTES = 4  # split-K partial sums are fp32, written and read back once each


def gemm_seconds(m, k, n, *, peak_flops: float, mem_bw: float, weight_bytes: float, act_bytes: float,
                 compute: float, memory: float, kernel_s: float, pad_rows: float, sm_count: int = 0,
                 calls=1):
    """Seconds of `calls` GEMMs, each [m x k] activations @ [k x n] weights (weights read once per call),
    numpy-broadcast over m and calls (k, n may be arrays too); 0 where m == 0.

    `m` is the rows of all calls together (each call gets m / calls); `compute` and `memory` are achieved
    fractions of `peak_flops` and `mem_bw`; `kernel_s` is paid once per call. See the module docstring.
    """
    m = np.asarray(m, dtype=float)
    k = np.asarray(k, dtype=float)
    n = np.asarray(n, dtype=float)
    calls = np.maximum(np.asarray(calls, dtype=float), 1.0)
    bw = memory * mem_bw
    io = (m * k + m * n) * act_bytes
    weights = k * n * weight_bytes * calls
    if sm_count <= 0:
        flops = 2.0 * (m + pad_rows * calls) * k * n
        t = np.maximum(flops / (compute * peak_flops), (weights + io) / bw)
    else:
        t = _tiled(m / calls + pad_rows, k, n, calls, weights + io, peak_flops, mem_bw, weight_bytes,
                   act_bytes, compute, bw, int(sm_count))
    t = t + calls * kernel_s
    t = np.where(m > 0, t, 0.0)
    return float(t) if t.ndim == 0 else t


def _tiled(rows, k, n, calls, bytes_, peak_flops, mem_bw, weight_bytes, act_bytes, compute, bw, sms):
    """min over _KERNELS of overlap(waves x tile time, memory time), without launches. Kernels of one split
    share their memory time and the overlap grows with compute, so the least compute per split decides."""
    sm_flops = compute * peak_flops / sms
    sm_l2 = _L2_PER_HBM * mem_bw / sms
    row_tiles = {bm: np.ceil(rows / bm) for bm in {bm for bm, _, _ in _KERNELS}}
    col_tiles = {bn: np.ceil(n / bn) for bn in {bn for _, bn, _ in _KERNELS}}
    least: dict[int, np.ndarray] = {}
    for bm, bn, split in _KERNELS:
        k_s = np.ceil(k / split) + _K_FILL
        tile_s = k_s * max(2.0 * bm * bn / sm_flops, (bm * act_bytes + bn * weight_bytes) / sm_l2)
        waves = np.ceil(row_tiles[bm] * col_tiles[bn] * (split / sms))
        c = waves * tile_s
        least[split] = c if split not in least else np.minimum(least[split], c)
    best = None
    for split, c in least.items():
        mem = bytes_ if split == 1 else bytes_ + 2.0 * (split - 1) * rows * n * calls * _PARTIAL_BYTES
        t = _overlap(calls * c, mem / bw)
        best = t if best is None else np.minimum(best, t)
    return best


def _overlap(a, b):
    """(a^p + b^p)^(1/p): the larger of two times plus some of the smaller, most where they are equal."""
    if _OVERLAP_P == 2.0:
        return np.hypot(a, b)
    hi = np.maximum(a, b)
    lo = np.minimum(a, b)
    return hi * (1.0 + (lo / np.where(hi > 0, hi, 1.0)) ** _OVERLAP_P) ** (1.0 / _OVERLAP_P)
