"""Run a job on the simulated cluster: one SimPy process per expert-parallel instance."""

from __future__ import annotations

import time
from dataclasses import dataclass

import simpy

from batchgen.core.sequences import InvariantError
from batchgen.engine import StepObserver, StepRecord, instance_loop
from batchgen.job import Job, Prepared, prepare
from batchgen.policy.base import Capabilities
from batchgen.sim.backend import SimBackend


@dataclass
class RunOutput:
    job: Job
    prepared: Prepared
    records: list[StepRecord]
    wall_s: float
    events: int
    backend: str = "sim"
    host_bytes: float = 0.0                # bytes moved host <-> device over the whole run, both directions
    host_bytes_per_iteration: float = 0.0  # decode runs' host <-> device bytes per decode iteration


def simulate(job: Job, *, capabilities: Capabilities | None = None,
             kv_pages_per_gpu: int | None = None, on_step: StepObserver | None = None) -> RunOutput:
    """`capabilities` and `kv_pages_per_gpu`: another backend's (the executor's), so that the policy sees the
    same snapshots there and here and takes the same decisions (validation); None: the simulator's own.
    Each step record carries its seconds per module (attention, ffn, head), as the executor's do."""
    start = time.perf_counter()
    prepared = prepare(job, kv_pages_per_gpu=kv_pages_per_gpu)
    state, lat = prepared.state, prepared.latency
    env = simpy.Environment()
    backend = SimBackend(env, state, lat, stream_bytes_per_iter=prepared.budget.streamed_bytes_per_iter,
                         capabilities=capabilities)
    records: list[StepRecord] = []
    policy = getattr(prepared, "policy", None) or job.policy  # "auto" knobs resolved by the planner
    for inst in range(state.topo.num_instances):
        env.process(instance_loop(policy, backend, inst, records, gpus_per_node=prepared.cluster.node_size,
                                  check_invariants=job.check_invariants, on_step=on_step))
    env.run()
    if not state.all_finished():
        left = len(state.table) - state.num_finished
        raise InvariantError(f"policy {policy.name!r} stopped with {left} sequences unfinished")
    state.check()
    return RunOutput(job, prepared, records, time.perf_counter() - start, backend.events,
                     host_bytes=backend.host_bytes, host_bytes_per_iteration=backend.host_bytes_per_iteration)
