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
from batchgen.policy.base import Admit, Capabilities, Decision, PolicyDefaults
from batchgen.sim.backend import SimBackend
from conftest import Scripted, make_job


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

    env, engine = sim_engine(ContinuousPolicy(max_running=256, token_budget=8192))
    for loop in engine.loops():
        env.process(loop)
    env.run()
    engine.finish()  # every sequence finished, the bookkeeping recounts
    assert engine.records and engine.liveness.live == set()


def test_a_way_of_running_the_backend_has_not_declared_is_refused():
    from batchgen.policy.sglang_opt import SGLangOptPolicy

    no_tbo = dataclasses.replace(Capabilities(), two_batch_overlap=False)
    with pytest.raises(ConfigError, match="two_batch_overlap=false"):
        sim_engine(SGLangOptPolicy(two_batch_overlap=True), capabilities=no_tbo)
    no_tp = dataclasses.replace(Capabilities(), attention_tp=False)
    with pytest.raises(ConfigError, match="attention_tp=1"):
        sim_engine(SGLangOptPolicy(token_budget=8192, attention_tp=2),
                   capabilities=no_tp)
    from batchgen.policy.offload.flexgen import FlexGenPolicy

    one_ffn = dataclasses.replace(Capabilities(), micro_batch_ffn=False)
    with pytest.raises(ConfigError, match="ffn_schedule=micro_batch"):
        sim_engine(FlexGenPolicy(), capabilities=one_ffn)


def yields_then_resumes() -> Scripted:
    """Prefills the four prompts onto GPUs 0 and 1, yields them all at a boundary that runs nothing, then resumes
    them on GPU 0 and decodes them to the end."""
    ids = np.arange(4)
    return Scripted([Decision(prefill_ids=ids, prefill_ranks=ids % 2, steps=1),
                     Decision(yield_ids=ids),  # nothing runs at this boundary
                     Decision(admits=[Admit(0, ids, np.zeros(4, np.int64))], steps=4, host_sync=True)],
                    then=Decision(steps=4, host_sync=True))


def test_copies_an_idle_boundary_starts_are_priced_with_the_next_run():
    """A YIELD at a boundary that runs nothing still moves the KV to host: the simulator prices those bytes with
    the instance's next run (they were free before)."""
    job = make_job("continuous", n=4, inputs=np.full(4, 30), outputs=np.full(4, 5),
                   cluster_overrides={"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": 2})
    prepared = prepare(dataclasses.replace(job, policy=yields_then_resumes()))
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


@pytest.mark.parametrize("policy", ["coroutine", "flexgen"])  # flexgen: runs merged by engine.repeat
def test_a_decode_run_ends_with_its_last_sequence(policy):
    """A run of a page of steps whose sequences all end sooner lasts as long as the longest of them, as the
    executors run it (they stop when every sequence has finished), not the page it was planned for."""
    from batchgen.sim.run import simulate

    out = simulate(make_job(policy, n=12, inputs=np.full(12, 40), outputs=np.arange(1, 13)), progress=False)
    decodes = [r.iterations for r in out.records if r.phase == "decode"]
    assert decodes and max(decodes) <= 12
