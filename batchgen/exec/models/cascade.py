"""Cascade attention's two halves and their merge (batchgen.core.cascade decides which calls cascade).

A cascaded call's rows are decode queries that hold one shared prefix. Their attention over [prefix | own pages]
is computed as two softmax-attentions, each returning its output and the log-sum-exp of its scores: every
query over the prefix's keys, gathered once for the whole call (one batch of B x rep queries per KV head), and
each query over its own pages. The merge weighs each half by exp(its lse - the joint lse), which is the softmax
over the concatenated scores: the same result, up to rounding, as one attention over the whole context.
"""

from __future__ import annotations

import torch


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., Q, D], k [..., L, D], v [..., L, Dv], mask broadcastable to [..., Q, L] (True: attend) ->
    (out [..., Q, Dv], lse [..., Q]). Every query must see at least one key."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial attentions of the same queries over disjoint keys -> the attention over all of them."""
    joint = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - joint)[..., None] + out_b * torch.exp(lse_b - joint)[..., None]


def prefix_pages(pool: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The prefix's slots of a pool [pages, page_size, ...] -> [prefix tokens, ...], read once."""
    return pool.index_select(0, pages).flatten(0, 1).to(dtype)
