"""The decision every offloading system shares: static blocks, as a pure function over the snapshot.

Per instance: while a block runs, it decodes (`page_tokens` iterations per boundary) until every sequence of it
has finished; rows that cannot grow are evicted (recomputed later: the stand-in for an out-of-memory error),
device pages for device KV, host memory for host KV (least-decoded first, least work lost). When the block has
drained: with host KV, the next block is COMBINEd from the host pool (the prompts' KV went there at prefill);
otherwise the next `block` prompts per rank are prefilled (to host with host KV, into device pages without).
Finished rows leave the batch (they cost nothing more, a simplification in the baselines' favour: FlexGen and
`generate` keep computing them), but their slots stay empty until the whole block drains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.policy.base import Admit, Decision, Forecast, Snapshot
from batchgen.policy.common import pages_for, shed_to_fit

FFN_SCHEDULES = ("micro_batch", "pipelined")


@dataclass(frozen=True)
class BlockPlan:
    """A resolved schedule: what a system's search chose."""

    block: int            # sequences per rank in one block
    micro_batch: int      # sequences per attention micro-batch, each with its own FFN (0: the whole block)
    kv_on_host: bool      # the block's KV lives in host memory (restored per layer, or read by the CPU)
    cpu_attention: bool   # host KV: attention on the host CPU beside it (else restored to the GPU)
    ffn_schedule: str     # "micro_batch" or "pipelined" (CGOPipe)

    def __post_init__(self):
        if self.block < 1 or self.micro_batch < 0:
            raise ValueError(f"a block needs block >= 1 and micro_batch >= 0, got {self.block}, {self.micro_batch}")
        if self.ffn_schedule not in FFN_SCHEDULES:
            raise ValueError(f"ffn_schedule must be one of {FFN_SCHEDULES}, got {self.ffn_schedule!r}")


def decide_block(snap: Snapshot, plan: BlockPlan) -> Decision:
    P = snap.page_tokens
    host = plan.kv_on_host and snap.capabilities.host_resident_decode
    cpu = host and plan.cpu_attention and snap.capabilities.cpu_attention
    d = Decision(steps=P, stop="none", micro_batch=plan.micro_batch, cpu_attention=cpu,
                 ffn_schedule=plan.ffn_schedule)
    if snap.active_ids.size:
        _shed(snap, d)
        return d
    own = snap.own_nodes()
    if host and any(len(snap.suspended[n]) for n in own):
        _admit(snap, d, own, plan.block)
        return d
    if len(snap.pending):
        _prefill(snap, d, plan.block, host)
    elif host:  # a pool on another instance's node cannot be ours; nothing to do here
        pass
    return d


def block_repeats(snap: Snapshot, forecast: Forecast) -> int:
    """`Policy.repeats` of `decide_block`'s decode: while the block runs, the decision at the next boundary is
    the same decode as long as a row still runs and `_shed` drops nothing there, i.e. every rank's rows fit
    their next page (the sum `shed_to_fit` compares). Rows with host KV are not forecast (their shed also reads
    host memory that other instances share): 0 then."""
    alive, context = forecast.alive, forecast.context
    if not alive.size or not snap.active_ids.size or snap.active_host_resident.any():
        return 0
    P, R = snap.page_tokens, snap.num_ranks
    need = np.where(alive, pages_for(context + P, P), 0)  # (J, N) pages each row needs at each boundary
    if R == 1:
        per_rank = need.sum(axis=1)[:, None]
    else:
        per_rank = np.stack([need[:, snap.active_rank == r].sum(axis=1) for r in range(R)], axis=1)
    same = alive.any(axis=1) & (per_rank <= snap.pages_capacity).all(axis=1)
    return int(same.size if same.all() else np.argmin(same))


