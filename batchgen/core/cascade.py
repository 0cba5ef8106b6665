"""Cascade attention: which decode queries read their shared prefix's KV once per call instead of once each.

Why. Decode attention is memory-bound: each query streams its whole context's KV. Sequences that hold the same
prefix pages (batchgen.core.prefix_pages) stream the same bytes again and again. A cascade (Hydragen, FlashInfer's
cascade attention, vLLM's `use_cascade_attention`) splits their attention in two kernels: every member's query over
the prefix's KV, read once for all of them, and each member over its own pages; the two partial results are
merged by their log-sum-exp (batchgen.exec.models.cascade). The scores are the same; only the KV bytes read fall.

Who decides. The engine, once per run (`CascadeRule.groups` and `staged_groups`, called by `apply_decision`): the
plan carries, per decode query, the group whose prefix it reads by cascade and that prefix's tokens. The simulator
prices exactly those cascades (batchgen.pricing.costs.cascade_load) and the executors perform exactly those
(batchgen.exec.runner): a cascade's members on a rank are called together, in calls of at most B_attn members,
each call reading the prefix once. Decode queries only: a prompt chunk reads the prefix with its own queries.

Host-resident members too. Their KV is restored from their host copies into a staging buffer for each call; every
member's copy begins with the same prefix, so a cascaded call restores the prefix's pages once (from its first
member's copy) and attends them once: the host link carries each prefix once per call instead of once per member.

The modes (`policy.cascade_attention`):
- `groups`: a group's device-resident holders decoding on a rank form a cascade where it pays: the latency model
  prices the rank's decode attention with and without it, the cascaded members called apart from the others and
  each call reading the prefix once (`pays`, batchgen.pricing.costs.cascade_pays): a memory-bound attention over
  long shared prefixes gains; a compute-bound one (MLA's many heads), tiny reads, or calls split into many small
  ones do not. Its host-resident members restored into staging, two or more on a rank, form one always;
- `batch`: vLLM's rule, at its defaults. A rank's forward runs one cascade when every sequence in it holds the same
  prefix, of at least 256 tokens, over at least 8 requests, on an attention without MLA; in a forward of decodes
  only, with grouped-query heads, only where its model of the kernels' waves says a cascade beats flash decoding
  (tiles of 128 queries and 128 keys over the GPU's SMs);
- `off`: none (SGLang's default backends have no cascade).
The executor runs batch-invariant jobs and sliding-window models without cascades (batchgen.exec.run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

MODES = ("off", "groups", "batch")
BATCH_MIN_PREFIX = 256   # vLLM: a shorter common prefix is not worth a cascade
BATCH_MIN_REQUESTS = 8   # vLLM: nor are fewer requests
_TILE = 128              # vLLM's model of the kernels: query and key tiles


def cascade_mode(mode) -> str:
    """The mode, checked; YAML's `off` (read as false) is off."""
    if mode is False:
        return "off"
    if mode not in MODES:
        raise ValueError(f"policy.cascade_attention must be one of {', '.join(MODES)}, got {mode!r}: groups (every "
                         "group decoding together on a rank), batch (vLLM's rule: the whole forward shares one "
                         "prefix) or off")
    return mode


