"""One account of every move, checked on real tensors: a scripted sequence of decisions (migrations of every kind
the state prices, and yields) runs through the engine on the executor, and the KV the executor copied, per GPU and
tier, is what the state priced for the same decisions (`StepPlan.moves`); after every boundary's KV ops each
sequence has a host copy in its cache exactly when the state counts one; and the outputs equal an undisturbed
run's, token for token.

The state prices a copy by the tokens whose KV exists (prompt and generated, but the newest generated token's, which
the next forward writes): to the byte what the executor copies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.exec import backend as exec_backend
from batchgen.exec.run import ExecSettings, execute
from batchgen.policy.base import Admit, Decision
from conftest import Scripted, make_job

I = np.int64
P = 8  # page tokens
TIERS = ("h2d", "d2h", "peer", "network")  # the state's tiers (`Moves`)


def ids(*xs):
    return np.array(xs, I)


# One expert-parallel instance of 4 GPUs over 2 nodes: GPUs 0, 1 on node 0; 2, 3 on node 1. Boundary by boundary:
SCRIPT = [
    # prompts on their GPUs' device pages (no host copy anywhere)
    Decision(prefill_ids=ids(*range(8)), prefill_ranks=ids(0, 0, 1, 1, 2, 2, 3, 3), steps=1),
    # MIGRATE device-resident sequences without host copies: 0 to the peer GPU of its node, 2 to the other node
    Decision(move_ids=ids(0, 2), move_ranks=ids(1, 3), steps=2),
    # YIELD three (host copies on nodes 0, 0, 1)
    Decision(yield_ids=ids(1, 3, 5), steps=1),
    # COMBINE elsewhere: 1 onto node 0's other GPU (host -> device, its host copy kept); 3 onto node 1 without its
    # host copy (PD-disaggregation's way); 5 host-resident onto node 0 (its host copy crosses the network)
    Decision(admits=[Admit(0, ids(1), ids(1)), Admit(0, ids(3), ids(2), keep_host_copy=False),
                     Admit(1, ids(5), ids(0), host_resident=True)], steps=2, cpu_attention=True, host_sync=True),
    # MIGRATE within node 0: 1 device-resident with its host copy, 5 host-resident (its copy stays on the node)
    Decision(move_ids=ids(1, 5), move_ranks=ids(0, 1), steps=2, cpu_attention=True, host_sync=True),
]


THEN = Decision(steps=P, cpu_attention=True, host_sync=True)  # after the script: decode everything to the end


def scripted(script):
    """The decisions of `script`, then decodes of every running sequence to the end."""
    return Scripted(script, THEN)


def run_scripted(script, monkeypatch, n=8, outputs=24):
    """The job under `script` on the executor, with every step's plan, the bytes the executor copied during it
    (per kind of op), and where the caches kept host copies after its KV ops."""
    job = make_job("continuous", n=n, inputs=np.arange(n) % 5 + 11, outputs=np.full(n, outputs), page_tokens=P,
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4})
    job = dataclasses.replace(job, policy=scripted(script))
    steps = []
    execute_plan, move_kv = exec_backend.ExecBackend.execute, exec_backend.ExecBackend.move_kv

    def moving(self, ops):
        move_kv(self, ops)
        t = self.state.table
        copies = {}
        for g, cache in enumerate(self.caches):
            for sid in cache.seq_ids():
                copies[sid] = cache.synced_tokens(sid) > 0
        steps[-1]["host_copy"] = copies
        steps[-1]["state_host_copy"] = {sid: bool(t.host_node[sid] >= 0) for sid in copies}

    def recording(self, plan):
        steps.append({"plan": plan})
        before = self.account.copy()
        result = yield from execute_plan(self, plan)
        steps[-1]["performed"] = self.account.minus(before)
        return result

    monkeypatch.setattr(exec_backend.ExecBackend, "execute", recording)
    monkeypatch.setattr(exec_backend.ExecBackend, "move_kv", moving)
    out = execute(job, ExecSettings(device="cpu", dtype="float32", threads=1, kv_budget_mb=4))
    return job, out, steps


def priced(plan) -> dict[str, np.ndarray]:
    return {tier: np.asarray(getattr(plan.moves, tier), float) for tier in TIERS}


# every copy the state's primitives cause (`Moves`); not sync: the simulator prices host_sync's checkpoints from the
# tokens a run produced, outside them
PRICED_KINDS = ("yield", "offload", "migrate", "migrate_host_copy", "restore", "reshard", "reshard_host_copy", "join",
                "to_host")


def performed(step, kinds=PRICED_KINDS) -> dict[str, np.ndarray]:
    """Bytes the executor copied during a step, per tier and GPU."""
    acc = step["performed"]
    return {tier: sum((acc.of(k)[tier] for k in kinds), np.zeros(4)).astype(float) for tier in TIERS}


@pytest.mark.usefixtures("one_thread")
def test_executor_performs_exactly_the_bytes_the_state_priced(monkeypatch):
    job, out, steps = run_scripted(SCRIPT, monkeypatch)
    assert len(steps) > len(SCRIPT)
    state = out.prepared.state
    kv = state.kv_bytes_per_token
    assert kv == 4096  # tiny_moe in fp32: the executor's caches hold the same bytes per token
    for b, step in enumerate(steps):
        want, got = priced(step["plan"]), performed(step)
        for tier in TIERS:
            assert np.array_equal(got[tier], want[tier]), (b, tier, got, want)
        assert step["host_copy"] == step["state_host_copy"], b  # a host copy exactly where the state counts one
        assert not step["performed"].of("migrate")["host"].any(), b  # no copy between host pools of one node
        assert "migrate_host_copy" not in step["performed"].kinds(), b  # no host copy made again
    # the migrations moved what the state priced for them, tier by tier (their boundaries move nothing else)
    for b in (1, 3, 4):
        want, got = priced(steps[b]["plan"]), performed(steps[b], ["migrate"])
        assert all(np.array_equal(got[t], want[t]) for t in TIERS), (b, got, want)
    mig = steps[1]["performed"].of("migrate")  # contexts of 11 + 1 and 13 + 1 tokens, whose KV holds 11 and 13
    assert mig["peer"][1] == 11 * kv and mig["network"][3] == 13 * kv  # device pages to device pages
    assert not mig["d2h"].any() and not mig["h2d"].any()  # never through host memory
    assert steps[3]["performed"].of("migrate")["h2d"][1] == (12 + 2) * kv  # 1 from node 0's host copy
    assert steps[4]["performed"].of("migrate")["peer"][0] == (12 + 4) * kv and priced(steps[4]["plan"])["peer"][0]
    assert out.kv_moves["migrate"] == 7
    # token for token what an undisturbed run (no migrations, no yields) generates
    calm = execute(dataclasses.replace(job, policy=make_job("continuous").policy),
                   ExecSettings(device="cpu", dtype="float32", threads=1, kv_budget_mb=4))
    assert [list(g) for g in out.tokens.generated] == [list(g) for g in calm.tokens.generated]


@pytest.mark.usefixtures("one_thread")
def test_a_move_across_nodes_with_a_host_copy_is_priced_as_performed(monkeypatch):
    """The KV crosses the network into the destination's device pages, and the host copy the state keeps counting
    is written there again from them (device -> host): both copies priced."""
    script = SCRIPT[:4] + [Decision(move_ids=ids(1), move_ranks=ids(3), steps=2, cpu_attention=True, host_sync=True)]
    _, _, steps = run_scripted(script, monkeypatch)
    want, got = priced(steps[4]["plan"]), performed(steps[4])
    assert want["network"][3] and want["d2h"][3] == want["network"][3]
    assert all(np.array_equal(got[t], want[t]) for t in TIERS), (got, want)


@pytest.mark.usefixtures("one_thread")
def test_a_resume_on_another_node_that_keeps_its_host_copy_is_priced_as_performed(monkeypatch):
    """COMBINE across nodes, device-resident, host copy kept: the KV crosses the network into device pages, and the
    host copy is written again on the new node (device -> host)."""
    resume = Decision(admits=[Admit(0, ids(1, 3), ids(2, 3)), Admit(1, ids(5), ids(0), host_resident=True)],
                      steps=2, cpu_attention=True, host_sync=True)
    script = SCRIPT[:3] + [resume]
    _, _, steps = run_scripted(script, monkeypatch)
    want, got = priced(steps[3]["plan"]), performed(steps[3])
    assert want["network"][2]
    assert all(np.array_equal(got[t], want[t]) for t in TIERS), (got, want)
