"""Static batching (Hugging Face `generate` style): fixed batches run to completion.

Each rank takes the next `batch_size` prompts of its queue, prefills them padded to the longest prompt, and
decodes until every sequence of the batch has ended; finished rows keep costing compute (padding) until the
batch is done. Only then does the rank take its next batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.memory import BatchShape
from batchgen.policy.base import Decision, PolicyDefaults, Snapshot
from batchgen.policy.common import pages_for, shed_to_fit


@dataclass(frozen=True)
class StaticPolicy(PolicyDefaults):
    batch_size: int = 64
    name: str = "static"
    can_stream_weights: bool = False
    uses_host_kv: bool = False

    def __post_init__(self):
        for key in ("batch_size",):
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")

    def batch_shape(self, max_context: int) -> BatchShape:
        """batch_size rows, prompts padded to the longest: the prefill forward holds batch_size x max_context."""
        return BatchShape(gate_tokens=self.batch_size * max_context, attn_seqs=self.batch_size,
                          prefill_tokens=self.batch_size * max_context)

    def decide(self, snap: Snapshot) -> Decision:
        R, P = snap.num_ranks, snap.page_tokens
        # Boundaries every page: the batch's KV grows by a page at a time, and memory is checked there.
        d = Decision(stop="rank_drains", steps=P, padded=True)
        if len(snap.pending):
            ids = snap.pending.peek(len(snap.pending))
            d.pin_ids, d.pin_ranks = ids, np.arange(ids.size) % R
        count = np.bincount(snap.active_rank, minlength=R)
        # Batches that cannot grow by one page lose their newest rows (they are recomputed later): the
        # stand-in for an out-of-memory error, so that the job still finishes.
        need = pages_for(snap.active_context + P, P)
        drop = shed_to_fit(snap.active_rank, need, -snap.active_decoded.astype(float), snap.pages_capacity)
        d.evict_ids = snap.active_ids[drop]
        ids, ranks = [], []
        for r in np.flatnonzero(count == 0):
            fresh = d.pin_ids[d.pin_ranks == r] if d.pin_ids.size else np.empty(0, np.int64)
            cand = np.concatenate([snap.pinned[r].peek(self.batch_size), fresh])[: self.batch_size]
            if not cand.size:
                continue
            longest = snap.lengths.context(cand).max()
            fits = np.cumsum(np.full(cand.size, pages_for(longest + 1, P))) <= snap.pages_capacity[r]
            n = max(int(fits.sum()), 1)
            ids.append(cand[:n])
            ranks.append(np.full(n, r))
        if ids:
            d.prefill_ids, d.prefill_ranks = np.concatenate(ids), np.concatenate(ranks)
            d.prefill_pinned = True
        return d