@dataclass(frozen=True)
class CascadeRule:
    """The mode and what the `batch` rule needs of the model and GPU."""

    mode: str = "off"
    heads: int = 1
    kv_heads: int = 1
    mla: bool = False
    sm_count: int = 0      # 0: unknown (the wave model is skipped)
    # groups, per rank: (its device decode queries, their summed context, each candidate's members and prefix
    # tokens, B_attn) -> which candidates to cascade; None: every one
    pays: Callable[[int, float, np.ndarray, np.ndarray, int], np.ndarray] | None = None

    def __post_init__(self) -> None:
        cascade_mode(self.mode)

    def groups(self, rank: np.ndarray, group: np.ndarray, held: np.ndarray, context: np.ndarray,
               eligible: np.ndarray, micro_batch: int, other_rank: np.ndarray, other_group: np.ndarray) -> np.ndarray:
        """Per decode query: the group whose prefix it reads by cascade, -1 for none. `held`: shared tokens it
        holds by reference (0: none); `eligible`: device-resident and not PARTITIONed. `other_rank`: the rank of
        each other sequence in the forward (prompts and prompt chunks), `other_group`: the group whose prefix it
        holds, -1 for none (the `batch` rule needs the whole forward to share one prefix)."""
        out = np.full(rank.size, -1, np.int64)
        holder = eligible & (held > 0)
        if self.mode == "off" or not holder.any():
            return out
        if self.mode == "groups":
            width = int(group.max()) + 1
            key = rank[holder] * width + group[holder]
            cascades, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
            pays = counts >= 2
            if self.pays is not None and pays.any():
                prefix = np.zeros(counts.size)
                prefix[inverse] = held[holder]
                where = cascades // width
                queries = np.bincount(rank[eligible], minlength=int(rank.max()) + 1)
                summed = np.bincount(rank[eligible], weights=context[eligible], minlength=queries.size)
                for r in np.unique(where[pays]).tolist():
                    mine = np.flatnonzero(pays & (where == r))
                    pays[mine] = self.pays(int(queries[r]), float(summed[r]), counts[mine].astype(float),
                                           prefix[mine], micro_batch)
            members = np.flatnonzero(holder)[pays[inverse]]
            out[members] = group[members]
            return out
        if self.mla:
            return out
        for r in np.unique(rank[holder]).tolist():
            mine = rank == r
            g = group[mine]
            if not holder[mine].all() or (g != g[0]).any():
                continue  # some decode holds no prefix, or another one
            others = other_rank == r
            n = int(mine.sum()) + int(others.sum())
            tokens = int(held[mine].min())
            if (other_group[others] != g[0]).any() or n < BATCH_MIN_REQUESTS or tokens < BATCH_MIN_PREFIX:
                continue
            if not others.any() and not self._beats_flash_decoding(n, tokens):
                continue
            out[mine] = g[0]
        return out

    def staged_groups(self, rank: np.ndarray, group: np.ndarray, tokens: np.ndarray, staged: np.ndarray) -> np.ndarray:
        """Per decode query: the group whose prefix it reads by cascade among host-resident queries whose KV is
        restored into staging (`staged`), -1 for none. `tokens`: the whole pages of its prefix its host copy holds.
        Under `groups`, two or more of a group on a rank cascade: their calls restore the prefix's pages once and
        attend them once (a copy over the host link saved per member but one, which a launch never outweighs)."""
        out = np.full(rank.size, -1, np.int64)
        member = staged & (group >= 0) & (tokens > 0)
        if self.mode != "groups" or not member.any():
            return out
        key = rank[member] * (int(group.max()) + 1) + group[member]
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        members = np.flatnonzero(member)[counts[inverse] >= 2]
        out[members] = group[members]
        return out

    def _beats_flash_decoding(self, requests: int, prefix: int) -> bool:
        """vLLM's wave model for a forward of single-token queries: the cascade's prefix kernel (all queries as
        one batch, per head) against flash decoding's (per request and KV head, split over the prefix)."""
        per_kv = self.heads // self.kv_heads
        if per_kv <= 1 or self.sm_count <= 0:
            return True  # without grouped heads flash decoding is not used, and without SMs there is no model
        tiles = math.ceil(prefix / _TILE)
        cascade = math.ceil(self.heads * math.ceil(requests / _TILE) / self.sm_count) * tiles
        flash = math.ceil(requests * self.kv_heads * math.ceil(per_kv / _TILE) * tiles / self.sm_count)
        return cascade < flash


def decode_reads(context: np.ndarray, produced: np.ndarray, rank: np.ndarray, group: np.ndarray,
                 shared: np.ndarray, micro_batch: int) -> tuple[int, int]:
    """(context tokens whose KV a run's decode queries read, the part of them the cascades' prefix kernels read),
    summed over the run's iterations: sequence i decodes `produced[i]` tokens from `context[i]`; each query reads
    its context, but a cascade's members read their own pages and each of its calls the prefix once. A cascade's
    calls at an iteration are ceil(members still running / B_attn), so they are opened by its 1st,
    (B_attn + 1)-th, ... longest-running member."""
    p = produced.astype(np.int64)
    total = int(p @ context.astype(np.int64)) + int(p @ (p - 1)) // 2
    on = np.flatnonzero(group >= 0) if group.size else group
    if not on.size:
        return total, 0
    order = np.lexsort((-p[on], group[on], rank[on]))  # per cascade, longest-running first
    r, g, alive, tokens = rank[on][order], group[on][order], p[on][order], shared[on][order].astype(np.int64)
    first = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (g[1:] != g[:-1])])
    place = np.arange(on.size) - np.repeat(first, np.diff(np.r_[first, on.size]))
    opens = place % micro_batch == 0 if micro_batch > 0 else place == 0
    prefix = int(alive[opens] @ tokens[opens])
    return total - int(alive @ tokens) + prefix, prefix
