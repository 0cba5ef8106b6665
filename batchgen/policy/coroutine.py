"""The sequence-coroutine policy (BatchGen): module-based batching, host KV, migrate and partition.

Per instance, at every page boundary (page_tokens decode iterations):
1. under device-memory pressure, YIELD the most-decoded sequences of a rank (most KV already on host, closest
   to finishing) until every running sequence can grow by one page;
2. if little runnable work is left (running + suspended on this instance's nodes) and prompts are waiting,
   switch to prefill: prompts are prefilled in large per-rank chunks and their KV goes straight to host;
   keep prefilling while the host pool is under the watermark (the authors' rule) and, where `prefill_ahead`
   is set, short of that many x the decode slots;
3. refill every rank from its node's suspended pool in FIFO order (COMBINE), then MIGRATE from other nodes of
   the instance, then (once this instance has drained) from other instances;
4. with nothing left to refill: spread the remaining sequences evenly over ranks (MIGRATE running sequences,
   balancing summed context) and, when fewer sequences than `partition_below` x ranks remain, PARTITION each
   over several ranks (tensor-parallel attention, KV split by heads), once the longest of them has at least
   `partition_min_context` tokens (the paper partitions its RL rollout's stragglers past 40K tokens: resharding
   moves every straggler's KV, so it is kept for long tails; the simulator prices both the reshard and each
   shard's share of the attention).
With `attention_tp` t > 1 a rank is a group of t GPUs running attention tensor-parallel (as continuous's
ranks can be, batchgen.latency.tp_attention): b_attn and b_moe are then per group, and PARTITION is off (the
group already splits every sequence's heads). `auto` plans the degree with the other knobs.
Attention runs in micro-batches of `b_attn` sequences; their hidden states are combined into one expert batch
of all running sequences of the rank, at most `b_moe` (the cap on running sequences per rank).

Where running sequences keep their KV (`kv_residency`, when the backend can decode host-resident):
- device: in GPU pages, so the running set (and the expert batch) is bounded by device KV, as in serving
  engines; memory pressure YIELDs.
- host: every running sequence is host-resident (MoE-Gen's full KV offload): its KV is restored per layer and
  micro-batch into a staging buffer, so b_moe is bounded by host memory, at the price of PCIe traffic (or of
  host DRAM bandwidth with `attention=cpu`).
- mixed: device pages first, the rest of the b_moe slots host-resident; memory pressure OFFLOADs the
  most-decoded device-resident sequences to host-resident instead of suspending them.
`auto` (and b_attn / b_moe `auto`) are resolved by the static planner (batchgen.plan) before the job runs; a
policy that meets an unresolved `auto` uses b_attn 256, b_moe 2048, device-resident KV and GPU attention.
Decisions where the paper is silent are knobs; defaults are documented in conf/policy/coroutine.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.core.cascade import cascade_mode
from batchgen.memory import BatchShape
from batchgen.policy.base import Admit, Decision, PolicyDefaults, Snapshot
from batchgen.policy.common import (among, check_attention_tp, fill_ranks, level_slots, pages_for, per_rank,
                                   shed_to_fit, split_by_budget)
from batchgen.policy.prefix_budget import RestoreTakes, fetched_tokens, fill_homes, spread_sharing
from batchgen.policy.tail import growth_fits, moves_fit, rebalance


RESIDENCIES = ("device", "host", "mixed", "auto")
ATTENTION_DEVICES = ("gpu", "cpu", "auto")
PREFILL_PARALLEL = ("ep", "dp", "auto")
FALLBACK = {"b_attn": 256, "b_moe": 2048, "kv_residency": "device", "attention": "gpu",
            "prefill_tokens_per_rank": 32768}  # an auto no planner resolved


# the numeric knobs' ranges: (knob, test, what it must be)
_RANGES = (("host_watermark", lambda v: 0 < v <= 1, "a share of the host KV pool in (0, 1]"),
           ("refill_below", lambda v: 0 <= v <= 1, "a share of the decode slots in [0, 1]"),
           ("prefill_ahead", lambda v: v > 0, "> 0 (times the decode slots) or null (prefill until the host "
                                              "watermark)"),
           ("rebalance_ratio", lambda v: v >= 1, ">= 1 (the largest rank load over the mean that is left alone)"),
           ("partition_below", lambda v: v >= 0, ">= 0 (sequences per rank below which the tail is partitioned)"))


@dataclass(frozen=True)
class CoroutinePolicy(PolicyDefaults):
    b_attn: int | str = "auto"
    b_moe: int | str = "auto"
    kv_residency: str = "auto"
    attention: str = "auto"
    prefill_tokens_per_rank: int | str = 32768  # auto: planned (the largest chunk that costs decode nothing)
    host_watermark: float = 0.7
    refill_below: float = 0.5
    prefill_ahead: float | None = None  # None: prefill until the host watermark, as the authors' code does
    migrate: bool = True
    migrate_across_instances: bool = True
    rebalance_ratio: float = 1.25
    partition: bool = True
    partition_below: float = 0.5
    partition_min_context: int = 32768
    max_partition_degree: int = 8
    attention_tp: int | str = 1  # GPUs per tensor-parallel attention group (1: data parallel); auto: planned
    comm_overlap: bool = False   # each micro-batch's expert all-to-all beside the next one's compute (sim and dist)
    prefill_parallel: str = "ep"  # prefill forwards: ep (expert parallel), dp (every expert streamed to each rank;
    #                               sim and dist), auto (the shorter predicted batch: batchgen.job.plan_prefill)
    prefix_cache: bool = True     # a prompt prefilled on a GPU that holds its group's prefix, or whose forward writes
    #                               it, takes those pages and prefills (and budgets) the rest (core.prefix_pages)
    prefix_tail: bool = True      # ... and copies the shared tokens of the page where members diverge (copy-on-write
    #                               below a page) instead of recomputing them
    prefix_fetch: bool = True     # a GPU without its group's prefix copies another GPU's of the instance instead of
    #                               recomputing it (core.prefix_fetch; where the backend performs it)
    cascade_attention: str = "groups"  # a group's holders decoding on a rank read its prefix once per call
    name: str = "coroutine"
    can_stream_weights: bool = True
    uses_host_kv: bool = True

    def __post_init__(self):
        for key in ("b_attn", "b_moe", "prefill_tokens_per_rank"):
            v = getattr(self, key)
            if v != "auto" and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"policy.{key} must be a whole number >= 1 or auto (planned), got {v!r}")
        if self.kv_residency not in RESIDENCIES:
            raise ValueError(f"policy.kv_residency must be one of {', '.join(RESIDENCIES)}, got {self.kv_residency!r}")
        if self.attention not in ATTENTION_DEVICES:
            raise ValueError(f"policy.attention must be one of {', '.join(ATTENTION_DEVICES)}, got {self.attention!r}")
        for key in ("max_partition_degree", "partition_min_context"):
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")
        check_attention_tp(self.attention_tp)
        object.__setattr__(self, "cascade_attention", cascade_mode(self.cascade_attention))
        if self.prefill_parallel not in PREFILL_PARALLEL:
            raise ValueError(f"policy.prefill_parallel must be one of {', '.join(PREFILL_PARALLEL)}, got "
                             f"{self.prefill_parallel!r}")
        for key, ok, what in _RANGES:
            value = getattr(self, key)
            if value is None and key == "prefill_ahead":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"policy.{key} must be {what}, got {value!r}")
        for key in ("comm_overlap", "migrate", "migrate_across_instances", "partition", "prefix_tail",
                    "prefix_fetch"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"policy.{key} must be true or false, got {getattr(self, key)!r}")

    def knob(self, key: str):
        """A knob's value, with the documented fallback for an `auto` no planner resolved."""
        value = getattr(self, key)
        return FALLBACK[key] if value == "auto" else value

    def batch_shape(self, max_context: int) -> BatchShape:
        """Largest batches per rank: b_moe tokens at the gate, b_attn per attention micro-batch (and per staging
        buffer when KV may be host-resident), a prefill chunk of prefill_tokens_per_rank."""
        b_attn = self.knob("b_attn")
        chunk = self.knob("prefill_tokens_per_rank")
        return BatchShape(gate_tokens=max(self.knob("b_moe"), chunk), attn_seqs=b_attn, prefill_tokens=chunk,
                          staging_seqs=0 if self.knob("kv_residency") == "device" else b_attn)

    def residency(self, snap: Snapshot) -> str:
        """Where running sequences keep their KV, within what the backend can do."""
        mode = self.knob("kv_residency")
        return mode if snap.capabilities.host_resident_decode else "device"

    def decide(self, snap: Snapshot) -> Decision:
        R, P = snap.num_ranks, snap.page_tokens
        mode = self.residency(snap)
        d = Decision(host_sync=True, micro_batch=self.knob("b_attn"), steps=P, stop="none",
                     cpu_attention=mode != "device" and self.knob("attention") == "cpu"
                     and snap.capabilities.cpu_attention)
        keep = self._yield_for_memory(snap, d, mode)
        keep &= self._evict_for_host(snap, d, keep)
        if d.offload_ids.size and d.evict_ids.size:
            d.offload_ids = np.setdiff1d(d.offload_ids, d.evict_ids)
        ids, rank, ctx = snap.active_ids[keep], snap.active_rank[keep], snap.active_context[keep]
        on_device = keep & ~snap.active_host_resident & ~among(snap.active_ids, d.offload_ids)
        used = per_rank(snap.active_rank[on_device], self._own_pages(snap, on_device), R)
        count = np.bincount(rank, minlength=R)
        own = snap.own_nodes()
        pooled = sum(len(snap.suspended[n]) for n in own)
        slots_total = self._decode_slots(snap)
        runnable = ids.size + pooled
        pending = len(snap.pending)
        # With nothing to run, the host may fill past the watermark: progress beats headroom.
        watermark = self.host_watermark if runnable else 1.0
        if pending:  # _prefill takes nothing when the host has no room below the watermark
            refill_low = runnable < self.refill_below * slots_total
            ahead = self.prefill_ahead
            keep_going = snap.last_phase == "prefill" and (ahead is None or pooled < ahead * slots_total)
            if refill_low or keep_going:
                self._prefill(snap, d, watermark, snap.pages_capacity - used)
        # host room left once evicted copies are dropped and every running copy has grown by a page
        n_nodes = snap.host_capacity_tokens.size
        evicted = among(snap.active_ids, d.evict_ids)
        released = np.bincount(snap.rank_node[snap.active_rank[evicted]],
                               weights=_host_own(snap, snap.active_ids[evicted], snap.active_context[evicted]),
                               minlength=n_nodes)
        growth = np.bincount(snap.rank_node[rank], minlength=n_nodes) * P
        host_free = (snap.host_capacity_tokens - snap.host_used_tokens + released - growth).astype(np.int64)
        free = snap.pages_capacity - used
        if not snap.layerwise_offload and d.prefill_ids.size:  # the prefill's KV shares the pages this step
            free -= np.bincount(d.prefill_ranks, weights=pages_for(snap.lengths.context(d.prefill_ids) + 1, P),
                                minlength=R).astype(np.int64)
        room = _Room(self.knob("b_moe") - count, free, count, host_free, {})
        if d.prefill_ids.size == 0 or ids.size:
            if mode != "host":
                self._refill(snap, d, own, room, slots_total, host_resident=False)
            if mode != "device":
                self._refill(snap, d, own, room, slots_total, host_resident=True)
        # a sequence moves at most once per boundary: one offloaded now waits for the next to be rebalanced
        if not pending and not d.admits and not d.prefill_ids.size and not pooled and not d.offload_ids.size:
            self._tail(snap, d, ids, rank, ctx, room)
        if pooled and not ids.size and not d.admits and not d.prefill_ids.size:
            self._unblock_host(snap, d, own, room)
        return d

    def _unblock_host(self, snap: Snapshot, d: Decision, own: np.ndarray, room: "_Room") -> None:
        """Nothing runs and the host is too full for the pool's head to grow: drop the pool's newest
        sequences (they will be recomputed) until the head can run a page."""
        P = snap.page_tokens
        node = max(own, key=lambda n: len(snap.suspended[n]))
        queue = snap.suspended[node].peek(len(snap.suspended[node]))
        short = P - int(room.host_free[node])
        ctx = _host_own(snap, queue[::-1][:-1], snap.lengths.context(queue[::-1][:-1]))  # newest first, not the head
        n = int(np.searchsorted(np.cumsum(ctx), short)) + 1
        d.evict_ids = np.concatenate([d.evict_ids, queue[::-1][:min(n, ctx.size)]])

    # -- 1. memory pressure ------------------------------------------------------------------------------
    def _yield_for_memory(self, snap: Snapshot, d: Decision, mode: str) -> np.ndarray:
        """Device-resident sequences that cannot grow by a page: YIELD them (device mode) or, where running
        host-resident is allowed, OFFLOAD them (they keep running; `keep` stays true)."""
        P = snap.page_tokens
        dev = np.flatnonzero(~snap.active_host_resident)
        need = self._own_pages(snap, dev)
        drop = dev[shed_to_fit(snap.active_rank[dev], need, snap.active_decoded[dev], snap.pages_capacity)]
        keep = np.ones(snap.active_ids.size, bool)
        if drop.size and mode == "device":
            d.yield_ids = snap.active_ids[drop]
            keep[drop] = False
        elif drop.size:
            d.offload_ids = snap.active_ids[drop]
        return keep

    @staticmethod
    def _own_pages(snap: Snapshot, rows: np.ndarray) -> np.ndarray:
        """Pages the running sequences `rows` (a mask or indices) hold once they grow by a page: a shared prefix's
        are not their own (the snapshot's capacity is already less by them)."""
        P = snap.page_tokens
        need = pages_for(snap.active_context[rows] + P, P)
        return need if snap.prefixes is None else need - snap.active_shared[rows] // P

    def _evict_for_host(self, snap: Snapshot, d: Decision, keep: np.ndarray) -> np.ndarray:
        """Running sequences' host copies grow by a page each: when a node's host memory cannot take that,
        drop the least-decoded ones (least work lost) to be recomputed later."""
        P = snap.page_tokens
        ctx = _host_own(snap, snap.active_ids, snap.active_context)
        node = snap.rank_node[snap.active_rank]
        on_node = np.bincount(node[keep], weights=ctx[keep], minlength=snap.host_capacity_tokens.size)
        available = snap.host_capacity_tokens - snap.host_used_tokens + on_node.astype(np.int64)
        idx = np.flatnonzero(keep)
        drop = idx[shed_to_fit(node[idx], ctx[idx] + P, -snap.active_decoded[idx].astype(float), available)]
        out = np.ones(keep.size, bool)
        if drop.size:
            d.evict_ids = snap.active_ids[drop]
            out[drop] = False
        return out

    # -- 2. prefill ---------------------------------------------------------------------------------------
    def _decode_slots(self, snap: Snapshot) -> int:
        """Sequences the instance can run at once: b_moe per rank, or (device-resident KV) what the pages hold."""
        slots = self.knob("b_moe") * snap.num_ranks
        if self.residency(snap) != "device":
            return int(slots)
        ctx = snap.active_context if snap.prefixes is None else snap.active_context - snap.active_shared  # own
        typical = float(ctx.sum()) / ctx.size if ctx.size else snap.lengths.mean_input
        per_seq = max(typical / snap.page_tokens + 1, 1.0)
        by_memory = snap.pages_capacity.sum() / per_seq
        return int(min(slots, by_memory))

    def _prefill(self, snap: Snapshot, d: Decision, watermark: float, free_pages: np.ndarray) -> None:
        """Give each rank up to prefill_tokens_per_rank of prompt tokens (at least one prompt), FIFO, while
        its node's host memory below the watermark can take the KV plus a page of growth per sequence (and,
        without layer-by-layer offload, while the rank's free KV pages hold the prompts during the forward)."""
        n_nodes = snap.host_capacity_tokens.size
        growth = np.bincount(snap.rank_node[snap.active_rank], minlength=n_nodes) * snap.page_tokens
        room = np.floor(snap.host_capacity_tokens * watermark - snap.host_used_tokens - growth).astype(np.int64)
        chunk = self.knob("prefill_tokens_per_rank")
        # enough for prompts of 64 tokens, or (shared prefixes) of a page past their prefix
        cand = snap.pending.peek(snap.num_ranks * max(chunk // (64 if snap.prefixes is None else snap.page_tokens), 1))
        tokens = snap.lengths.context(cand) + 1  # the prefill's first token lands on host too
        # fewer prompt tokens than every rank's chunk: spread them evenly (filling the first ranks would leave the
        # others idle in attention, and in a data-parallel prefill in the experts too)
        total = int(tokens.sum())
        if snap.prefixes is None:
            budget = np.full(snap.num_ranks, min(chunk, -(-total // snap.num_ranks)))
            ranks, computed = split_by_budget(tokens, budget), tokens
        else:  # the budget counts the tokens computed, less the prefixes taken (batchgen.policy.prefix_budget)
            ranks, computed = spread_sharing(cand, tokens, chunk, snap.num_ranks, snap.prefixes)
            placed = np.flatnonzero(ranks >= 0)  # the others wait a forward for their group's prefix to be copied
            if placed.size < ranks.size:
                cand, tokens, ranks, computed = cand[placed], tokens[placed], ranks[placed], computed[placed]
        cost = tokens[:ranks.size] + snap.page_tokens
        if snap.prefixes is not None:  # past the host prefix of its group its node holds (or its forward writes)
            cost = cost - snap.prefixes.host_skips(cand[:ranks.size], snap.rank_node[ranks])
        n = _host_prefix(snap.rank_node[ranks], cost, room)
        if not snap.layerwise_offload:  # pages during the forward: a prompt's own, past a prefix's whole pages
            own = computed[:n] + (tokens[:n] - computed[:n]) % snap.page_tokens  # a copied tail in its first page
            if snap.prefixes is not None:  # a prefix's writer: a page more for the tail the prefix may keep
                shared = snap.prefixes.shared_tokens(cand[:n])
                writes = (computed[:n] == tokens[:n]) & (shared > 0)
                own = own + np.where(writes & (snap.prefixes.shared_span(cand[:n]) > shared), snap.page_tokens, 0)
                own = own + fetched_tokens(snap.prefixes, cand[:n], ranks[:n], computed[:n], tokens[:n],
                                           snap.page_tokens)
            n = min(n, _host_prefix(ranks[:n], pages_for(own, snap.page_tokens),
                                    np.maximum(free_pages, 0).astype(np.int64)))
        d.prefill_ids, d.prefill_ranks = cand[:n], ranks[:n]
        d.prefill_to_host = True

    # -- 3. refill -----------------------------------------------------------------------------------------
    def _refill(self, snap: Snapshot, d: Decision, own: np.ndarray, room: "_Room", slots_total: int,
                host_resident: bool) -> None:
        """Local pools to their own node's ranks first; then (MIGRATE) leftovers of this instance's pools to
        any rank; then, once no prompt is waiting here, what other instances' pools hold beyond what their own
        GPUs can run (work stealing: taking work a busy instance would run anyway only moves the imbalance).
        Host-resident admissions take b_moe slots but no device pages."""
        # host-resident admissions are bounded by slots only: free pages that never run out
        free = np.full_like(room.free, _UNBOUNDED) if host_resident else room.free
        everyone = np.arange(snap.num_ranks)
        for node in own:
            self._offer(snap, d, int(node), None, room, free, host_resident)
        if not self.migrate:
            return
        for node in own:
            self._offer(snap, d, int(node), everyone, room, free, host_resident)
        if self.migrate_across_instances and not len(snap.pending):
            # instances are the same size, so a node's own ranks can run about this many of its sequences
            node_slots = int(slots_total * snap.gpus_per_node / snap.num_ranks)
            others = [n for n in range(len(snap.suspended)) if n not in own]
            for node in sorted(others, key=lambda n: -len(snap.suspended[n])):
                self._offer(snap, d, node, everyone, room, free, host_resident,
                            limit=len(snap.suspended[node]) - node_slots)

    def _offer(self, snap: Snapshot, d: Decision, node: int, ranks: np.ndarray | None, room: "_Room",
               free: np.ndarray, host_resident: bool, limit: int | None = None) -> None:
        """COMBINE the head of `node`'s pool onto `ranks` (None: the node's own), evenly, within slots, GPU pages
        `free` (unbounded for host-resident admissions) and host room (and at most `limit` sequences).

        A refill makes ~17 offers per boundary and most find an empty pool or a head that does not fit: those
        return before any per-candidate work (see `_head_fits`)."""
        P = snap.page_tokens
        skip = room.taken.get(node, 0)
        if len(snap.suspended[node]) <= skip or (limit is not None and limit <= 0):
            return
        if ranks is None:
            ranks = np.flatnonzero(snap.rank_node == node)
        open_ranks = ranks[(room.slots[ranks] > 0) & (free[ranks] > 0)]
        if not open_ranks.size:
            return
        want = int(room.slots[open_ranks].sum()) if limit is None else min(int(room.slots[open_ranks].sum()), limit)
        cand = snap.suspended[node].peek(skip + want)[skip:]
        ctx = snap.lengths.context(cand)
        need = np.zeros(cand.size, np.int64) if host_resident else pages_for(ctx + P, P)
        homes = snap.prefixes is not None and not host_resident  # a restore at home takes its group's prefix
        if not homes and not _head_fits(snap, node, open_ranks, room, free, int(need[0]), int(ctx[0])):
            return
        order = open_ranks[np.argsort(room.count[open_ranks], kind="stable")]  # least-loaded first
        caps = np.zeros_like(room.slots)
        caps[open_ranks] = level_slots(room.count[open_ranks], room.slots[open_ranks], cand.size)
        if homes:
            home, shared = snap.prefixes.restore_shares(cand)
            home = np.where(np.isin(home, open_ranks), home, -1)
            takes = RestoreTakes(snap.prefixes, cand, P, snap.rank_node == node) \
                if snap.prefixes.resumes_anywhere else None
            assigned, need = fill_homes(need, shared // P, home, room.slots, caps, free, order, takes)
        else:
            assigned = fill_ranks(need, caps, free, order)
        dest = snap.rank_node[assigned]
        # each newcomer's host copy grows by a page; a migrated one also brings its whole KV to `dest`
        n = _host_prefix(dest, P + np.where(dest != node, ctx[:assigned.size], 0), room.host_free)
        if not n:
            return
        assigned = assigned[:n]
        d.admits.append(Admit(node, cand[:n], assigned, host_resident))
        room.taken[node] = skip + n
        taken = np.bincount(assigned, minlength=room.slots.size)
        room.slots -= taken
        room.count += taken
        if not host_resident:
            room.free -= np.bincount(assigned, weights=need[:n], minlength=room.free.size).astype(np.int64)

    # -- 4. the long tail ---------------------------------------------------------------------------------
    def _tail(self, snap: Snapshot, d: Decision, ids: np.ndarray, rank: np.ndarray, ctx: np.ndarray,
              room: "_Room") -> None:
        R, n = snap.num_ranks, ids.size
        if n == 0 or not self.migrate:
            return
        # only device-resident sequences are partitioned: a host-resident one would have to restore its shards on
        # every rank of the group, which no backend does yet
        on_device = not np.isin(ids, snap.active_ids[snap.active_host_resident]).any()
        # under TP attention a rank is already a group sharing every sequence's heads; splitting a sequence over
        # groups too would need pricing and shards of shards that nothing has yet: the tail is only rebalanced
        if (self.partition and self.attention_tp == 1 and on_device and n <= self.partition_below * R
                and ctx.max() >= self.partition_min_context):
            cap = min(self.max_partition_degree, snap.gpus_per_node, R // n)
            degree = max(d for d in (1, *snap.capabilities.partition_degrees) if d <= max(cap, 1))
            target = (np.arange(n) * degree) % R
            current_tp = snap.active_tp[np.isin(snap.active_ids, ids)]
            if degree > 1 and not (np.array_equal(target, rank) and np.all(current_tp == degree)):
                if self._host_allows(snap, target, rank, ctx, room) and moves_fit(snap, ids, target, rank):
                    moving = target != rank
                    d.move_ids, d.move_ranks = ids[moving], target[moving]
                    d.partition_ids, d.partition_degree = ids, np.full(n, degree)
            return
        load = np.bincount(rank, weights=ctx, minlength=R)
        if load.max() <= self.rebalance_ratio * max(load.mean(), 1.0):
            return
        target = rebalance(ctx, rank, R)
        if (self._host_allows(snap, target, rank, ctx, room) and moves_fit(snap, ids, target, rank)
                and growth_fits(snap, ids, target)):
            moving = target != rank
            d.move_ids, d.move_ranks = ids[moving], target[moving]

    @staticmethod
    def _host_allows(snap: Snapshot, target: np.ndarray, rank: np.ndarray, ctx: np.ndarray, room: "_Room") -> bool:
        """Moving to another node moves the host copy too: all or nothing, within the room there."""
        src, dst = snap.rank_node[rank], snap.rank_node[target]
        cross = src != dst
        incoming = np.bincount(dst[cross], weights=ctx[cross], minlength=room.host_free.size)
        return bool(np.all(incoming <= room.host_free))


@dataclass
class _Room:
    """What is still open at this boundary, consumed as admissions are planned."""

    slots: np.ndarray      # sequences each rank may still take (b_moe cap)
    free: np.ndarray       # KV pages each rank has free
    count: np.ndarray      # running sequences per rank
    host_free: np.ndarray  # KV tokens each node's host memory can still take
    taken: dict[int, int]  # ids already planned from the head of each node's pool


_UNBOUNDED = np.iinfo(np.int64).max // 4  # free pages of a host-resident admission's rank: never the limit


def _head_fits(snap: Snapshot, node: int, open_ranks: np.ndarray, room: "_Room", free: np.ndarray,
               head_need: int, head_ctx: int) -> bool:
    """Whether an offer admits anything at all: level_slots gives the least-loaded open rank (the first
    of them) at least one slot, so the pool's head goes there; fill_ranks and _host_prefix cut the FIFO
    run at its first misfit, so if the head does not fit that rank's pages or its node's host room,
    nothing is admitted. Checked before the per-candidate arrays are built."""
    first = int(open_ranks[np.argmin(room.count[open_ranks])])
    if head_need > free[first]:
        return False
    dest = int(snap.rank_node[first])
    return snap.page_tokens + (head_ctx if dest != node else 0) <= room.host_free[dest]


def _host_own(snap: Snapshot, ids: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """The host KV tokens of these sequences' host copies that are their own: past what they hold of their node's
    host prefix (batchgen.core.host_prefixes)."""
    return ctx if snap.prefixes is None else ctx - snap.prefixes.host_held(ids)


def _host_prefix(dest: np.ndarray, cost: np.ndarray, host_free: np.ndarray) -> int:
    """Length of the FIFO prefix whose cost fits each destination's room (and consume it): host KV tokens
    per node, or KV pages per rank. Costs are >= 0, so each destination's running sum never falls."""
    if not dest.size:
        return 0
    if dest[0] == dest[-1] and np.all(dest == dest[0]):  # one destination (a local refill): one running sum
        cum = np.cumsum(cost)
        n = int(np.searchsorted(cum, host_free[dest[0]], side="right"))
        if n:
            host_free[dest[0]] -= cum[n - 1]
        return n
    order = np.argsort(dest, kind="stable")
    d_sorted, c_sorted = dest[order], cost[order]
    cum = np.cumsum(c_sorted)
    first = np.ones(dest.size, bool)  # first of each destination's run in the sorted order
    np.not_equal(d_sorted[1:], d_sorted[:-1], out=first[1:])
    before = np.maximum.accumulate(np.where(first, cum - c_sorted, np.iinfo(np.int64).min))  # earlier runs' sum
    ok = np.empty(dest.size, bool)
    ok[order] = cum - before <= host_free[d_sorted]
    n = dest.size if ok.all() else int(np.argmin(ok))
    np.subtract.at(host_free, dest[:n], cost[:n])
    return n
