"""The engine loop, written once for every backend: snapshot -> decide -> apply -> run to the next boundary.

A backend only has to execute a `StepPlan` (advance the clock by the latency model, or run real tensors) and
report what each sequence produced. Everything else, the bookkeeping of where sequences live, applying a
policy's decision through the coroutine primitives, turning it into explicit per-GPU KV operations
(batchgen.core.ops) for a backend that moves real KV, noticing a deadlock and recording results, lives here
and in core/.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol

import numpy as np

from batchgen import fastpath, repeat
from batchgen.core.ops import GpuOps, KVLedger, KVOps, plan_ops
from batchgen.core.state import ClusterState, Moves
from batchgen.core.sequences import PENDING, InvariantError
from batchgen.decisions import BoundaryDecision, DeferredDecision
from batchgen.policy.base import Capabilities, Decision, Lengths, Phase, Policy, Snapshot


@dataclass
class StepPlan:
    """One run of an instance between two boundaries, as the backend must execute it."""

    instance: int
    gpus: np.ndarray
    decode_ids: np.ndarray
    decode_rank: np.ndarray
    decode_tp: np.ndarray
    prefill_ids: np.ndarray
    prefill_rank: np.ndarray
    steps: int
    stop: str
    micro_batch: int
    decode_host_resident: np.ndarray  # bool per decode sequence: KV restored per layer from host
    cpu_attention: bool        # host-resident attention on the host CPU instead of the GPU
    pad_rows: np.ndarray       # per rank
    pad_context: np.ndarray    # per rank: summed context of the padding rows
    moves: Moves               # bytes moved by this boundary's primitives (indexed by global GPU)
    host_sync: bool
    prefill_to_host: bool
    padded: bool
    start: float = 0.0         # clock reading when the boundary began (before the decision)
    ffn_schedule: str = "combined"  # Decision.ffn_schedule: one expert batch, or an FFN per micro-batch
    # chunked prefill: one forward in which each chunk writes context tokens [start, start + len) of its sequence
    # beside every decode (a chunk that ends its context samples the sequence's first token)
    chunk_ids: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_rank: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_start: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_len: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_completes: np.ndarray = field(default_factory=lambda: np.empty(0, bool))  # the chunk ends its context
    # the KV moves that come before the run (batchgen.core.ops), per GPU; None for a backend that prices the
    # bytes in `moves` instead of moving KV (the simulator) and does not ask for them
    ops: KVOps | None = None
    # running sequences that wait beside this run without a token of it (a chunks-only forward's decodes): still
    # running, and counted so in the step record
    waiting: int = 0

    @property
    def phase(self) -> Phase:
        if self.prefill_ids.size:
            return "prefill"
        if self.chunk_ids.size:
            return "mixed" if self.decode_ids.size else "prefill"
        return "decode" if self.decode_ids.size else "idle"

    def for_rank(self, rank: int) -> GpuOps:
        """Everything rank `rank` of the instance does at this boundary: its KV ops (`KVOps.for_gpu`, which needs
        `ops`), then its prefills, chunks (id, start, length) and decodes."""
        if self.ops is None:
            raise InvariantError("this plan carries no KV ops: its backend did not ask for them (Backend.kv_ops)")
        mine = self.ops.for_gpu(int(self.gpus[rank]))
        mine.prefill = self.prefill_ids[self.prefill_rank == rank].tolist()
        on = self.chunk_rank == rank
        mine.chunks = list(zip(self.chunk_ids[on].tolist(), self.chunk_start[on].tolist(),
                               self.chunk_len[on].tolist()))
        mine.decode = self.decode_ids[self.decode_rank == rank].tolist()
        return mine


@dataclass
class StepResult:
    duration: float
    iterations: int
    produced: np.ndarray        # tokens each decode sequence generated
    finished: np.ndarray        # bool per decode sequence
    finish_offset: np.ndarray   # seconds after the start at which each decode sequence produced its last token
    prefill_finished: np.ndarray  # bool per prefill sequence (a one-token output ends at prefill)
    rank_busy: np.ndarray       # compute seconds per rank
    rank_comm: np.ndarray       # seconds per rank in collectives and copies not hidden by compute
    expert_tokens: float        # tokens entering the gate, summed over iterations (one MoE layer)
    expert_calls: int           # iterations that ran the MoE layers
    tokens: int                 # tokens processed (prefill + decode)
    # seconds per module over the run (attention, ffn, head = LM head + sampling, ...), where the backend knows
    modules: dict[str, float] = field(default_factory=dict)
    chunk_finished: np.ndarray = field(default_factory=lambda: np.empty(0, bool))  # per chunk: ended its context
                                                                                  # and its one token was the last


_EMPTY = np.empty(0, np.int64)
_FEW_CHUNKS = 8  # chunks up to which _take_chunks reads their flags as Python lists
FFN_SCHEDULES = ("combined", "micro_batch", "pipelined")  # Decision.ffn_schedule


class Backend(Protocol):
    """What the engine needs from a backend: it executes plans and makes time pass; it decides nothing and
    keeps no bookkeeping of its own (the engine notices deadlocks and assembles the run's output).

    `capabilities`: what it can run, declared (the policy plans within it). `kv_ops`: whether it moves real KV
    and so needs each plan's explicit ops (`StepPlan.ops`, and `move_kv` for the ops of a decision that runs
    nothing); False for a backend that prices the bytes of `StepPlan.moves` instead."""

    state: ClusterState
    capabilities: Capabilities
    kv_ops: bool

    def now(self) -> float: ...
    def execute(self, plan: StepPlan) -> Generator[Any, Any, StepResult]: ...
    def move_kv(self, ops: KVOps) -> None:
        """Carry out KV ops of a boundary that runs nothing (an idle decision's yields, evictions)."""
        ...
    def idle(self) -> Generator[Any, Any, None]:
        """Block this instance until `wake` (another instance finished a step or ended)."""
        ...
    def wake(self) -> None: ...


@dataclass
class StepRecord:
    instance: int
    start: float
    duration: float
    phase: str
    iterations: int
    tokens: int
    running: int
    expert_tokens: float
    expert_calls: int
    rank_busy: np.ndarray
    rank_comm: np.ndarray
    # what was decided at the boundary that started this run (`decision`; built when first read)
    summary: BoundaryDecision | DeferredDecision | None = None
    modules: dict[str, float] = field(default_factory=dict)  # StepResult.modules

    @property
    def decision(self) -> BoundaryDecision | None:
        if isinstance(self.summary, DeferredDecision):
            self.summary = self.summary.resolve()
        return self.summary


@dataclass
class InstanceProgress:
    """Per-instance state that is not per-sequence: static padding rows, the last phase, and what the policy's
    last decision carries to its next one."""

    num_ranks: int
    last_phase: Phase = "idle"
    carry: Any = None
    pad_rows: np.ndarray = field(init=False)
    pad_context: np.ndarray = field(init=False)
    padding: bool = False  # pad_rows may hold rows (False: both are zeros, which a plan may share read-only)
    views: Any = None      # the state's _SharedViews, as the last snapshot found them

    def __post_init__(self):
        self.pad_rows = np.zeros(self.num_ranks, np.int64)
        self.pad_context = np.zeros(self.num_ranks, np.int64)
        self._zeros = np.zeros(self.num_ranks, np.int64)
        self._zeros.flags.writeable = False

    def pads(self) -> tuple[np.ndarray, np.ndarray]:
        """(pad_rows, pad_context) for a snapshot or a plan: copies, or one shared read-only zeros array."""
        if self.padding or not fastpath.ENABLED:
            return self.pad_rows.copy(), self.pad_context.copy()
        return self._zeros, self._zeros


class _ReadOnlyPool:
    """What a policy may do with a pool: count it and look at its head."""

    __slots__ = ("_queue",)

    def __init__(self, queue):
        self._queue = queue

    def __len__(self) -> int:
        return len(self._queue)

    def peek(self, n: int) -> np.ndarray:
        return _frozen(self._queue.peek(n))


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view: a policy that writes into the state's arrays fails at the write, not much later."""
    view = a.view()
    view.flags.writeable = False
    return view


class _SharedViews:
    """The parts of a state's snapshots that are the same at every boundary, built once: read-only views of its
    pools and of its length columns, and each instance's GPUs' nodes, the nodes' owners and the GPUs' KV capacities
    (neither the topology nor the capacities change). Built again if the state's table, pool lists or capacities
    are replaced (recovery swaps them)."""

    def __init__(self, state: ClusterState):
        t, topo = state.table, state.topo
        self.sources = (state.table, state.pending, state.pinned, state.suspended, state.gpu_pages)
        self.pending = [_ReadOnlyPool(q) for q in state.pending]
        self.pinned = [_ReadOnlyPool(q) for q in state.pinned]  # per global GPU
        self.suspended = [_ReadOnlyPool(q) for q in state.suspended]
        self.lengths = Lengths(_frozen(t.input_len), _frozen(t.decoded))
        self.node_instance = _frozen(state.node_instance)
        self.rank_node = [_frozen(topo.gpu_node[state.instance_gpus(i)]) for i in range(topo.num_instances)]
        self.one_gpu = [state.instance_gpus(i).size == 1 for i in range(topo.num_instances)]
        # KV pages per rank: capacities, set when the state is built and never changed
        self.pages_capacity = [_frozen(state.gpu_pages[state.instance_gpus(i)]) for i in range(topo.num_instances)]
        self.instance_pinned = [[self.pinned[g] for g in state.instance_gpus(i)] for i in range(topo.num_instances)]

    def current(self, state: ClusterState) -> bool:
        table, pending, pinned, suspended, gpu_pages = self.sources
        return (table is state.table and pending is state.pending and pinned is state.pinned
                and suspended is state.suspended and gpu_pages is state.gpu_pages)

    @classmethod
    def of(cls, state: ClusterState) -> "_SharedViews":
        views = _VIEWS.get(state)
        if views is None:
            views = _VIEWS[state] = cls(state)
        if not views.current(state):
            views = _VIEWS[state] = cls(state)
        return views


_VIEWS: "weakref.WeakKeyDictionary[ClusterState, _SharedViews]" = weakref.WeakKeyDictionary()


def filled(n: int, value, dtype) -> np.ndarray:
    """n copies of `value`, read-only and shared: a column every running sequence has the same value in (degree 1
    when nothing was ever partitioned, not host-resident without host copies, one token in a forward)."""
    key = (n, value, dtype)
    out = _FILLED.get(key)
    if out is None:
        if len(_FILLED) >= 4096:
            _FILLED.clear()
        out = _FILLED[key] = np.full(n, value, dtype)
        out.flags.writeable = False
    return out


_FILLED: dict[tuple, np.ndarray] = {}


def _tp_and_hosted(state: ClusterState, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running sequences' partition degrees and host-residency flags; shared constants where the state has no
    partition and no host copy (a fast path: `ClusterState.check` verifies the flags it reads)."""
    t = state.table
    if not fastpath.ENABLED:
        return t.tp[ids], t.host_resident[ids]
    tp = t.tp[ids] if state.partitioned_ever else filled(ids.size, 1, t.tp.dtype)
    hosted = t.host_resident[ids] if state.has_host_copies() else filled(ids.size, False, t.host_resident.dtype)
    return tp, hosted


def make_snapshot(state: ClusterState, instance: int, now: float, progress: InstanceProgress,
                  gpus_per_node: int, capabilities: Capabilities = Capabilities()) -> Snapshot:
    t = state.table
    gpus = state.instance_gpus(instance)  # read-only, shared
    ids = state.active[instance]
    views = progress.views
    if views is None or not views.current(state):
        views = progress.views = _SharedViews.of(state)
    tp, hosted = _tp_and_hosted(state, ids)
    decoded = t.decoded[ids]  # read once: the context is the prompt plus it (Lengths.context)
    # indexing with an id array already copies: the snapshot's per-sequence arrays are the policy's own (but the
    # shared read-only ones: views of the state, and columns of one value, such as degree 1 when nothing is
    # partitioned)
    return Snapshot(
        now=now, instance=instance, page_tokens=state.page_tokens, gpus=gpus,
        rank_node=views.rank_node[instance], pages_used=state.pages_used[gpus],
        pages_capacity=views.pages_capacity[instance] if fastpath.ENABLED else state.gpu_pages[gpus],
        pad_rows=progress.pads()[0],
        active_ids=_frozen(ids), active_context=t.input_len[ids] + decoded,
        # every running sequence of a one-GPU instance is on its rank 0
        active_rank=np.zeros(ids.size, np.int64) if views.one_gpu[instance] and fastpath.ENABLED
        else state.gpu_rank[t.where[ids]],
        active_decoded=decoded, active_pages=t.pages[ids], active_tp=tp, active_host_resident=hosted,
        pending=views.pending[instance], pinned=views.instance_pinned[instance], suspended=views.suspended,
        node_instance=views.node_instance, host_capacity_tokens=state.host_kv_tokens,
        host_used_tokens=state.host_committed(except_instance=instance),
        lengths=views.lengths, last_phase=progress.last_phase, gpus_per_node=gpus_per_node,
        capabilities=capabilities, active_prefilled=t.prefilled[ids], carry=progress.carry,
    )


def apply_decision(state: ClusterState, instance: int, d: Decision, progress: InstanceProgress,
                   now: float = 0.0, ledger: KVLedger | None = None) -> StepPlan:
    """Carry out a decision through the coroutine primitives and describe the run that follows. With a
    `ledger` (a backend that moves real KV, or invariant checks) the plan carries the explicit KV ops too,
    checked against the ledger and recorded there."""
    topo, t = state.topo, state.table
    gpus = state.instance_gpus(instance)
    moving = (d.yield_ids.size or d.offload_ids.size or d.move_ids.size or d.admits or d.partition_ids.size
              or d.prefill_to_host)
    moves = Moves.zeros(topo.num_gpus) if moving or not fastpath.ENABLED else Moves.none(topo.num_gpus)
    if d.pin_ids.size:
        state.pin(instance, d.pin_ids, gpus[d.pin_ranks])
    if d.evict_ids.size:
        state.evict(instance, d.evict_ids)
    if d.yield_ids.size:
        state.yield_(instance, d.yield_ids, moves)
    if d.offload_ids.size:
        state.offload(instance, d.offload_ids, moves)
    if d.move_ids.size:
        state.move_running(instance, d.move_ids, gpus[d.move_ranks], moves)
    if d.ffn_schedule not in FFN_SCHEDULES:
        raise InvariantError(f"Decision.ffn_schedule must be one of {', '.join(FFN_SCHEDULES)}, got {d.ffn_schedule!r}")
    prefill = d.prefill_ids.size > 0
    chunked = d.chunk_ids.size > 0
    if prefill and chunked:
        raise InvariantError("a decision prefills whole prompts or chunks of them, not both")
    steps = 1 if prefill or chunked else max(int(d.steps), 1)
    for admit in d.admits:
        state.combine(instance, admit.node, admit.ids, gpus[admit.ranks], moves, lookahead_tokens=steps,
                      host_resident=admit.host_resident, keep_host_copy=admit.keep_host_copy)
    if d.partition_ids.size:
        state.partition(instance, d.partition_ids, d.partition_degree, moves)
    if prefill:
        _take_prefill(state, instance, d, gpus)
    decode_ids = state.active[instance]
    if prefill and not d.prefill_to_host:
        decode_ids = np.setdiff1d(decode_ids, d.prefill_ids, assume_unique=True)
    if state.num_part_prefilled or not fastpath.ENABLED:
        partial = t.prefilled[decode_ids] > 0
        if partial.any():  # part-way through a chunked prefill: no token to decode yet
            decode_ids = decode_ids[~partial]
    waiting = 0
    if chunked and d.chunks_only:
        waiting, decode_ids = decode_ids.size, _EMPTY  # a prefill-only forward: the running sequences wait for it
    chunk = {}
    if chunked:
        chunk = _take_chunks(state, instance, d, gpus)
    state.reserve(decode_ids, steps)
    _reserve_host(state, instance, d, decode_ids, steps)
    if not d.padded and (progress.padding or not fastpath.ENABLED):
        progress.pad_rows[:] = 0
        progress.pad_context[:] = 0
        progress.padding = False
    pad_rows, pad_context = progress.pads()
    decode_tp, decode_hosted = _tp_and_hosted(state, decode_ids)
    one_gpu = fastpath.ENABLED and gpus.size == 1  # every running sequence of the instance is on rank 0
    ops = None if ledger is None else _kv_ops(state, ledger, instance, d, gpus, chunk, decode_ids)
    return StepPlan(
        instance=instance, gpus=gpus, decode_ids=decode_ids,
        decode_rank=np.zeros(decode_ids.size, np.int64) if one_gpu else state.gpu_rank[t.where[decode_ids]],
        decode_tp=decode_tp, prefill_ids=d.prefill_ids, prefill_rank=d.prefill_ranks,
        steps=steps, stop=d.stop, micro_batch=d.micro_batch, decode_host_resident=decode_hosted,
        cpu_attention=d.cpu_attention, pad_rows=pad_rows, pad_context=pad_context, moves=moves, host_sync=d.host_sync,
        prefill_to_host=d.prefill_to_host, padded=d.padded, start=now, ffn_schedule=d.ffn_schedule, ops=ops,
        waiting=waiting, **chunk,
    )


def _kv_ops(state: ClusterState, ledger: KVLedger, instance: int, d: Decision, gpus: np.ndarray, chunk: dict,
            decode_ids: np.ndarray) -> KVOps:
    """The decision's KV ops: for every sequence it touched (and those that finished in the instance's last
    run), from where the ledger has its KV to where the state now keeps it; checked and recorded."""
    fresh_ids, fresh_gpu = d.prefill_ids, gpus[d.prefill_ranks]
    to_host = np.full(fresh_ids.size, bool(d.prefill_to_host))
    if chunk:
        first = chunk["chunk_start"] == 0
        fresh_ids = np.concatenate([fresh_ids, chunk["chunk_ids"][first]])
        fresh_gpu = np.concatenate([fresh_gpu, gpus[chunk["chunk_rank"][first]]])
        to_host = np.concatenate([to_host, np.zeros(int(first.sum()), bool)])
    touched = [ledger.take_finished(instance), d.evict_ids, d.yield_ids, d.offload_ids, d.move_ids,
               d.partition_ids, fresh_ids, *(a.ids for a in d.admits)]
    ops = plan_ops(state, ledger, instance, np.concatenate(touched).astype(np.int64, copy=False), fresh_ids)
    ledger.apply(ops, fresh_ids, fresh_gpu, to_host)
    t = state.table
    ledger.check_running(decode_ids, t.where[decode_ids], ~t.host_resident[decode_ids] & (t.tp[decode_ids] == 1),
                         t.tp[decode_ids])
    return ops


def _reserve_host(state: ClusterState, instance: int, d: Decision, decode_ids: np.ndarray, steps: int) -> None:
    """What this run will add to host memory, so that instances sharing a node do not overfill it together."""
    t, node = state.table, state.topo.gpu_node
    if fastpath.ENABLED and not (d.prefill_to_host and d.prefill_ids.size) and not state.has_host_copies():
        state.reserve_host(instance, _EMPTY, _EMPTY)  # no host copy to grow, no prefill to host
        return
    parts_nodes, parts_tokens = [], []
    if decode_ids.size:  # copies kept in sync grow: all of them with host_sync, host-resident ones always
        synced = decode_ids[(t.host_node[decode_ids] >= 0) & (d.host_sync | t.host_resident[decode_ids])]
        parts_nodes.append(t.host_node[synced])
        parts_tokens.append(np.full(synced.size, steps))
    if d.prefill_to_host and d.prefill_ids.size:
        gpus = state.instance_gpus(instance)
        parts_nodes.append(node[gpus[d.prefill_ranks]])
        parts_tokens.append(t.context(d.prefill_ids) + 1)
    empty = np.empty(0, np.int64)
    state.reserve_host(instance, np.concatenate(parts_nodes) if parts_nodes else empty,
                       np.concatenate(parts_tokens) if parts_tokens else empty)


def _take_prefill(state: ClusterState, instance: int, d: Decision, gpus: np.ndarray) -> None:
    ids, ranks = d.prefill_ids, d.prefill_ranks
    if d.prefill_pinned:
        for r in _distinct(ranks):
            state.take_pending(instance, ids[ranks == r], int(gpus[r]))
    else:
        state.take_pending(instance, ids)
    if d.prefill_to_host:
        state.start_prefill_to_host(instance, ids)
    else:
        # Running from the prefill on: pages for the prompt (and the first token) are allocated now.
        state.prefilled_to_gpu(instance, ids, gpus[ranks], lookahead_tokens=1)


def _distinct(ranks: np.ndarray) -> list[int]:
    """np.unique of a boundary's few ranks (ascending), without its sort machinery."""
    return sorted(set(ranks.tolist())) if fastpath.ENABLED else np.unique(ranks)


def _take_chunks(state: ClusterState, instance: int, d: Decision, gpus: np.ndarray) -> dict[str, np.ndarray]:
    """First chunks leave their queue (in order: each rank's are the head of its queue); every chunk's pages are
    allocated. Returns the plan's chunk fields."""
    t = state.table
    ids, ranks = np.asarray(d.chunk_ids, np.int64), np.asarray(d.chunk_ranks, np.int64)
    lens = np.asarray(d.chunk_lens, np.int64)
    distinct = len(set(ids.tolist())) if fastpath.ENABLED else np.unique(ids).size
    if not (ids.size == ranks.size == lens.size) or distinct != ids.size:
        raise InvariantError("chunks need one rank and one length per sequence, each sequence once")
    starts = t.prefilled[ids]  # a copy: where each chunk starts (prefill_chunks moves it on)
    if fastpath.ENABLED and ids.size <= _FEW_CHUNKS:  # the few chunks of a forward: their flags as Python lists
        start, first = starts.tolist(), [w == PENDING for w in t.where[ids].tolist()]
        if any(f and s0 != 0 for f, s0 in zip(first, start)):
            raise InvariantError("a pending sequence has no prefill under way")
        if any(first):
            new = [(i, r) for i, r, f in zip(ids.tolist(), ranks.tolist(), first) if f]
            if d.prefill_pinned:
                for r in sorted({r for _, r in new}):
                    state.take_pending(instance, np.array([i for i, q in new if q == r], np.int64), int(gpus[r]))
            else:
                state.take_pending(instance, np.array([i for i, _ in new], np.int64))
        completes = np.array([s0 + n == int(t.input_len[i]) + int(t.decoded[i])  # the chunk ends its context
                              for i, s0, n in zip(ids.tolist(), start, lens.tolist())], bool)
    else:
        first = t.where[ids] == PENDING
        if (first & (starts != 0)).any():
            raise InvariantError("a pending sequence has no prefill under way")
        if first.any():
            new, new_ranks = ids[first], ranks[first]
            if d.prefill_pinned:
                for r in _distinct(new_ranks):
                    state.take_pending(instance, new[new_ranks == r], int(gpus[r]))
            else:
                state.take_pending(instance, new)
        completes = starts + lens == t.context(ids)
    state.prefill_chunks(instance, ids, gpus[ranks], starts, lens)
    return dict(chunk_ids=ids, chunk_rank=ranks, chunk_start=starts, chunk_len=lens, chunk_completes=completes)


def record_outcome(state: ClusterState, plan: StepPlan, res: StepResult, start: float,
                   progress: InstanceProgress, padded: bool) -> None:
    """Fold what the run produced back into the state: tokens, finishes, prefilled sequences."""
    t = state.table
    inst = plan.instance
    if plan.decode_ids.size:
        ids = plan.decode_ids
        state.advance(ids, res.produced, plan.host_sync)
        done = ids[res.finished]
        if done.size:
            if padded:
                ranks = plan.decode_rank[res.finished]
                np.add.at(progress.pad_rows, ranks, 1)
                np.add.at(progress.pad_context, ranks, t.context(done))
                progress.padding = True
            state.finish(inst, done, start + res.finish_offset[res.finished])
    if plan.prefill_ids.size:
        ids = plan.prefill_ids
        gpus = plan.gpus[plan.prefill_rank]
        state.advance(ids, np.ones(ids.size, np.int64), host_sync=False)  # prefill makes the first token
        t.first_token_time[ids] = np.where(np.isnan(t.first_token_time[ids]), start + res.duration,
                                           t.first_token_time[ids])
        done = ids[res.prefill_finished]
        if plan.prefill_to_host:
            live = ~res.prefill_finished
            state.prefilled_to_host(inst, ids[live], gpus[live], plan.moves)
        if done.size:
            state.finish(inst, done, np.full(done.size, start + res.duration))
    if plan.chunk_ids.size:
        ids = plan.chunk_ids
        done_prompt = ids[plan.chunk_completes]
        if fastpath.ENABLED and 0 < done_prompt.size <= _FEW_CHUNKS and not state.has_host_copies():
            at = start + res.duration  # `advance` of one token each and the first-token times, on scalars
            for sid in done_prompt.tolist():
                t.decoded[sid] += 1
                if math.isnan(t.first_token_time[sid]):
                    t.first_token_time[sid] = at
        elif done_prompt.size:
            state.advance(done_prompt, np.ones(done_prompt.size, np.int64), host_sync=False)  # the first token
            t.first_token_time[done_prompt] = np.where(np.isnan(t.first_token_time[done_prompt]),
                                                       start + res.duration, t.first_token_time[done_prompt])
        done = ids[res.chunk_finished]
        if done.size:
            state.finish(inst, done, np.full(done.size, start + res.duration))
    state.reserve_host(inst, _EMPTY, _EMPTY)  # the run's additions are real now
    if padded:
        running = state.gpu_rank[t.where[state.active[inst]]]
        drained = np.bincount(running, minlength=plan.gpus.size) == 0
        progress.pad_rows[drained] = 0
        progress.pad_context[drained] = 0


StepObserver = Callable[[StepPlan, StepResult], None]


def finished_ids(plan: StepPlan, result: StepResult) -> np.ndarray:
    """The sequences that ended in this run (decodes that stopped, prefills whose one token was the last)."""
    parts = [plan.decode_ids[result.finished], plan.prefill_ids[result.prefill_finished]]
    if plan.chunk_ids.size:
        parts.append(plan.chunk_ids[result.chunk_finished])
    return np.concatenate(parts)


class Liveness:
    """Which instances are still live and which wait on another: the deadlock check, once for every backend.

    An instance whose policy decides nothing runnable several times in a row waits until another instance
    finishes a step (what it waits for, such as a shared node's host memory, may then be free). When every live
    instance waits, none will ever wake: the run fails with the policy's name instead of hanging."""

    def __init__(self, num_instances: int):
        self.live = set(range(num_instances))
        self.waiting: set[int] = set()

    def wait(self, backend: Backend, instance: int, policy_name: str) -> Generator[Any, Any, None]:
        self.waiting.add(instance)
        if self.live <= self.waiting:
            raise InvariantError(f"policy {policy_name!r} made no progress on instances {sorted(self.waiting)} "
                                 "although they still have queued sequences, and no instance is running")
        yield from backend.idle()
        self.waiting.discard(instance)

    def changed(self, backend: Backend) -> None:
        """An instance finished a step: the waiting ones look again (a waiter not yet resumed is not blocked:
        no false deadlock)."""
        if self.waiting:
            self.waiting.clear()
            backend.wake()

    def done(self, backend: Backend, instance: int) -> None:
        self.live.discard(instance)
        self.changed(backend)  # waiting instances look again (and report a deadlock if all are stuck)


@dataclass
class RunOutput:
    """What a run produced, whichever backend ran it (the executor's `ExecOutput` adds its own)."""

    job: Any
    prepared: Any
    records: list[StepRecord]
    wall_s: float
    events: int
    backend: str = "sim"
    host_bytes: float = 0.0                # bytes moved host <-> device over the whole run, both directions
    host_bytes_per_iteration: float = 0.0  # decode runs' host <-> device bytes per decode iteration
    h2d_bytes: float = 0.0                 # host -> device bytes over the whole run (part of host_bytes)


def check_supported(policy: Policy, capabilities: Capabilities) -> None:
    """A policy that asks for a way of running forwards (two-batch overlap, tensor-parallel attention, an FFN per
    micro-batch) the backend has not declared is refused before the run, with the knob to change."""
    from batchgen.memory import ConfigError

    if policy.two_batch_overlap and not capabilities.two_batch_overlap:
        raise ConfigError(f"policy {policy.name} runs two-batch overlap, which this backend does not: set "
                          "policy.two_batch_overlap=false")
    if policy.attention_tp not in (1, "auto") and not capabilities.attention_tp:
        raise ConfigError(f"policy {policy.name} runs tensor-parallel attention (attention_tp="
                          f"{policy.attention_tp}), which this backend does not: set policy.attention_tp=1")
    if policy.ffn_schedule != "combined" and not capabilities.micro_batch_ffn:
        raise ConfigError(f"policy {policy.name} runs an FFN per attention micro-batch (ffn_schedule="
                          f"{policy.ffn_schedule}), which this backend does not: choose a policy with one expert "
                          "batch per layer")


class Engine:
    """One run of a policy on a backend: an engine loop per expert-parallel instance (`loop`), sharing the
    cluster state, the KV ledger (where the backend's KV is, for the explicit KV ops of a backend that moves
    real KV, or for invariant checks) and the deadlock check; `finish` checks that every sequence ended.

    `on_step(plan, result)` is called after each run's outcome is folded into the state: batch jobs that write
    each result the moment its sequence finishes (`finished_ids`); it needs every run's plan, so a backend's
    one-pass boundaries are off while it is set. `watch()` is called after every run on every path, plans
    unseen: a progress bar reads the state from it, so watching a run costs no more than a quiet run."""

    def __init__(self, policy: Policy, backend: Backend, *, gpus_per_node: int, check_invariants: bool = False,
                 max_idle_decisions: int = 3, on_step: StepObserver | None = None,
                 watch: Callable[[], None] | None = None):
        check_supported(policy, backend.capabilities)
        self.policy, self.backend, self.state = policy, backend, backend.state
        self.gpus_per_node, self.check_invariants = gpus_per_node, check_invariants
        self.max_idle_decisions, self.on_step, self.watch = max_idle_decisions, on_step, watch
        self.records: list[StepRecord] = []
        self.liveness = Liveness(self.state.topo.num_instances)
        # built only where someone reads it: the simulator prices bytes, and its hot loop stays as it was
        self.ledger = KVLedger.of(self.state) if backend.kv_ops or check_invariants else None

    def loops(self) -> list[Generator[Any, Any, None]]:
        return [self.loop(inst) for inst in range(self.state.topo.num_instances)]

    def run_in_turn(self) -> None:
        """Drive every instance's loop in one thread, round-robin, one step (or one wait) each at a time: how the
        real-tensor backends run (the simulator instead gives each loop to SimPy)."""
        loops = self.loops()
        while loops:
            for loop in list(loops):
                try:
                    next(loop)
                except StopIteration:
                    loops.remove(loop)

    def loop(self, instance: int) -> Generator[Any, Any, None]:
        """Drive one instance until its policy has nothing left to run."""
        policy, backend, state, ledger = self.policy, self.backend, self.state, self.ledger
        liveness = self.liveness
        progress = InstanceProgress(state.instance_gpus(instance).size)
        idle, last = 0, 0.0
        # an instance that only runs work other instances hand over (PD-disaggregation's decode units) stays
        # until the job is done, though nothing is queued for it yet
        receives = policy.receives_work
        folded = None  # what idle decisions changed since the last run: recorded with the next one
        # a backend that runs a plain boundary in one pass (the simulator: batchgen.sim.fused), where no observer
        # needs the plan and no repeat is declared
        one_pass = (getattr(backend, "boundary", None) if fastpath.ENABLED and self.on_step is None
                    and getattr(policy, "repeats", None) is None else None)
        while True:
            now = backend.now()
            if now < last:
                raise InvariantError(f"instance {instance}: the clock went back from {last} to {now}")
            last = now
            snap = make_snapshot(state, instance, now, progress, self.gpus_per_node, backend.capabilities)
            decision = policy.decide(snap)
            progress.carry = decision.carry
            run = one_pass(self, instance, decision, progress, now, folded) if one_pass is not None else None
            if run is not None:
                idle, folded = 0, None
                yield from run
                continue
            plan = apply_decision(state, instance, decision, progress, now, ledger)
            phase = plan.phase
            if phase == "idle":
                if plan.ops is not None and backend.kv_ops and not plan.ops.empty():
                    backend.move_kv(plan.ops)  # yields, evictions of a decision that runs nothing
                change = BoundaryDecision.of(decision, plan, folded)
                folded = change if change.changes_something() else folded
                if not state.remaining_work(instance) and (state.all_finished() or not receives(instance)):
                    liveness.done(backend, instance)
                    return  # nothing here any more; other instances may still run
                idle += 1
                if idle <= self.max_idle_decisions:
                    continue  # the decision may have freed something (yields, evictions): decide again
                # Blocked on what another instance holds (a shared node's host memory): wait until it moves.
                yield from liveness.wait(backend, instance, policy.name)
                idle = 0
                continue
            idle = 0
            summary = (DeferredDecision(decision, plan, folded) if fastpath.ENABLED
                       else BoundaryDecision.of(decision, plan, folded))
            folded = None
            more = repeat.repeats(self, instance, snap, decision, plan)
            if more:  # the same decode at the next boundaries: one event, each boundary replayed
                yield from repeat.run_repeated(self, instance, decision, plan, summary, progress, more)
                continue
            result = yield from backend.execute(plan)
            self.record(instance, plan, result, now, progress, decision.padded, summary)

    def record(self, instance: int, plan: StepPlan, result: StepResult, start: float, progress: InstanceProgress,
               padded: bool, summary: BoundaryDecision) -> None:
        """Fold a run's outcome into the state and record it (its step record, observers, invariant checks)."""
        record_outcome(self.state, plan, result, start, progress, padded)
        if self.on_step is not None:
            self.on_step(plan, result)
        running = plan.decode_ids.size + plan.prefill_ids.size + plan.chunk_ids.size + plan.waiting
        self.closed(instance, progress, StepRecord(
            instance, start, result.duration, plan.phase, result.iterations, result.tokens, int(running),
            result.expert_tokens, result.expert_calls, result.rank_busy, result.rank_comm, summary, result.modules),
            finished_ids(plan, result) if self.ledger is not None else None)

    def closed(self, instance: int, progress: InstanceProgress, record: StepRecord,
               finished: np.ndarray | None) -> None:
        """The end of a run, whichever path ran it (`record`, or a backend's one-pass boundary): the KV ledger
        forgets the sequences that `finished` (given where there is a ledger), waiting instances look again, and
        the step record is kept."""
        if self.ledger is not None:
            self.ledger.finished(instance, finished)
        self.liveness.changed(self.backend)
        progress.last_phase = record.phase
        self.records.append(record)
        if self.watch is not None:
            self.watch()
        if self.check_invariants:
            self.state.check()

    def finish(self) -> None:
        """After every loop ended: every sequence finished, and the bookkeeping recounts."""
        state = self.state
        if not state.all_finished():
            raise InvariantError(f"policy {self.policy.name!r} stopped with {len(state.table) - state.num_finished} "
                                 "sequences unfinished")
        state.check()
