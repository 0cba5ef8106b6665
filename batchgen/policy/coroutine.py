"""The sequence-coroutine policy (BatchGen): module-based batching, host KV, migrate and partition.

Per instance, at every page boundary (page_tokens decode iterations):
1. under device-memory pressure, YIELD the most-decoded sequences of a rank (most KV already on host, closest
   to finishing) until every running sequence can grow by one page;
2. if little runnable work is left (running + suspended on this instance's nodes) and prompts are waiting,
   switch to prefill: prompts are prefilled in large per-rank chunks and their KV goes straight to host;
   keep prefilling while the host pool is short of `prefill_ahead` x the decode slots and under the watermark;
3. refill every rank from its node's suspended pool in FIFO order (COMBINE), then MIGRATE from other nodes of
   the instance, then (once this instance has drained) from other instances;
4. with nothing left to refill: spread the remaining sequences evenly over ranks (MIGRATE running sequences,
   balancing summed context) and, when fewer sequences than `partition_below` x ranks remain, PARTITION each
   over several ranks (tensor parallel attention).
Attention runs in micro-batches of `b_attn` sequences; their hidden states are combined into one expert batch
of all running sequences of the rank, at most `b_moe` (the cap on running sequences per rank).
Decisions where the paper is silent are knobs; defaults are documented in conf/policy/coroutine.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.policy.base import Admit, Decision, Snapshot
from batchgen.policy.common import fill_ranks, level_slots, pages_for, per_rank, shed_to_fit, split_by_budget


@dataclass(frozen=True)
class CoroutinePolicy:
    b_attn: int = 256
    b_moe: int = 2048
    prefill_tokens_per_rank: int = 32768
    host_watermark: float = 0.7
    refill_below: float = 0.5
    prefill_ahead: float = 2.0
    migrate: bool = True
    migrate_across_instances: bool = True
    rebalance_ratio: float = 1.25
    partition: bool = True
    partition_below: float = 0.5
    max_partition_degree: int = 8
    name: str = "coroutine"
    can_stream_weights: bool = True
    uses_host_kv: bool = True

    def __post_init__(self):
        for key in ("b_attn", "b_moe", "prefill_tokens_per_rank", "max_partition_degree"):
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 < self.host_watermark <= 1:
            raise ValueError(f"policy.host_watermark must be in (0, 1], got {self.host_watermark}")

    def decide(self, snap: Snapshot) -> Decision:
        R, P = snap.num_ranks, snap.page_tokens
        d = Decision(host_sync=True, micro_batch=self.b_attn, steps=P, stop="none")
        keep = self._yield_for_memory(snap, d)
        ids, rank, ctx = snap.active_ids[keep], snap.active_rank[keep], snap.active_context[keep]
        used = per_rank(rank, pages_for(ctx + P, P), R)
        count = np.bincount(rank, minlength=R)
        own = snap.own_nodes()
        pooled = sum(len(snap.suspended[n]) for n in own)
        slots_total = self._decode_slots(snap)
        runnable = ids.size + pooled
        pending = len(snap.pending)
        if pending and self._host_room(snap, own) > 0:
            refill_low = runnable < self.refill_below * slots_total
            keep_going = snap.last_phase == "prefill" and pooled < self.prefill_ahead * slots_total
            if refill_low or keep_going:
                self._prefill(snap, d, own)
        if d.prefill_ids.size == 0 or ids.size:
            self._refill(snap, d, own, used, count)
        if not pending and not d.admits and not d.prefill_ids.size and not pooled:
            self._tail(snap, d, ids, rank, ctx)
        return d

    # -- 1. memory pressure ------------------------------------------------------------------------------
    def _yield_for_memory(self, snap: Snapshot, d: Decision) -> np.ndarray:
        P = snap.page_tokens
        need = pages_for(snap.active_context + P, P)
        drop = shed_to_fit(snap.active_rank, need, snap.active_decoded, snap.pages_capacity)
        keep = np.ones(snap.active_ids.size, bool)
        if drop.size:
            d.yield_ids = snap.active_ids[drop]
            keep[drop] = False
        return keep

    # -- 2. prefill ---------------------------------------------------------------------------------------
    def _decode_slots(self, snap: Snapshot) -> int:
        """Sequences the instance can run at once: b_moe per rank, or what the KV pages hold."""
        ctx = snap.active_context
        typical = float(np.mean(ctx)) if ctx.size else float(np.mean(snap.lengths.input_len))
        per_seq = max(typical / snap.page_tokens + 1, 1.0)
        by_memory = snap.pages_capacity.sum() / per_seq
        return int(min(self.b_moe * snap.num_ranks, by_memory))

    def _host_room(self, snap: Snapshot, nodes: np.ndarray) -> int:
        cap = snap.host_capacity_tokens[nodes] * self.host_watermark
        return int(np.maximum(cap - snap.host_used_tokens[nodes], 0).sum())

    def _prefill(self, snap: Snapshot, d: Decision, own: np.ndarray) -> None:
        """Fill each rank with up to prefill_tokens_per_rank of prompt tokens (at least one prompt), within
        its share of its node's host room below the watermark."""
        room = np.maximum(snap.host_capacity_tokens * self.host_watermark - snap.host_used_tokens, 0)
        ranks_per_node = np.bincount(snap.rank_node, minlength=room.size)
        room_per_rank = room[snap.rank_node] // np.maximum(ranks_per_node[snap.rank_node], 1)
        budget = np.minimum(self.prefill_tokens_per_rank, room_per_rank)
        cand = snap.pending.peek(snap.num_ranks * max(self.prefill_tokens_per_rank // 64, 1))
        tokens = snap.lengths.context(cand)
        ranks = split_by_budget(tokens, budget)
        fits = tokens[:ranks.size] <= room_per_rank[ranks]  # an over-budget first prompt still needs room
        n = ranks.size if fits.all() else int(np.argmin(fits))  # keep FIFO order: stop at the first misfit
        d.prefill_ids, d.prefill_ranks = cand[:n], ranks[:n]
        d.prefill_to_host = True

    # -- 3. refill -----------------------------------------------------------------------------------------
    def _refill(self, snap: Snapshot, d: Decision, own: np.ndarray, used: np.ndarray, count: np.ndarray) -> None:
        """Local pools to their own node's ranks first; then (MIGRATE) leftovers of this instance's pools to
        any rank; then, once no prompt is waiting here, other instances' pools (work stealing)."""
        slots = self.b_moe - count
        free = snap.pages_capacity - used
        taken: dict[int, int] = {}
        everyone = np.arange(snap.num_ranks)
        for node in own:
            self._offer(snap, d, int(node), np.flatnonzero(snap.rank_node == node), slots, free, count, taken)
        if not self.migrate:
            return
        for node in own:
            self._offer(snap, d, int(node), everyone, slots, free, count, taken)
        if self.migrate_across_instances and not len(snap.pending):
            others = [n for n in range(len(snap.suspended)) if snap.node_instance[n] != snap.instance]
            for node in sorted(others, key=lambda n: -len(snap.suspended[n])):
                self._offer(snap, d, node, everyone, slots, free, count, taken)

    def _offer(self, snap, d, node, ranks, slots, free, count, taken) -> None:
        P = snap.page_tokens
        open_ranks = ranks[(slots[ranks] > 0) & (free[ranks] > 0)]
        skip = taken.get(node, 0)
        if not open_ranks.size or len(snap.suspended[node]) <= skip:
            return
        cand = snap.suspended[node].peek(skip + int(slots[open_ranks].sum()))[skip:]
        need = pages_for(snap.lengths.context(cand) + P, P)
        order = open_ranks[np.argsort(count[open_ranks], kind="stable")]  # least-loaded first
        caps = np.zeros_like(slots)
        caps[open_ranks] = level_slots(count[open_ranks], slots[open_ranks], cand.size)
        assigned = fill_ranks(need, caps, free, order)
        if not assigned.size:
            return
        d.admits.append(Admit(node, cand[:assigned.size], assigned))
        taken[node] = skip + assigned.size
        np.subtract.at(slots, assigned, 1)
        np.subtract.at(free, assigned, need[:assigned.size])
        np.add.at(count, assigned, 1)

    # -- 4. the long tail ---------------------------------------------------------------------------------
    def _tail(self, snap: Snapshot, d: Decision, ids: np.ndarray, rank: np.ndarray, ctx: np.ndarray) -> None:
        R, n = snap.num_ranks, ids.size
        if n == 0 or not self.migrate:
            return
        if self.partition and n <= self.partition_below * R:
            degree = min(self.max_partition_degree, snap.gpus_per_node, R // n)
            degree = 1 << (max(degree, 1).bit_length() - 1)  # a power of two
            target = (np.arange(n) * degree) % R
            current_tp = snap.active_tp[np.isin(snap.active_ids, ids)]
            if degree > 1 and not (np.array_equal(target, rank) and np.all(current_tp == degree)):
                moving = target != rank
                d.move_ids, d.move_ranks = ids[moving], target[moving]
                d.partition_ids, d.partition_degree = ids, np.full(n, degree)
            return
        load = np.bincount(rank, weights=ctx, minlength=R)
        if load.max() <= self.rebalance_ratio * max(load.mean(), 1.0):
            return
        target = _balance(ctx, R)
        moving = target != rank
        d.move_ids, d.move_ranks = ids[moving], target[moving]


def _balance(ctx: np.ndarray, R: int) -> np.ndarray:
    """Longest-processing-time assignment of sequences (by context) to ranks."""
    order = np.argsort(-ctx, kind="stable")
    target = np.empty(ctx.size, np.int64)
    load = np.zeros(R)
    for i in order:  # runs only in the tail, when at most a few sequences per rank remain
        r = int(np.argmin(load))
        target[i] = r
        load[r] += ctx[i]
    return target
