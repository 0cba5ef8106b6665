"""Run a job on the simulated cluster: one SimPy process per expert-parallel instance."""

from __future__ import annotations

import time
from dataclasses import dataclass

import simpy

from batchgen.core.sequences import InvariantError
from batchgen.engine import StepRecord, instance_loop
from batchgen.job import Job, Prepared, prepare
from batchgen.sim.backend import SimBackend


@dataclass
class RunOutput:
    job: Job
    prepared: Prepared
    records: list[StepRecord]
    wall_s: float
    events: int
    backend: str = "sim"


def simulate(job: Job) -> RunOutput:
    start = time.perf_counter()
    prepared = prepare(job)
    state, lat = prepared.state, prepared.latency
    stream = prepared.budget.streamed_bytes_per_iter
    env = simpy.Environment()
    backend = SimBackend(env, state, lat, weight_stream_s=float(lat.h2d(stream)) if stream else 0.0)
    records: list[StepRecord] = []
    for inst in range(state.topo.num_instances):
        env.process(instance_loop(job.policy, backend, inst, records, gpus_per_node=prepared.cluster.node_size,
                                  check_invariants=job.check_invariants))
    env.run()
    if not state.all_finished():
        left = len(state.table) - state.num_finished
        raise InvariantError(f"policy {job.policy.name!r} stopped with {left} sequences unfinished")
    state.check()
    return RunOutput(job, prepared, records, time.perf_counter() - start, backend.events)
