"""Continuous batching as serving engines do it today (vLLM, SGLang with DP attention + EP).

Each sequence is pinned to one rank when the job starts (round-robin, like a data-parallel router at
arrival) and never leaves it. A rank with waiting prompts and free KV pages prefills first (up to
`max_prefill_tokens` per forward); otherwise it decodes its running batch, which is also the expert batch:
one batch size for attention and experts. When KV runs out, the newest sequences are preempted and later
recomputed. Decisions are taken at every sequence finish (iteration granularity) while prompts wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.memory import BatchShape
from batchgen.policy.base import Decision, Snapshot
from batchgen.policy.common import pages_for, per_rank, shed_to_fit


@dataclass(frozen=True)
class ContinuousPolicy:
    max_running: int = 256           # per rank (CUDA-graph / scheduler cap)
    max_prefill_tokens: int = 16384  # per rank per forward
    admit_watermark: float = 0.01    # keep this share of KV pages free when admitting
    page_lookahead: int = 64         # decode iterations between memory checks when nothing waits
    name: str = "continuous"
    can_stream_weights: bool = False
    uses_host_kv: bool = False

    def __post_init__(self):
        for key in ("max_running", "max_prefill_tokens", "page_lookahead"):
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")

    def batch_shape(self, max_context: int) -> BatchShape:
        """One batch for attention and experts: max_running sequences, or a prefill forward's token budget."""
        return BatchShape(gate_tokens=max(self.max_running, self.max_prefill_tokens), attn_seqs=self.max_running,
                          prefill_tokens=self.max_prefill_tokens)

    def decide(self, snap: Snapshot) -> Decision:
        R, P = snap.num_ranks, snap.page_tokens
        d = Decision(micro_batch=0, stop="first_finish", steps=self.page_lookahead)
        if len(snap.pending):  # pin everything once, round-robin over ranks
            ids = snap.pending.peek(len(snap.pending))
            d.pin_ids, d.pin_ranks = ids, np.arange(ids.size) % R
        waiting = np.array([len(q) for q in snap.pinned]) + np.bincount(d.pin_ranks, minlength=R)
        steps = self.page_lookahead
        # Preempt (recompute) the newest sequences when the next `steps` tokens would not fit.
        need = pages_for(snap.active_context + steps, P)
        drop = shed_to_fit(snap.active_rank, need, -snap.active_decoded.astype(float), snap.pages_capacity)
        keep = np.ones(snap.active_ids.size, bool)
        keep[drop] = False
        d.evict_ids = snap.active_ids[drop]
        count = np.bincount(snap.active_rank[keep], minlength=R)
        free = snap.pages_capacity * (1 - self.admit_watermark) - per_rank(snap.active_rank[keep], need[keep], R)
        prefill_ids, prefill_ranks = [], []
        for r in np.flatnonzero((waiting > 0) & (count < self.max_running)):
            queue = snap.pinned[r]
            fresh = d.pin_ids[d.pin_ranks == r] if d.pin_ids.size else np.empty(0, np.int64)
            evicted_here = d.evict_ids[snap.active_rank[drop] == r]
            cand = np.concatenate([evicted_here, queue.peek(self.max_running), fresh])[: self.max_running - count[r]]
            if evicted_here.size:
                continue  # memory is short on this rank: decode to make room before admitting again
            ctx = snap.lengths.context(cand)
            fit_mem = np.cumsum(pages_for(ctx + 1, P)) <= free[r]
            fit_tok = np.cumsum(ctx) <= self.max_prefill_tokens
            fit_tok[0] = True  # a long prompt still goes through alone
            n = int(np.argmin(fit_mem & fit_tok)) if not (fit_mem & fit_tok).all() else cand.size
            if n:
                prefill_ids.append(cand[:n])
                prefill_ranks.append(np.full(n, r))
        if prefill_ids:
            d.prefill_ids, d.prefill_ranks = np.concatenate(prefill_ids), np.concatenate(prefill_ranks)
            d.prefill_pinned = True
        if not (waiting.sum() - d.prefill_ids.size) and not drop.size:
            d.stop = "none"  # nothing to admit at a finish: run a whole page
        return d
