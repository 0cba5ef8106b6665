"""Continuous batching as serving engines do it today (vLLM, SGLang with DP attention + EP).

Each sequence is pinned to one rank when the job starts (round-robin, like a data-parallel router at
arrival) and never leaves it. Its running batch is also the expert batch: one batch size for attention and
experts. When KV runs out, the newest sequences are preempted and later recomputed.

Chunked prefill (`chunked_prefill`, the default, as vLLM and SGLang run): every forward is built from a token
budget per rank (`token_budget`): one token for each running sequence first, then as much of the waiting prompts
as fits, FIFO; a prompt longer than what is left is split over several forwards (its KV written chunk by chunk,
its pages allocated as chunks land), so decode never stalls while prompts wait. A sequence part-way through its
prefill continues first in the next forward; preempted, it frees its pages and restarts. With prompts waiting
a decision is taken at every forward; with none, once per page of decode.

Without it (`chunked_prefill: false`, the older engines' rule): a rank with waiting prompts and free KV pages
prefills whole prompts first (up to `max_prefill_tokens` per forward) while decode waits; otherwise it decodes.
Decisions are taken at every sequence finish (iteration granularity) while prompts wait.
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
    chunked_prefill: bool = True     # forwards from a token budget: decodes first, then prompt chunks
    token_budget: int = 8192         # chunked prefill: tokens per rank per forward (decodes + prompt chunks)
    name: str = "continuous"
    can_stream_weights: bool = False
    uses_host_kv: bool = False

    def __post_init__(self):
        for key in ("max_running", "max_prefill_tokens", "page_lookahead", "token_budget"):
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")

    def batch_shape(self, max_context: int) -> BatchShape:
        """One batch for attention and experts: max_running sequences, or a prefill forward's token budget."""
        prefill = self.token_budget if self.chunked_prefill else self.max_prefill_tokens
        return BatchShape(gate_tokens=max(self.max_running, prefill), attn_seqs=self.max_running,
                          prefill_tokens=prefill)

    def decide(self, snap: Snapshot) -> Decision:
        if self.chunked_prefill:
            return self._decide_chunked(snap)
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

    def _decide_chunked(self, snap: Snapshot) -> Decision:
        R, P = snap.num_ranks, snap.page_tokens
        d = Decision(micro_batch=0, stop="first_finish", steps=self.page_lookahead)
        if len(snap.pending):  # pin everything once, round-robin over ranks
            ids = snap.pending.peek(len(snap.pending))
            d.pin_ids, d.pin_ranks = ids, np.arange(ids.size) % R
        waiting = np.array([len(q) for q in snap.pinned]) + np.bincount(d.pin_ranks, minlength=R)
        prefilled = snap.active_prefilled
        partial = prefilled > 0
        # Preempt (recompute) the newest sequences when the running ones' next page of tokens would not fit; a
        # part-prefilled prompt needs the pages of what it has written.
        need = np.where(partial, pages_for(prefilled, P), pages_for(snap.active_context + self.page_lookahead, P))
        drop = shed_to_fit(snap.active_rank, need, -snap.active_decoded.astype(float), snap.pages_capacity)
        keep = np.ones(snap.active_ids.size, bool)
        keep[drop] = False
        d.evict_ids = snap.active_ids[drop]
        count = np.bincount(snap.active_rank[keep], minlength=R)
        free = snap.pages_capacity * (1 - self.admit_watermark) - per_rank(snap.active_rank[keep], need[keep], R)
        budget = self.token_budget - np.bincount(snap.active_rank[keep & ~partial], minlength=R)
        ids_out, ranks_out, lens_out = [], [], []
        evicted_ranks = snap.active_rank[drop]
        for r in np.flatnonzero((budget > 0) & ((waiting > 0) | np.bincount(snap.active_rank[keep & partial],
                                                                             minlength=R).astype(bool))):
            if np.any(evicted_ranks == r):
                continue  # memory is short on this rank: decode to make room before prefilling again
            mine = keep & partial & (snap.active_rank == r)
            going = snap.active_ids[mine]  # part-way through: they continue first
            fresh = d.pin_ids[d.pin_ranks == r] if d.pin_ids.size else np.empty(0, np.int64)
            slots = max(self.max_running - int(count[r]), 0)
            queued = np.concatenate([snap.pinned[r].peek(slots), fresh])[:slots]
            cand = np.concatenate([going, queued])
            start = np.concatenate([prefilled[mine], np.zeros(queued.size, np.int64)])
            ids, lens = _fill_budget(cand, start, snap.lengths.context(cand), int(budget[r]), float(free[r]), P)
            if ids.size:
                ids_out.append(ids)
                ranks_out.append(np.full(ids.size, r))
                lens_out.append(lens)
        if ids_out:
            d.chunk_ids, d.chunk_ranks = np.concatenate(ids_out), np.concatenate(ranks_out)
            d.chunk_lens = np.concatenate(lens_out)
            d.prefill_pinned = True
        if not waiting.sum() and not partial.any() and not drop.size:
            d.stop = "none"  # nothing to admit at a finish: run a whole page
        return d


def _fill_budget(cand: np.ndarray, start: np.ndarray, context: np.ndarray, budget: int, free_pages: float,
                 page_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks for FIFO candidates (those part-way through first) within a rank's token budget and free pages:
    each takes what is left of its context or of the budget, cut to the pages it can still get (a chunk that
    completes its context also needs room for the first token). Stops at the first candidate that cannot move,
    so FIFO order holds. Returns (ids, chunk lengths)."""
    ids, lens = [], []
    for sid, s, c in zip(cand.tolist(), start.tolist(), context.tolist()):
        if budget <= 0:
            break
        held = -(-s // page_tokens)
        end = min(c, s + budget)
        if end == c and -(-(c + 1) // page_tokens) - held > free_pages:
            end = c - 1  # the whole rest does not fit with its first token: write what fits, finish later
        end = min(end, int((held + max(free_pages, 0)) // 1) * page_tokens)
        if end <= s:
            break
        ids.append(sid)
        lens.append(end - s)
        budget -= end - s
        free_pages -= -(-(end + (end == c)) // page_tokens) - held
    return np.array(ids, np.int64), np.array(lens, np.int64)
