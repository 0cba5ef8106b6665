"""A one-GPU instance's boundary applied, priced and recorded in one pass: the simulator's side of the engine loop
for a serving engine's forwards and short decode runs (a fast path of batchgen.fastpath).

Why. Continuous batching decides at every forward while prompts wait: on Vidur's workload (benchmarks/sim_scale.py
--policies) continuous and sglang_opt run 13-15K boundaries of one iteration or a few, each of which cost about
130 us of CPU spread over `apply_decision`, the backend's `execute` and `record_outcome`. Part of that was their
glue: a StepPlan and a StepResult of some twenty arrays each, per-field checks for primitives the decision does
not use, the same columns gathered in three places. Here the boundary's work is done once, in the order the
three functions do it, on the few arrays it needs.

Where. Only where each step is the general code's own operation on the same operands: a simulated instance of
one GPU (its sequences all on rank 0), priced on floats (batchgen.pricing.price.price_cells: a latency model that
takes them, no similar-context calls, no weights streamed), nothing on host, never partitioned, no padding; a
decision that runs up to `_FEW_CHUNKS` prompt chunks beside every decode, or decodes for at most `CELL_ITERATIONS`
iterations until the first finish or its steps, and calls no other primitive; a policy that declares no repeats and no
step observer (a progress bar, a batch job). Everything else returns None before anything changed and takes the
general path. tests/test_sim_fastpath.py runs jobs both ways and requires the same decisions, times and step
records, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from batchgen import fastpath
from batchgen.decisions import DeferredDecision
from batchgen.engine.apply import _FEW_CHUNKS, _kv_ops, _take_chunks
from batchgen.engine.loop import StepRecord
from batchgen.engine.plan import filled
from batchgen.policy.base import Decision
from batchgen.sim.finishes import few_chunks_finished, finish_offsets
from batchgen.pricing import one_rank
from batchgen.pricing.price import CELL_ITERATIONS, price_cells

if TYPE_CHECKING:  # pragma: no cover
    from batchgen.engine import Engine, InstanceProgress
    from batchgen.sim.backend import SimBackend

_EMPTY = np.empty(0, np.int64)


class _Run:
    """What a boundary's decision summary reads of its plan (`DeferredDecision`), without the plan."""

    __slots__ = ("instance", "phase", "prefill_ids", "chunk_ids", "decode_ids", "decode_host_resident", "steps",
                 "stop", "micro_batch")

    def __init__(self, instance, phase, d: Decision, chunk_ids, decode_ids, steps):
        self.instance, self.phase, self.prefill_ids, self.chunk_ids = instance, phase, d.prefill_ids, chunk_ids
        self.decode_ids, self.decode_host_resident = decode_ids, filled(decode_ids.size, False, bool)
        self.steps, self.stop, self.micro_batch = steps, d.stop, d.micro_batch


def plain(d: Decision) -> bool:
    """The decision runs chunks beside the decodes, or decodes only, and calls no other primitive."""
    return not (d.pin_ids.size or d.evict_ids.size or d.yield_ids.size or d.offload_ids.size or d.move_ids.size
                or d.admits or d.partition_ids.size or d.prefill_ids.size or d.padded or d.host_sync
                or d.prefill_to_host or d.ffn_schedule != "combined" or d.chunk_ids.size > _FEW_CHUNKS
                or (d.stop != "first_finish" and d.stop != "none"))


def boundary(backend: "SimBackend", engine: "Engine", instance: int, d: Decision, progress: "InstanceProgress",
             now: float, folded) -> Generator[Any, Any, None] | None:
    """The run of decision `d` at this boundary as one generator (apply, one timeout, record), or None where this
    path does not apply (nothing changed then)."""
    state = backend.state
    if (not fastpath.ENABLED or not plain(d) or progress.padding or state.partitioned_ever
            or state.has_host_copies() or state.prefilling[instance].size
            or state.instance_gpus(instance).size != 1 or not backend.fuses()):
        return None
    t = state.table
    ids = state.active[instance]
    if state.num_part_prefilled:
        partial = t.prefilled[ids] > 0
        if partial.any():  # part-way through a chunked prefill: no token to decode yet
            ids = ids[~partial]
    if d.chunk_ids.size:
        if d.chunks_only:  # the running sequences wait for this forward (counted as running in its record)
            return _forward(backend, engine, instance, d, progress, now, folded, _EMPTY, ids.size)
        return _forward(backend, engine, instance, d, progress, now, folded, ids, 0)
    if not ids.size:
        return None  # nothing runs: the engine's idle handling
    decoded = t.decoded[ids]
    remaining = t.output_len[ids] - decoded
    steps = max(int(d.steps), 1)
    k = min(steps, int(remaining.min())) if d.stop == "first_finish" else steps
    k = max(k, 1)
    if k > CELL_ITERATIONS:
        return None
    return _decode(backend, engine, instance, d, progress, now, folded, ids, decoded, remaining, steps, k)


