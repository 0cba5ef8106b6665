import dataclasses
import os

import numpy as np
import pytest

from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.policy.base import Decision, PolicyDefaults
from batchgen.specs import load_cluster, load_model
from batchgen.workload import Workload


def pytest_configure(config):
    """Under pytest-xdist (the README's `-n 2`) each worker shares the machine with the others: one intra-op thread
    per test process, and per process a test starts (they inherit it; backend.threads=auto reads it), so that N
    workers use N cores instead of fighting over them; and a master port of its own for the torchrun commands its
    tests start (torchrun's default, 29500, taken by two workers at once fails one). Runs before any test module
    imports torch."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("PET_MASTER_PORT", str(29510 + int(worker.removeprefix("gw"))))


def priced(state, instance=0):
    """The bytes the KV ops a test's primitives emitted since the instance's last boundary copy, per GPU and tier
    (the log is emptied: the next call sees only what came after)."""
    return state.take_ops(instance).moves(state.topo.num_gpus)


def make_job(policy="coroutine", model="tiny_moe", cluster="h100_8", inputs=None, outputs=None, n=50, seed=0,
             policy_overrides=None, cluster_overrides=None, **job_kwargs) -> Job:
    rng = np.random.default_rng(seed)
    inputs = rng.integers(16, 256, n) if inputs is None else np.asarray(inputs)
    outputs = rng.integers(1, 300, n) if outputs is None else np.asarray(outputs)
    c = load_cluster(cluster)
    if cluster_overrides:
        from dataclasses import replace
        c = replace(c, **cluster_overrides)
    job_kwargs.setdefault("check_invariants", True)
    return Job(model=load_model(model), cluster=c, workload=Workload("test", inputs, outputs),
               policy=make_policy({"name": policy, **(policy_overrides or {})}), **job_kwargs)


@pytest.fixture
def job_factory():
    return make_job


@dataclasses.dataclass
class Scripted(PolicyDefaults):
    """A policy that takes the decisions of `script`, one per boundary, then `then` at every boundary after."""

    script: list
    then: Decision = dataclasses.field(default_factory=lambda: Decision(steps=1))
    name: str = "scripted"
    uses_host_kv: bool = True
    can_stream_weights: bool = False
    calls: int = 0

    def decide(self, snap):
        self.calls += 1
        step = self.script[self.calls - 1] if self.calls <= len(self.script) else self.then
        return dataclasses.replace(step)
