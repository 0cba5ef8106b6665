"""Identical decode runs back to back as one event: the engine's side (the backend's: `execute_repeated`).

Why. A block policy (FlexGen, ZeRO-Inference) decides at every page boundary to decode its whole block again,
until the block drains: on Vidur's workload (benchmarks/sim_scale.py --policies) 5,192 decode runs for 625
blocks, each run costing a snapshot, a decision, a priced run and a SimPy event, though nothing new is decided. Where
the policy declares (`Policy.repeats`, given the `Forecast` of its next snapshots) that its next n decisions are this
same decode, the backend prices the n + 1 runs together and makes time pass once (`execute_repeated`), and the engine
replays each boundary's bookkeeping as it would have happened: the same `apply_decision` (pages reserved for the next
page of tokens), the same outcome (tokens, finishes at the same clock readings, pages freed), one step record and one
decision record per run. Results are the same bit for bit (tests/test_sim_paths.py runs jobs with and without it);
only `events` (SimPy timeouts) counts fewer.

Where. Only where the replay is exact by construction: a backend that offers it and moves no real KV (the
simulator), one instance in the job (no other loop can look at the state or the clock between the runs), and a
decision that decodes every running sequence and does nothing else (no eviction, admission, prefill, padding,
host copy or early stop), so that the runs' loads follow from the first one's: each sequence decodes `steps`
tokens per run until it ends. With `check_invariants` the policy is asked again at every replayed boundary
(`decide` on the real snapshot), and a decision that differs from the declared repeat fails the run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from batchgen.core.sequences import InvariantError
from batchgen.decisions import BoundaryDecision
from batchgen.policy.base import Decision, Forecast, Snapshot

from batchgen.engine.apply import apply_decision
from batchgen.engine.plan import StepPlan
from batchgen.engine.snapshot import InstanceProgress, make_snapshot

if TYPE_CHECKING:  # pragma: no cover
    from batchgen.engine.loop import Engine

MAX_REPEATS = 1024  # runs merged into one event at most (bounds the priced grid: (MAX_REPEATS + 1) x steps)


def pure_decode(decision: Decision) -> bool:
    """The decision decodes the running sequences and changes nothing else."""
    d = decision
    return not (d.pin_ids.size or d.evict_ids.size or d.yield_ids.size or d.offload_ids.size or d.move_ids.size
                or d.admits or d.partition_ids.size or d.prefill_ids.size or d.chunk_ids.size or d.padded
                or d.host_sync or d.prefill_to_host or d.stop != "none")


def forecast(remaining: np.ndarray, context: np.ndarray, steps: int, limit: int = MAX_REPEATS) -> Forecast:
    """The running sequences at the next boundaries when each decodes `steps` tokens per run until it ends
    (`remaining` tokens from now): the boundaries at which any still runs, at most `limit`."""
    top = int(remaining.max(initial=0))
    J = min(max((top - 1) // steps, 0), limit)
    done = steps * np.arange(1, J + 1)[:, None]  # tokens each has made by boundary j + 1
    return Forecast(remaining[None, :] > done, context[None, :] + done)


def repeats(engine: "Engine", instance: int, snap: Snapshot, decision: Decision, plan: StepPlan) -> int:
    """How many more runs of `plan` to run with it as one event (0: run it alone)."""
    backend, state = engine.backend, engine.state
    ask = getattr(engine.policy, "repeats", None)  # None: a policy that never declares repeats
    if ask is None:
        return 0
    if (state.topo.num_instances != 1 or backend.kv_ops
            or not getattr(backend, "can_repeat", lambda plan: False)(plan) or plan.phase != "decode"
            or not pure_decode(decision) or plan.moves.any()
            or not np.array_equal(plan.decode_ids, snap.active_ids)):
        return 0
    t = state.table
    ids = plan.decode_ids
    ahead = forecast(t.remaining(ids), t.context(ids), plan.steps)
    if not ahead.alive.shape[0]:
        return 0
    n = int(ask(snap, decision, ahead))
    if not 0 <= n <= ahead.alive.shape[0]:
        raise InvariantError(f"policy {engine.policy.name!r} declared {n} repeats of a decision whose forecast "
                             f"has {ahead.alive.shape[0]} boundaries")
    return n


def run_repeated(engine: "Engine", instance: int, decision: Decision, plan: StepPlan, summary: BoundaryDecision,
                 progress: InstanceProgress, n: int) -> Generator[Any, Any, None]:
    """Run `plan` and the n identical runs after it as one event, then record each as `Engine.loop` would have:
    at each later boundary the decision is applied again to the state as it then is (and, with invariant
    checks, the policy asked again), and its run must be the one the backend priced."""
    state, backend, policy = engine.state, engine.backend, engine.policy
    start = plan.start
    runs = yield from backend.execute_repeated(plan, n)
    if len(runs) != n + 1:
        raise InvariantError(f"the backend ran {len(runs)} runs of {n + 1}")
    for j, (ids, result) in enumerate(runs):
        if j:
            start = start + runs[j - 1][1].duration  # the clock at this boundary, as the event queue adds it
            again = decision
            if engine.check_invariants:  # the declaration checked: the policy, asked, decides the same
                snap = make_snapshot(state, instance, start, progress, engine.gpus_per_node, backend.capabilities)
                again = policy.decide(snap)
                if not same_decision(again, decision):
                    raise InvariantError(f"policy {policy.name!r} declared {n} repeats of its decode but decided "
                                         f"otherwise at the {j}th: {again}")
            progress.carry = again.carry
            plan = apply_decision(state, instance, again, progress, start, engine.ledger)
            summary = BoundaryDecision.of(again, plan)
        if not np.array_equal(plan.decode_ids, ids):
            raise InvariantError(f"repeated run {j} of {n + 1}: the backend priced other sequences than run")
        engine.record(instance, plan, result, start, progress, decision.padded, summary)


def same_decision(a: Decision, b: Decision) -> bool:
    """Every field equal (id arrays element by element)."""
    for f in dataclasses.fields(Decision):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif f.name == "admits":
            if len(x) or len(y):
                return False
        elif x != y:
            return False
    return True