def _shed(snap: Snapshot, d: Decision) -> None:
    """Rows that cannot grow by a page lose their KV (recomputed later)."""
    P = snap.page_tokens
    if not snap.active_host_resident.any():
        # device KV (the usual block): nothing is shed when every rank's rows get their next page (the sums
        # `shed_to_fit` compares), and no host-resident row could be
        need = np.bincount(snap.active_rank, weights=pages_for(snap.active_context + P, P), minlength=snap.num_ranks)
        if (need <= snap.pages_capacity).all():
            d.evict_ids = np.empty(0, np.int64)
            return
    dev = np.flatnonzero(~snap.active_host_resident)
    drop = dev[shed_to_fit(snap.active_rank[dev], pages_for(snap.active_context[dev] + P, P),
                           -snap.active_decoded[dev].astype(float), snap.pages_capacity)]
    node = snap.rank_node[snap.active_rank]
    keep = np.ones(snap.active_ids.size, bool)
    keep[drop] = False
    ctx = snap.active_context
    on_node = np.bincount(node[keep], weights=ctx[keep], minlength=snap.host_capacity_tokens.size)
    available = snap.host_capacity_tokens - snap.host_used_tokens + on_node.astype(np.int64)
    hosted = np.flatnonzero(keep & snap.active_host_resident)
    drop_host = hosted[shed_to_fit(node[hosted], ctx[hosted] + P, -snap.active_decoded[hosted].astype(float),
                                   available)]
    d.evict_ids = snap.active_ids[np.concatenate([drop, drop_host])]


def _host_room(snap: Snapshot) -> np.ndarray:
    return (snap.host_capacity_tokens - snap.host_used_tokens).astype(np.int64)


def _round_robin_prefix(owner: np.ndarray, need: np.ndarray, room: np.ndarray) -> int:
    """Length of the FIFO prefix whose summed need fits each owner's room."""
    if not owner.size:
        return 0
    order = np.argsort(owner, kind="stable")
    cum = np.zeros(owner.size)
    for o in np.unique(owner):
        idx = order[owner[order] == o]
        cum[idx] = np.cumsum(need[idx])
    ok = cum <= room[owner]
    return owner.size if ok.all() else int(np.argmin(ok))


def _admit(snap: Snapshot, d: Decision, own: np.ndarray, block: int) -> None:
    """COMBINE the next block from each own node's host pool onto that node's ranks, host-resident."""
    P = snap.page_tokens
    room = _host_room(snap)
    for node in own:
        ranks = np.flatnonzero(snap.rank_node == node)
        queue = snap.suspended[int(node)]
        if not len(queue) or not ranks.size:
            continue
        cand = queue.peek(block * ranks.size)
        owner = ranks[np.arange(cand.size) % ranks.size]
        n = _round_robin_prefix(np.full(cand.size, int(node)), np.full(cand.size, P, float), room)
        if n:
            d.admits.append(Admit(int(node), cand[:n], owner[:n], True))
            room[node] -= n * P
        elif not snap.active_ids.size:  # nothing runs and the head cannot grow: drop the newest for recompute
            full = queue.peek(len(queue))
            if full.size > 1:
                d.evict_ids = np.concatenate([d.evict_ids, full[::-1][: max(1, full.size // 2)]])


def _prefill(snap: Snapshot, d: Decision, block: int, host: bool) -> None:
    """The next block's prompts, round-robin over ranks, FIFO, within device pages (held during the forward
    unless the backend offloads prefill KV layer by layer) and, for host KV, host memory."""
    P, R = snap.page_tokens, snap.num_ranks
    cand = snap.pending.peek(block * R)
    ranks = np.arange(cand.size) % R
    tokens = snap.lengths.context(cand) + 1
    n = cand.size
    if not host or not snap.layerwise_offload:
        free = np.maximum(snap.pages_capacity - snap.pages_used, 0).astype(np.int64)
        grow = 0 if host else P  # device KV: each row must also grow by a page in its first decode run
        n = min(n, _round_robin_prefix(ranks, pages_for(tokens + grow, P).astype(float), free))
    if host:
        node = snap.rank_node[ranks]
        n = min(n, _round_robin_prefix(node[:n], (tokens[:n] + P).astype(float), _host_room(snap)))
    d.prefill_ids, d.prefill_ranks = cand[:n], ranks[:n]
    d.prefill_to_host = host
