"""Run a job on the simulated cluster: one SimPy process per expert-parallel instance."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Iterator

import simpy

from batchgen.engine import Engine, RunOutput, StepObserver  # noqa: F401 (RunOutput: re-exported)
from batchgen.job import Job, prefill_as_performed, prepare
from batchgen.policy.base import Capabilities
from batchgen.progress import Throttle, bar
from batchgen.sim.backend import SimBackend


class SimProgress:
    """Sequences finished / total and the simulated clock (batchgen.progress), read from the state after every
    run (`Engine.watch`, on every path); the bar is touched at most twice a second."""

    def __init__(self, env: simpy.Environment, state, total: int, desc: str, setting="auto"):
        self.env, self.state, self.throttle = env, state, Throttle()
        self.bar = bar(total, desc, unit="seq", setting=setting)

    def __call__(self) -> None:
        if self.throttle.due():
            self.show()

    def show(self) -> None:
        self.bar.set_postfix_str(f"simulated {self.env.now:,.1f} s", refresh=False)
        self.bar.update(self.state.num_finished - self.bar.n)

    def close(self) -> None:
        self.show()
        self.bar.close()


@contextmanager
def rare_collections(young: int = 100_000) -> Iterator[None]:
    """Python's cycle collector run less often while the block runs. A simulated boundary allocates a few dozen
    short-lived containers (decisions, records, dicts of seconds), so at the default threshold (700) the collector
    ran every few boundaries (benchmarks/results/code_figures.md); the run makes few cycles, and those are still
    collected, only in larger batches. The thresholds are restored after."""
    before = gc.get_threshold()
    gc.set_threshold(max(young, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def simulate(job: Job, *, capabilities: Capabilities | None = None,
             kv_pages_per_gpu: int | None = None, on_step: StepObserver | None = None,
             progress="auto", overlap_copies: bool = True) -> RunOutput:
    """`capabilities` and `kv_pages_per_gpu`: another backend's (the executor's), so that the policy sees the
    same snapshots there and here and takes the same decisions (validation); None: the simulator's own.
    Each step record carries its seconds per module (attention, ffn, head), as the executor's do.
    `progress`: a bar of sequences finished on stderr: auto (a terminal, or BATCHGEN_PROGRESS), True, False.
    `overlap_copies` false: the KV each run copies is paid after its compute (conf backend=sim's setting)."""
    start = time.perf_counter()
    if capabilities is not None:
        job = prefill_as_performed(job, capabilities.dp_prefill)
    prepared = prepare(job, kv_pages_per_gpu=kv_pages_per_gpu,
                       host_prefixes=capabilities is None or capabilities.host_prefixes,
                       prefix_fetch=capabilities is None or capabilities.prefix_fetch,
                       resume_prefix=capabilities is None or capabilities.resume_prefix)
    state, lat = prepared.state, prepared.latency
    env = simpy.Environment()
    policy = prepared.policy or job.policy  # "auto" knobs resolved by the planner
    backend = SimBackend(env, state, lat, stream_bytes_per_iter=prepared.budget.streamed_bytes_per_iter,
                         capabilities=capabilities, two_batch_overlap=policy.two_batch_overlap,
                         comm_overlap=policy.comm_overlap, dp_prefill=policy.prefill_parallel == "dp",
                         overlap_copies=overlap_copies)
    shown = SimProgress(env, state, len(job.workload), f"simulate {policy.name}", progress)
    engine = Engine(policy, backend, gpus_per_node=prepared.cluster.node_size,
                    check_invariants=job.check_invariants, on_step=on_step,
                    watch=None if shown.bar.disable else shown)
    for loop in engine.loops():
        env.process(loop)
    try:
        with rare_collections():
            env.run()
    finally:
        shown.close()
    engine.finish()
    return RunOutput(job, prepared, engine.records, time.perf_counter() - start, backend.events,
                     host_bytes=backend.host_bytes, host_bytes_per_iteration=backend.host_bytes_per_iteration,
                     h2d_bytes=backend.h2d_bytes)
