"""Identical decode runs back to back as one event: the simulator's side (the engine's: batchgen.engine.repeat).

`execute_repeated(backend, plan, n)` is `SimBackend.execute` of `plan` and of the n runs of the same decision
after it, as the engine would have planned them (each running sequence decodes `plan.steps` tokens per run until
it ends), returning each run's sequences and `StepResult` and making time pass once. Each result is the one
`execute` gives that run alone, bit for bit: the runs' loads are the first run's load over (n + 1) x steps
iterations cut into consecutive ranges (a sequence's context at a later run's start is its context now plus
the tokens made since, whole numbers summed exactly); an offloading system's one-rank chain
(batchgen.pricing.scalar_offload.Chain) is priced once over all of them and reduced per range, any other offloading
run is priced run by run on its own grid as `execute` prices it; each run's duration, finish offsets and
counters follow `execute`'s arithmetic. The clock lands where n + 1 timeouts would have left it (the running
sum of the durations, added in order: one timeout of the delay that lands there, or, where rounding leaves no
such delay, the n + 1 timeouts); tests/test_sim_paths.py compares whole jobs with and without it.

It covers the runs `can_repeat` accepts: an offloading system's schedule (an FFN per micro-batch) with nothing
moved, no host-resident sequence, no padding and no partition; everything else runs one run per event.
"""

from __future__ import annotations

import math
from typing import Any, Generator

import numpy as np

from batchgen.engine import StepPlan, StepResult
from batchgen.pricing.costs import RunCost, decode_grid
from batchgen.pricing.scalar_offload import chain_applies, chain_vectors

_NONE = np.empty(0, bool)
_NONE.flags.writeable = False


def can_repeat(backend, plan: StepPlan) -> bool:
    """Whether `execute_repeated` mirrors `execute` for runs of this plan."""
    return (plan.ffn_schedule != "combined" and plan.phase == "decode" and not plan.padded
            and not plan.pad_rows.any() and not plan.host_sync and not plan.prefill_to_host
            and not plan.moves.any() and not np.asarray(plan.decode_host_resident, bool).any()
            and (not plan.decode_tp.size or int(plan.decode_tp.max()) == 1) and plan.stop == "none")


def execute_repeated(backend, plan: StepPlan, n: int) -> Generator[Any, Any, list[tuple[np.ndarray, StepResult]]]:
    """(sequences, result) of `plan`'s run and the n identical runs after it; one timeout."""
    if not can_repeat(backend, plan):
        raise ValueError("execute_repeated: this plan's runs are not ones it mirrors (see can_repeat)")
    t = backend.state.table
    ids0 = plan.decode_ids
    remaining0, context0 = t.remaining(ids0), t.context(ids0)
    P = max(int(plan.steps), 1)
    costs = _priced_together(backend, plan, remaining0, context0, n, P)
    out, durations = [], []
    for j in range(n + 1):
        live = remaining0 > j * P
        ids, rank = ids0[live], plan.decode_rank[live]
        remaining = remaining0[live] - j * P
        k = min(P, int(remaining.max()))  # decode_participation with stop "none": the last run ends with its last
        produced = np.minimum(remaining, k)
        if costs is not None:
            cost, h2d, d2h, calls, gate_total = costs(j, k)
            backend.count_decode_traffic(h2d, d2h)
        else:  # priced alone, as execute prices it
            cost, calls, gate_total = backend.offload_run(plan, rank, context0[live] + j * P, produced,
                                                          plan.decode_tp[live], np.zeros(ids.size, bool), k)
        backend.decode_iterations += int((cost.iteration_s > 0).sum())
        result = _result(backend, cost, calls, gate_total, ids.size, k, produced, remaining == produced)
        durations.append(result.duration)
        out.append((ids, result))
    delay = _landing_delay(float(backend.env.now), durations)
    if delay is not None:
        backend.events += 1
        yield backend.env.timeout(delay)
    else:  # no one delay lands there (a rounding tie): a timeout per run, as execute's would
        backend.events += len(durations)
        for duration in durations:
            yield backend.env.timeout(duration)
    return out


def _priced_together(backend, plan: StepPlan, remaining0: np.ndarray, context0: np.ndarray, n: int, P: int):
    """(j, k) -> (cost, h2d, d2h, calls, gate tokens) of run j, k iterations long, from one chain priced over all
    the runs, or None where the chain does not apply (the runs are then priced one by one)."""
    if not chain_applies(backend.lat) or plan.gpus.size != 1 or backend.similar_calls:
        return None
    K = (n + 1) * P
    grid = decode_grid(plan.decode_rank, context0, np.minimum(remaining0, K), plan.decode_tp,
                       np.zeros(remaining0.size, bool), 1, K, plan.micro_batch, plan.pad_rows, plan.pad_context)
    chain = chain_vectors(backend.lat, grid, plan.micro_batch)
    if chain is None:
        return None
    gate = grid.gate_tokens

    def run(j: int, k: int):
        part = slice(j * P, j * P + k)
        cost, h2d, d2h, calls = chain.cost(part, RunCost)
        return cost, h2d, d2h, calls, gate[:, part].sum()

    return run


def _result(backend, cost: RunCost, calls: np.ndarray, gate_total, in_play: int, iterations: int,
            produced: np.ndarray, finished: np.ndarray) -> StepResult:
    """`SimBackend.execute`'s result of a decode run with nothing moved (its arithmetic, step by step)."""
    compute = cost.compute_s
    exposed = 0.0
    run = compute + exposed if backend._serial else max(compute, exposed)
    boundary = backend._boundary_s.get(in_play)
    if boundary is None:
        boundary = backend._boundary_s[in_play] = float(backend.lat.boundary_overhead(in_play))
    duration = boundary + run
    scale = run / compute if compute > 0 else 0.0
    offsets = np.full(produced.size, np.nan)
    if finished.any():
        clock = boundary + np.cumsum(cost.iteration_s) * scale
        offsets[finished] = clock[produced[finished] - 1] if compute > 0 else duration
    rank_comm = cost.rank_comm + 0.0
    expert_calls = int(calls.sum()) if backend.lat.model.is_moe else 0
    return StepResult(duration, iterations, produced, finished, offsets, _NONE, cost.rank_busy, rank_comm,
                      float(cost.expert_tokens.sum()), expert_calls, int(gate_total),
                      modules=cost.modules, chunk_finished=_NONE)


def _landing_delay(now: float, durations: list[float]) -> float | None:
    """A delay d with now + d equal, in floating point, to the clock after one timeout per duration (each added
    to the clock in turn, as the event queue adds them); None where no d does (now + d can skip the end when
    `now` falls on half a unit of the end's last place: round half to even)."""
    end = now
    for d in durations:
        end = end + d
    delay = end - now
    for _ in range(4):  # the nearest delays: end - now rounded is within an ulp or two of a landing one
        if now + delay == end:
            return delay
        delay = math.nextafter(delay, math.inf if now + delay < end else -math.inf)
    return None
