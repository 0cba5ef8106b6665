"""The engine loop, written once for every backend: snapshot -> decide -> apply -> run to the next boundary.

A backend only has to execute a `StepPlan` (advance the clock by the latency model, or run real tensors) and
report what each sequence produced. Everything else, the bookkeeping of where sequences live, applying a
policy's decision through the coroutine primitives, turning it into explicit per-GPU KV operations
(batchgen.core.ops) for a backend that moves real KV, noticing a deadlock and recording results, lives in this
package and in core/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import numpy as np

from batchgen.core.ops import KVLedger
from batchgen.core.sequences import InvariantError
from batchgen.decisions import BoundaryDecision, DeferredDecision
from batchgen.engine import repeat
from batchgen.engine.apply import apply_decision, record_outcome
from batchgen.engine.plan import Backend, StepObserver, StepPlan, StepResult
from batchgen.engine.snapshot import InstanceProgress, make_snapshot
from batchgen.policy.base import Capabilities, Policy


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
    """A policy that asks for a way of running forwards (two-batch overlap, the all-to-all overlapped across
    micro-batches, tensor-parallel attention, an FFN per micro-batch) the backend has not declared is refused before
    the run, with the knob to change."""
    from batchgen.memory import ConfigError

    if policy.two_batch_overlap and not capabilities.two_batch_overlap:
        raise ConfigError(f"policy {policy.name} runs two-batch overlap, which this backend does not: set "
                          "policy.two_batch_overlap=false")
    if policy.comm_overlap and not capabilities.comm_overlap:
        raise ConfigError(f"policy {policy.name} overlaps the expert all-to-all with the next micro-batch's "
                          "compute, which this backend does not (backend=sim and backend=dist do): set "
                          "policy.comm_overlap=false")
    if policy.prefill_parallel == "dp" and not capabilities.dp_prefill:
        raise ConfigError(f"policy {policy.name} prefills data parallel, streaming in the experts each rank does "
                          "not hold, which this backend does not (backend=sim and backend=dist do): set "
                          "policy.prefill_parallel=ep")
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
    each result the moment its sequence finishes (`finished_ids`). `watch()` is called after every run, plans
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
        carried = None  # bytes idle decisions moved (a yield with nothing to run): priced with the next run
        while True:
            now = backend.now()
            if now < last:
                raise InvariantError(f"instance {instance}: the clock went back from {last} to {now}")
            last = now
            snap = make_snapshot(state, instance, now, progress, self.gpus_per_node, backend.capabilities)
            decision = policy.decide(snap)
            progress.carry = decision.carry
            plan = apply_decision(state, instance, decision, progress, now, ledger)
            phase = plan.phase
            if phase == "idle":
                if plan.ops is not None and backend.kv_ops and not plan.ops.empty():
                    backend.move_kv(plan.ops)  # yields, evictions of a decision that runs nothing
                change = BoundaryDecision.of(decision, plan, folded)
                folded = change if change.changes_something() else folded
                if plan.moves.any():
                    carried = plan.moves if carried is None else carried.plus(plan.moves)
                if not state.remaining_work(instance) and (state.all_finished() or not receives(instance)):
                    liveness.done(backend, instance)
                    return  # nothing here any more; other instances may still run
                if state.sharing and state.drop_unheld(instance):
                    continue  # shared prefixes kept for later members held pages the policy waits for: decide again
                idle += 1
                if idle <= self.max_idle_decisions:
                    continue  # the decision may have freed something (yields, evictions): decide again
                # Blocked on what another instance holds (a shared node's host memory): wait until it moves.
                yield from liveness.wait(backend, instance, policy.name)
                idle = 0
                continue
            idle = 0
            summary = DeferredDecision(decision, plan, folded)
            folded = None
            if carried is not None:  # the copies an idle boundary started overlap this run, as this boundary's do
                plan.moves, carried = carried.plus(plan.moves), None
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
        self.liveness.changed(self.backend)  # waiting instances look again
        progress.last_phase = plan.phase
        self.records.append(StepRecord(
            instance, start, result.duration, plan.phase, result.iterations, result.tokens, int(running),
            result.expert_tokens, result.expert_calls, result.rank_busy, result.rank_comm, summary, result.modules))
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
