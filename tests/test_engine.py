"""The engine's own duties, whatever the backend: the deadlock check, and refusing what a backend has not
declared it can run."""

import dataclasses

import numpy as np
import pytest
import simpy

from batchgen.core.sequences import InvariantError
from batchgen.engine import Engine
from batchgen.job import prepare
from batchgen.memory import ConfigError
from batchgen.policy.base import Capabilities, Decision, PolicyDefaults
from batchgen.sim.backend import SimBackend
from conftest import make_job


class Stuck(PolicyDefaults):
    """Never runs anything, though prompts wait."""

    name = "stuck"

    def decide(self, snap):
        return Decision()


def sim_engine(policy, instances=2, capabilities=None):
    job = make_job("continuous", n=6, inputs=np.full(6, 30), outputs=np.full(6, 5),
                   cluster_overrides={"num_gpus": 2 * instances, "gpus_per_node": 2, "gpus_per_instance": 2})
    prepared = prepare(job)
    env = simpy.Environment()
    backend = SimBackend(env, prepared.state, prepared.latency, capabilities=capabilities)
    return env, Engine(policy, backend, gpus_per_node=2, check_invariants=True)


def test_every_instance_waiting_on_another_is_a_deadlock_named_after_the_policy():
    env, engine = sim_engine(Stuck())
    for loop in engine.loops():
        env.process(loop)
    with pytest.raises(InvariantError, match=r"policy 'stuck' made no progress on instances \[0, 1\]"):
        env.run()


def test_a_policy_that_finishes_ends_every_loop_and_the_engine_checks_the_outcome():
    from batchgen.policy.continuous import ContinuousPolicy

    env, engine = sim_engine(ContinuousPolicy())
    for loop in engine.loops():
        env.process(loop)
    env.run()
    engine.finish()  # every sequence finished, the bookkeeping recounts
    assert engine.records and engine.liveness.live == set()


def test_a_way_of_running_the_backend_has_not_declared_is_refused():
    from batchgen.policy.sglang_opt import SGLangOptPolicy

    no_tbo = dataclasses.replace(Capabilities(), two_batch_overlap=False)
    with pytest.raises(ConfigError, match="two_batch_overlap=false"):
        sim_engine(SGLangOptPolicy(), capabilities=no_tbo)
    no_tp = dataclasses.replace(Capabilities(), attention_tp=False)
    with pytest.raises(ConfigError, match="attention_tp=1"):
        sim_engine(dataclasses.replace(SGLangOptPolicy(), two_batch_overlap=False, attention_tp=2),
                   capabilities=no_tp)
    from batchgen.policy.offload.flexgen import FlexGenPolicy

    one_ffn = dataclasses.replace(Capabilities(), micro_batch_ffn=False)
    with pytest.raises(ConfigError, match="ffn_schedule=micro_batch"):
        sim_engine(FlexGenPolicy(), capabilities=one_ffn)


@dataclasses.dataclass
class YieldsThenResumes(PolicyDefaults):
    """Prefills every prompt onto GPUs 0 and 1, yields them all at a boundary that runs nothing, then resumes and
    decodes them to the end."""

    name: str = "yields-then-resumes"
    uses_host_kv: bool = True
    can_stream_weights: bool = False
    calls: int = 0

    def decide(self, snap):
        from batchgen.policy.base import Admit

        self.calls += 1
        if self.calls == 1:
            n = len(snap.pending)
            return Decision(prefill_ids=snap.pending.peek(n), prefill_ranks=np.arange(n) % 2, steps=1)
        if self.calls == 2:
            return Decision(yield_ids=snap.active_ids.copy())  # nothing runs at this boundary
        admits = [Admit(node, snap.suspended[node].peek(len(snap.suspended[node])),
                        np.zeros(len(snap.suspended[node]), np.int64))
                  for node in range(len(snap.suspended)) if len(snap.suspended[node])]
        return Decision(admits=admits, steps=4, host_sync=True)


def test_copies_an_idle_boundary_starts_are_priced_with_the_next_run():
    """A YIELD at a boundary that runs nothing still moves the KV to host: the simulator prices those bytes with
    the instance's next run (they were free before)."""
    job = make_job("continuous", n=4, inputs=np.full(4, 30), outputs=np.full(4, 5),
                   cluster_overrides={"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": 2})
    prepared = prepare(dataclasses.replace(job, policy=YieldsThenResumes()))
    env = simpy.Environment()
    backend = SimBackend(env, prepared.state, prepared.latency)
    plans = []
    engine = Engine(prepared.policy or job.policy, backend, gpus_per_node=2, check_invariants=True,
                    on_step=lambda plan, result: plans.append(plan))
    for loop in engine.loops():
        env.process(loop)
    env.run()
    engine.finish()
    kv = prepared.state.kv_bytes_per_token
    resumed = plans[1]
    assert resumed.moves.d2h[:2].tolist() == [2 * 30 * kv, 2 * 30 * kv]  # the yields: prompt KV of two each
    assert resumed.moves.h2d[0] == 4 * 30 * kv  # the resumes, all onto GPU 0
