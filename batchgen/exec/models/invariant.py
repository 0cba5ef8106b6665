"""Batch-invariant mode: a token's result is bitwise the same whatever else is in its batch, and whether it is
computed in a prefill or in a decode step.

Why: a sequence whose KV is recomputed (a resumed batch job, a recovered worker's sequences, a preempted and
restored one) gets its context's K/V from one batched prefill, while the run that produced those tokens computed
each of them in a decode step beside other sequences. A CPU GEMM picks its kernel by shape (measured with this
torch's BLAS, fp32, one thread: a 1-row product, 2 to 5 rows at K=128 (2 to 10 at K=256), and more rows each
give a row different last bits), SDPA picks its algorithm by query length, so a row's last bits depend on its
batch, and a near-tie of greedy sampling flips.

How, when `enabled()`:

- every product over rows (`linear`) runs on tiles of exactly TILE rows, the last one zero-padded: every call
  has one shape, hence one kernel, and a row's place in a tile does not change its result (`tests/exec/
  test_batch_invariant.py` checks both). The SwiGLU MLP and each MoE expert run whole on tiles (`swiglu`), so
  their elementwise ops also see fixed shapes; the MoE never uses the grouped GEMM.
- attention (`attend`) computes each query against its own context only, padded with masked keys to a multiple
  of TILE, with every reduction along a contiguous last axis: its sums depend on the query's context length
  alone, the same in a prefill as in a decode.
- everything else the decoder does is already row-wise: norms reduce along a row, the router's softmax and top-k
  work per row, each token's expert outputs are added in expert order.

What it does not cover: MLA attention (DeepSeek-V3), refused by `check_supported`; a different machine, thread
count, BLAS or dtype may give different (but again batch-invariant) bits. Its cost: benchmarks/batch_invariant.py.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

TILE = 64  # rows per GEMM tile and the key padding unit; 64 rows is past every small-M kernel measured
_ATTN_BYTES = 64 << 20  # a bound on each attention chunk's product tensor
_state = {"on": False}


def enabled() -> bool:
    return _state["on"]


@contextlib.contextmanager
def mode(on: bool):
    """Batch-invariant computation inside the block (for this process: forked workers inherit it, and a dist
    worker sets it itself from its settings)."""
    before = _state["on"]
    _state["on"] = bool(on)
    try:
        yield
    finally:
        _state["on"] = before


def check_supported(architecture: str) -> None:
    if architecture == "deepseek_v3":
        raise ValueError("backend.batch_invariant=true covers GQA attention (Mixtral, Qwen3-MoE, Llama-style), not "
                         "DeepSeek-V3's MLA: set backend.batch_invariant=false for this model")


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) that runs on tiles in batch-invariant mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias) if _state["on"] else F.linear(x, self.weight, self.bias)


def _tiles(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [T, K] zero-padded to a whole number of tiles, and T."""
    T = x.shape[0]
    pad = -T % TILE
    return (F.pad(x, (0, 0, 0, pad)) if pad else x), T


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over [T, K] rows, one fixed-shape GEMM per TILE rows."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    xp, T = _tiles(x)
    return torch.cat([F.linear(t, weight, bias) for t in xp.split(TILE)])[:T]


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) over [T, H] rows, the whole block per tile of TILE rows."""
    xp, T = _tiles(x)
    return torch.cat([F.linear(F.silu(F.linear(t, w_gate)) * F.linear(t, w_up), w_down)
                      for t in xp.split(TILE)])[:T]


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta, sliding_window: int | None = None
           ) -> torch.Tensor:
    """q [T, H, D] (the new tokens, their K/V already in the pools) -> [T, H, Dv]. Each query attends the keys
    of its own sequence at positions (p - window, p], read slot by slot from the pages, in chunks of queries
    that share a padded key count."""
    T, H, D = q.shape
    Hkv, Dv, ps = k_pool.shape[2], v_pool.shape[-1], meta.page_size
    rep, scale = H // Hkv, 1.0 / math.sqrt(D)
    dev = k_pool.device
    seq = torch.repeat_interleave(torch.arange(meta.num_sequences, device=dev), meta.query_lens().to(dev),
                                  output_size=T)
    pos = meta.positions.to(dev)
    lo = (pos - sliding_window + 1).clamp(min=0) if sliding_window else torch.zeros_like(pos)
    n_keys = pos - lo + 1
    padded = (n_keys + TILE - 1) // TILE * TILE
    flat_k, flat_v = k_pool.view(-1, Hkv, D), v_pool.view(-1, Hkv, Dv)
    table = meta.block_table.to(dev)
    out = q.new_empty(T, H, Dv)
    for width in padded.unique().tolist():
        j = torch.arange(width, device=dev)
        per_chunk = max(1, _ATTN_BYTES // (H * width * max(D, Dv) * q.element_size()))
        for rows in (padded == width).nonzero().squeeze(1).split(per_chunk):
            n = rows.numel()
            valid = j[None, :] < n_keys[rows, None]
            kpos = torch.where(valid, lo[rows, None] + j[None, :], lo[rows, None])  # masked slots read a real key
            slot = table[seq[rows, None], kpos // ps] * ps + kpos % ps
            keys = flat_k[slot].to(q.dtype).permute(0, 2, 1, 3)  # [n, Hkv, width, D]
            vals = flat_v[slot].to(q.dtype).permute(0, 2, 3, 1).contiguous()  # [n, Hkv, Dv, width]
            qc = q[rows].view(n, Hkv, rep, 1, D)
            scores = (qc * keys[:, :, None]).sum(-1) * scale  # [n, Hkv, rep, width]
            probs = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
            out[rows] = (probs[:, :, :, None, :] * vals[:, :, None]).sum(-1).reshape(n, H, Dv)
    return out
