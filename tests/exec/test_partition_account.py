"""PARTITION priced as performed, on real tensors, for every way a group changes: a scripted sequence of decisions
splits sequences (within a node, across nodes, wrapping), moves a partitioned group to another lead and changes
its degree in one boundary, changes a degree, joins a group back to one GPU, yields partitioned sequences with and
without a host copy, and evicts one; for GQA (head shards) and MLA (latent replicas). Per boundary and GPU, the KV the executor copied (its reshards device to
device, the host copies its leads bring up to date) is what the state priced (`StepPlan.moves`) plus the
simulator's host_sync price of the run (`synced_bytes`, `synced_gather_bytes`); and the outputs equal an undisturbed
run's, token for token."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.exec import backend as exec_backend
from batchgen.exec.run import ExecSettings, execute
from batchgen.policy.base import Admit, Decision
from batchgen.sim.backend import synced_bytes, synced_gather_bytes
from batchgen.specs import load_model
from conftest import make_job

from .test_kv_account import P, TIERS, ids, scripted

SYNC = dict(steps=2, host_sync=True)
# One instance of 4 GPUs over 2 nodes (GPUs 0, 1 on node 0; 2, 3 on node 1); a model with 4 KV heads or an MLA latent
# and 4 query heads (degrees 1, 2, 4). Boundary by boundary:
SCRIPT = [
    Decision(prefill_ids=ids(*range(8)), prefill_ranks=ids(0, 0, 1, 1, 2, 2, 3, 3), steps=1),
    # YIELD 2 and 6: host copies on nodes 0 and 1
    Decision(yield_ids=ids(2, 6), steps=1, host_sync=True),
    # COMBINE them back (their host copies kept); split 0 over GPUs 0, 1 (one node), 2 over 1, 2 (across nodes),
    # 6 over 3, 0 (wrapping, across nodes), 4 over 2, 3
    Decision(admits=[Admit(0, ids(2), ids(1)), Admit(1, ids(6), ids(3))], partition_ids=ids(0, 2, 6, 4),
             partition_degree=ids(2, 2, 2, 2), **SYNC),
    # MIGRATE partitioned 0 to GPU 2 and split it over 4 there; 2 from 2 to 4 GPUs at its lead
    Decision(move_ids=ids(0), move_ranks=ids(2), partition_ids=ids(0, 2), partition_degree=ids(4, 4), **SYNC),
    # 0 from 4 back to 2 GPUs; 2 joined back to its lead's pages
    Decision(partition_ids=ids(0, 2), partition_degree=ids(2, 1), **SYNC),
    # YIELD partitioned 0 (no host copy: its lead gathers the shards and writes the KV down) and 6 (its host copy is
    # up to date: nothing moves); evict partitioned 4
    Decision(yield_ids=ids(0, 6), evict_ids=ids(4), steps=1, host_sync=True),
    Decision(admits=[Admit(1, ids(0), ids(2)), Admit(1, ids(6), ids(3))], prefill_ids=ids(4), prefill_ranks=ids(2),
             steps=1, host_sync=True),
]


def tiny_model(attention: str):
    """tiny_moe with 4 KV heads (GQA: 8 KiB of KV per token in fp32), or a tiny DeepSeek-V3 (MLA: a latent of
    16 + 8 per layer, 288 B per token)."""
    if attention == "gqa":
        return dataclasses.replace(load_model("tiny_moe"), num_kv_heads=4)
    return dataclasses.replace(
        load_model("deepseek_v3"), name="tiny_mla", num_layers=3, hidden_size=64, vocab_size=2048, max_context=4096,
        num_heads=4, num_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate_size=96, num_experts=8, num_shared_experts=1, top_k=2, moe_intermediate_size=32,
        first_dense_layers=1, weight_bytes=4.0, kv_bytes=4.0, act_bytes=4.0)


def run(script, monkeypatch, attention="gqa"):
    job = make_job("continuous", n=8, inputs=np.arange(8) % 5 + 11, outputs=np.full(8, 28), page_tokens=P,
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4})
    job = dataclasses.replace(job, model=tiny_model(attention), policy=scripted(script))
    steps = []
    execute_plan = exec_backend.ExecBackend.execute

    def recording(self, plan):
        before = self.account.copy()
        result = yield from execute_plan(self, plan)
        gather = synced_gather_bytes(self.state, plan, result.produced, result.finished)
        steps.append({"plan": plan, "performed": self.account.minus(before),
                      "synced": (synced_bytes(self.state, plan, result.produced, result.finished), *gather)})
        return result

    monkeypatch.setattr(exec_backend.ExecBackend, "execute", recording)
    settings = ExecSettings(device="cpu", dtype="float32", threads=1, kv_budget_mb=4)
    return job, execute(job, settings), steps, settings


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_every_reshard_and_host_copy_of_a_partition_is_priced_as_performed(monkeypatch, attention):
    job, out, steps, settings = run(SCRIPT, monkeypatch, attention)
    state = out.prepared.state
    # what the executor's caches hold per token: 4 layers x K, V x 4 heads x 64 x fp32; 3 layers x (16 + 8) x fp32
    assert state.kv_bytes_per_token == (8192 if attention == "gqa" else 288)
    G = state.topo.num_gpus
    kinds = set()
    for b, step in enumerate(steps):
        plan, acc = step["plan"], step["performed"]
        want = {t: np.asarray(getattr(plan.moves, t), float).copy() for t in TIERS}
        d2h, peer, network = step["synced"]
        want["d2h"][plan.gpus] += d2h
        want["peer"][plan.gpus] += peer
        want["network"][plan.gpus] += network
        got = {t: sum((acc.of(k)[t] for k in acc.kinds()), np.zeros(G)).astype(float) for t in TIERS}
        for t in TIERS:
            assert np.array_equal(got[t], want[t]), (b, t, got, want, acc.as_dict())
        assert not any(acc.of(k)["host"].any() for k in acc.kinds()), b
        kinds |= set(acc.kinds())
    # every kind of partition move happened: reshards over both tiers, a yield's gather and host_sync's (GQA; an
    # MLA lead holds the whole latent: it gathers nothing)
    assert ({"reshard", "join", "sync"} if attention == "gqa" else {"reshard", "sync"}) <= kinds
    assert ("join" in kinds) == (attention == "gqa")
    t = state.table
    assert t.partitions[[0, 2, 4, 6]].tolist() == [3, 3, 1, 1]
    # token for token what an undisturbed run generates
    calm = execute(dataclasses.replace(job, policy=make_job("continuous").policy), settings)
    assert [list(g) for g in out.tokens.generated] == [list(g) for g in calm.tokens.generated]