def _decode(backend, engine, instance, d, progress, now, folded, ids, decoded, remaining, steps, K):
    """A decode run of K iterations: `apply_decision`'s reserve, `execute`'s scalar price, `record_outcome`."""
    state, t = backend.state, backend.state.table
    context = t.input_len[ids] + decoded
    state.reserve(ids, steps, context)  # pages for the next `steps` tokens
    state.reserve_host(instance, _EMPTY, _EMPTY)
    run = _Run(instance, "decode", d, _EMPTY, ids, steps)
    _kv_ops(state, engine.ledger, instance, d, state.instance_gpus(instance), {}, ids)  # the finishes' frees
    produced = np.minimum(remaining, K)
    cells = one_rank.decode_cells(context, produced, K, d.micro_batch)
    cost = price_cells(backend.lat, cells, None, backend.weight_stream_s, 0.0, backend.tbo, backend.comm_overlap)
    gate_total = sum(cells[2])
    backend.decode_iterations += int((cost.iteration_s > 0).sum())
    compute, boundary, duration, scale = backend.timing(cost, ids.size)
    finished = produced == remaining
    if finished.any():
        times = now + finish_offsets(cost, produced, finished, compute, boundary, duration, scale)[finished]
    backend.events += 1
    yield backend.env.timeout(duration)
    t.decoded[ids] += produced  # `ClusterState.advance`: no host copy to grow
    done = ids[finished]
    if done.size:
        state.finish(instance, done, times)
    _close(backend, engine, instance, d, progress, now, folded, run, duration, K, gate_total, ids.size, cost)


def _forward(backend, engine, instance, d, progress, now, folded, ids, waiting):
    """One forward of prompt chunks beside the decodes `ids`: `apply_decision`'s chunks and reserve, `execute`'s
    scalar price, `record_outcome`. `waiting`: running sequences that wait for it (a chunks-only forward's)."""
    state, t = backend.state, backend.state.table
    gpus = state.instance_gpus(instance)
    chunk = _take_chunks(state, instance, d, gpus)
    decoded = t.decoded[ids]
    context = t.input_len[ids] + decoded
    state.reserve(ids, 1, context)  # the page of the token each decode makes
    state.reserve_host(instance, _EMPTY, _EMPTY)
    chunk_ids, starts, lens, completes = (chunk["chunk_ids"], chunk["chunk_start"], chunk["chunk_len"],
                                          chunk["chunk_completes"])
    run = _Run(instance, "mixed" if ids.size else "prefill", d, chunk_ids, ids, 1)
    _kv_ops(state, engine.ledger, instance, d, gpus, chunk, ids)
    cells, heads = one_rank.mixed_cells(starts, lens, completes, context, d.micro_batch)
    cost = price_cells(backend.lat, cells, heads, backend.weight_stream_s, 0.0, backend.tbo, backend.comm_overlap)
    gate_total = cells[2][0]
    compute, boundary, duration, scale = backend.timing(cost, ids.size + chunk_ids.size)
    finished = t.output_len[ids] - decoded == 1
    if finished.any():
        one_each = filled(ids.size, 1, np.int64)
        times = now + finish_offsets(cost, one_each, finished, compute, boundary, duration, scale)[finished]
    chunk_finished = few_chunks_finished(t, chunk_ids, completes)
    backend.events += 1
    yield backend.env.timeout(duration)
    t.decoded[ids] += 1  # `ClusterState.advance`: no host copy to grow
    done = ids[finished]
    if done.size:
        state.finish(instance, done, times)
    at = now + duration
    for sid, first in zip(chunk_ids.tolist(), completes.tolist()):
        if first:  # the chunk ends its prompt: the first token (`advance` of one, and its time)
            t.decoded[sid] += 1
            if t.first_token_time[sid] != t.first_token_time[sid]:
                t.first_token_time[sid] = at
    ended = chunk_ids[chunk_finished]
    if ended.size:
        state.finish(instance, ended, np.full(ended.size, at))
    _close(backend, engine, instance, d, progress, now, folded, run, duration, 1, gate_total,
           ids.size + chunk_ids.size + waiting, cost)


def _close(backend, engine, instance, d, progress, start, folded, run, duration, K, gate_total, running, cost):
    """`record_outcome`'s end and `Engine.record`: the host reservation released, the run's step record."""
    backend.state.reserve_host(instance, _EMPTY, _EMPTY)
    expert = cost.expert_tokens
    engine.closed(instance, progress, StepRecord(
        instance, start, duration, run.phase, K, int(gate_total), running,
        float(expert[0] if expert.size == 1 else expert.sum()),
        int((expert > 0).sum()) if backend.lat.model.is_moe else 0, cost.rank_busy, cost.rank_comm + 0.0,
        DeferredDecision(d, run, folded), cost.modules))


_ZERO_RANK = np.zeros(1, np.int64)
