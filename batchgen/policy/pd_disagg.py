"""PD-disaggregation (DistServe, SGLang / vLLM prefill-decode disaggregation, Mooncake) as a policy.

The cluster is split into units (each one expert-parallel instance of `unit_gpus` GPUs): the first
`prefill_units` only prefill, the other `decode_units` only decode. Every prompt is routed to a prefill unit
(round-robin, pinned to a rank there); decode units never see a prompt.

Prefill unit, at every forward: each rank takes whole prompts from the head of its queue within `token_budget`
tokens (a longer prompt goes alone: no decode shares the forward, so there is nothing for chunking to protect,
see conf/policy/pd_disagg.yaml), prefilled with the KV written out layer by layer to the unit's node (the
engine's prefill-to-host, priced as device -> host copies beside the forward). That KV waits there, in the
node's suspended pool, until a decode unit takes it. Back-pressure: a prefill unit holds at most `hold_share` x
its own GPUs' KV pool of prefilled, not yet shipped KV (real systems keep it on the prefill GPUs, or pre-allocate
it on the decode side before prefilling, so a full decode side stalls prefill); past that it waits, idle.

Decode unit: continuous batching exactly as `continuous` runs it (ContinuousPolicy: pages per rank, a running cap that
is SGLang's by default, derived from the rank's KV pool (`max_running` 0, at most `running_cap`), preemption of the
newest by recompute when the running sequences outgrow their pages, the recompute prefilled there, chunked, as vLLM's
decode instance does). When it preempts or recomputes nothing, it admits prefilled sequences from the prefill nodes'
pools, FIFO, spread evenly over its ranks within their free pages and slots: an Admit of another node's pool, i.e. the
engine's MIGRATE, which prices the KV over the network (lat.network(bytes, cross_node)) into the run that follows. A
decode unit with nothing admitted and nothing running waits, idle: that is the decode side's idle time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from batchgen.memory import BatchShape, ConfigError
from batchgen.policy.base import Admit, Decision, PolicyDefaults, Snapshot
from batchgen.policy.common import fill_ranks, level_slots, pages_for, per_rank
from batchgen.policy.continuous import ContinuousPolicy
from batchgen.policy.engine_defaults import kv_pool_running_cap


@dataclass(frozen=True)
class PDDisaggPolicy(PolicyDefaults):
    prefill_units: int = 1
    decode_units: int = 1
    unit_gpus: int = 0
    token_budget: int = 16384
    hold_share: float = 1.0
    max_running: int = 0          # decode ranks' running cap; 0: derived from the KV pool (SGLang's), up to running_cap
    running_cap: int = 4096
    decode_token_budget: int = 8192
    admit_watermark: float = 0.01
    page_lookahead: int = 64
    name: str = "pd_disagg"
    can_stream_weights: bool = False
    uses_host_kv: bool = True

    def __post_init__(self):
        for key in ("prefill_units", "decode_units", "token_budget", "decode_token_budget", "page_lookahead",
                    "running_cap"):
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_running < 0:
            raise ValueError(f"policy.max_running must be >= 0 (0: derived from the KV pool), got {self.max_running}")
        if self.unit_gpus < 0:
            raise ValueError(f"policy.unit_gpus must be >= 0 (0: the cluster split into prefill_units + "
                             f"decode_units equal units), got {self.unit_gpus}")
        if not self.hold_share > 0:
            raise ValueError(f"policy.hold_share must be > 0, got {self.hold_share}")
        self._decode  # built (and its knobs checked) now, not at the first decision

    @cached_property
    def _decode(self) -> ContinuousPolicy:
        """The decode side is continuous batching with these knobs: one implementation of it, not a copy (its
        running cap set per pool size by `_decode_for` when max_running is 0)."""
        return ContinuousPolicy(max_running=self.max_running or self.running_cap, chunked_prefill=True,
                                token_budget=self.decode_token_budget, admit_watermark=self.admit_watermark,
                                page_lookahead=self.page_lookahead)

    def _decode_for(self, snap: Snapshot) -> ContinuousPolicy:
        """The decode side with its running cap: max_running, or what the unit's KV pool holds."""
        if self.max_running:
            return self._decode
        cap = kv_pool_running_cap(snap.pages_capacity, self.running_cap)
        policy = self._by_cap.get(cap)
        if policy is None:
            policy = self._by_cap[cap] = dataclasses.replace(self._decode, max_running=cap)
        return policy

    @cached_property
    def _by_cap(self) -> dict[int, ContinuousPolicy]:
        return {}

    # -- layout: what the engine asks before the job runs ---------------------------------------------------
    @property
    def units(self) -> int:
        return self.prefill_units + self.decode_units

    def instance_gpus(self, num_gpus: int, node_size: int) -> int:
        """GPUs per expert-parallel instance (= per unit), so that the cluster is exactly prefill_units +
        decode_units units. Raises ConfigError (before any work) when it cannot be."""
        size = self.unit_gpus or num_gpus // self.units
        if size < 1 or size * self.units != num_gpus:
            raise ConfigError(
                f"policy pd_disagg: {self.prefill_units} prefill + {self.decode_units} decode units of "
                f"{self.unit_gpus or 'equal'} GPUs do not make up the cluster's {num_gpus} GPUs: set "
                "policy.prefill_units + policy.decode_units = cluster.num_gpus / policy.unit_gpus "
                "(e.g. 4 + 4 units of 16 on 128 GPUs)")
        if not (size % node_size == 0 or node_size % size == 0):
            raise ConfigError(f"policy.unit_gpus={size} must be a whole number of nodes ({node_size} GPUs) or "
                              "divide a node")
        return size

    def route(self, num_sequences: int, num_instances: int) -> np.ndarray:
        """The instance each prompt starts in: the prefill units, round-robin."""
        if num_instances != self.units:
            raise ConfigError(f"policy pd_disagg runs on {self.units} units, the cluster has {num_instances} "
                              "instances")
        return np.arange(num_sequences) % self.prefill_units

    def is_prefill(self, instance: int) -> bool:
        return instance < self.prefill_units

    def receives_work(self, instance: int) -> bool:
        """Decode units wait for prefilled KV until the job is done (the engine keeps their loop alive)."""
        return not self.is_prefill(instance)

    def batch_shape(self, max_context: int) -> BatchShape:
        """A prefill forward of token_budget tokens; a decode forward of max_running sequences (and a recompute
        chunk of decode_token_budget)."""
        prefill = max(self.token_budget, self.decode_token_budget)
        running = self.max_running or self.running_cap  # the most a decode rank may run: its activations
        return BatchShape(gate_tokens=max(running, prefill), attn_seqs=running, prefill_tokens=prefill)

    def decide(self, snap: Snapshot) -> Decision:
        return self._prefill(snap) if self.is_prefill(snap.instance) else self._decode_side(snap)

    # -- prefill units --------------------------------------------------------------------------------------
    def _prefill(self, snap: Snapshot) -> Decision:
        """Whole prompts per rank within the token budget, KV to the node's pool, while the unit's held KV (its
        pools) stays within hold_share x its GPUs' KV pool and the nodes' host memory takes it."""
        P = snap.page_tokens
        d, waiting = self._decode._pin(snap)
        d.steps, d.stop, d.micro_batch = 1, "none", 0
        own = snap.own_nodes()
        held = sum(int(snap.lengths.context(snap.suspended[n].peek(len(snap.suspended[n]))).sum()) for n in own)
        hold_room = int(self.hold_share * snap.pages_capacity.sum() * P) - held
        host_room = (snap.host_capacity_tokens - snap.host_used_tokens).astype(np.int64)
        # without layer-by-layer offload (the executor) the forward's KV sits in the rank's pages meanwhile
        page_room = (snap.pages_capacity * (1 - self.admit_watermark)).astype(np.int64)
        ids_out, ranks_out = [], []
        for r, w in enumerate(waiting):
            if not w:
                continue
            fresh = d.pin_ids[d.pin_ranks == r] if d.pin_ids.size else np.empty(0, np.int64)
            n_peek = max(self.token_budget // 64, 1)
            cand = np.concatenate([snap.pinned[r].peek(n_peek), fresh])[:n_peek]
            tokens = snap.lengths.context(cand) + 1  # the first token's KV lands with it
            cum = np.cumsum(tokens)
            n = max(int(np.searchsorted(cum, self.token_budget, side="right")), 1)  # a long prompt alone
            node = int(snap.rank_node[r])
            fit = int(np.searchsorted(cum, min(hold_room, host_room[node]), side="right"))
            if not fit and not held and not ids_out and cum[0] <= host_room[node]:
                fit = 1  # nothing held: one prompt goes even past a small hold_share (progress beats the bound)
            n = min(n, fit)
            if not snap.layerwise_offload:
                n = min(n, int(np.searchsorted(np.cumsum(pages_for(tokens, P)), page_room[r], side="right")))
            if n:
                ids_out.append(cand[:n])
                ranks_out.append(np.full(n, r))
                hold_room -= int(cum[n - 1])
                host_room[node] -= int(cum[n - 1])
        if ids_out:
            d.prefill_ids, d.prefill_ranks = np.concatenate(ids_out), np.concatenate(ranks_out)
            d.prefill_pinned = d.prefill_to_host = True
        return d

    # -- decode units ---------------------------------------------------------------------------------------
    def _decode_side(self, snap: Snapshot) -> Decision:
        """Continuous batching; when it neither preempts nor recomputes, admit shipped KV into free pages."""
        decode = self._decode_for(snap)
        d = decode.decide(snap)
        pools = [n for n in range(len(snap.suspended)) if len(snap.suspended[n])]
        if not pools:
            return d
        d.stop = "first_finish"  # a finish frees a slot that waiting KV can take
        d.steps = self.page_lookahead
        if d.evict_ids.size or d.chunk_ids.size or d.prefill_ids.size:
            return d  # memory is short, or recomputes wait: they go first
        self._admit(snap, d, pools, decode.max_running)
        return d

    def _admit(self, snap: Snapshot, d: Decision, pools: list[int], max_running: int) -> None:
        R, P = snap.num_ranks, snap.page_tokens
        count = snap.rank_count()
        need_running = pages_for(snap.active_context + self.page_lookahead, P)
        free = (snap.pages_capacity * (1 - self.admit_watermark)).astype(np.int64) - per_rank(
            snap.active_rank, need_running, R)
        slots = np.maximum(max_running - count, 0)
        for node in sorted(pools, key=lambda n: -len(snap.suspended[n])):
            open_ranks = np.flatnonzero((slots > 0) & (free > 0))
            if not open_ranks.size:
                return
            cand = snap.suspended[node].peek(int(slots[open_ranks].sum()))
            ctx = snap.lengths.context(cand)
            need = pages_for(ctx + self.page_lookahead, P)
            caps = np.zeros(R, np.int64)
            caps[open_ranks] = level_slots(count[open_ranks], slots[open_ranks], cand.size)
            order = open_ranks[np.argsort(count[open_ranks], kind="stable")]
            ranks = fill_ranks(need, caps, free, order)
            if not ranks.size and not snap.active_ids.size and not d.admits:
                ranks = self._head_alone(snap, d, int(ctx[0]), free)
            n = ranks.size
            if not n:
                continue
            d.admits.append(Admit(node, cand[:n], ranks, keep_host_copy=False))
            taken = np.bincount(ranks, minlength=R)
            slots -= taken
            count += taken
            free -= np.bincount(ranks, weights=need[:n], minlength=R).astype(np.int64)

    def _head_alone(self, snap: Snapshot, d: Decision, ctx: int, free: np.ndarray) -> np.ndarray:
        """An idle unit whose pages cannot hold the pool's head plus a page_lookahead of growth still takes it,
        alone, for as many steps as its pages hold (continuous would preempt it at the next check and
        recompute it, token by token, as it does with a sequence that outgrows a rank)."""
        r = int(np.argmax(free))
        steps = int(free[r]) * snap.page_tokens - ctx
        if steps < 1:
            return np.empty(0, np.int64)
        d.steps = min(d.steps, steps)
        free[r] = 0
        return np.array([r])

