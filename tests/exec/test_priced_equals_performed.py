"""One account of every move, for every policy: a job runs on the executor, and the KV bytes it copied (per GPU and
tier, measured from the tensors: `ExecOutput.kv_account`) equal what the simulator prices for the same decisions:
each run's KV ops' bytes (`StepPlan.moves`, with those of idle boundaries before it), its prompts prefilled to
host (`batchgen.sim.backend.prefill_to_host_bytes`) and its host_sync checkpoints (`synced_bytes`, with the
shards a partitioned sequence's lead gathers for them: `synced_gather_bytes`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.exec import backend as exec_backend
from batchgen.exec.run import ExecSettings, execute
from batchgen.sim.backend import prefill_to_host_bytes, synced_bytes, synced_gather_bytes
from batchgen.workload.spec import Workload
from conftest import make_job

TIERS = ("h2d", "d2h", "peer", "network", "local")

# (policy, its knobs, cluster overrides): every policy, on instances of 1 and 4 GPUs over 2 nodes, with a KV pool
# small enough that yields, offloads and host-resident decode happen
CASES = {
    "coroutine-device": ("coroutine", {"kv_residency": "device", "b_attn": 4, "b_moe": 8}, {}),
    "coroutine-mixed": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8, "attention": "cpu"}, {}),
    "coroutine-4-gpus": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8},
                         {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4}),
    "coroutine-partition": ("coroutine", {"b_moe": 4, "b_attn": 4, "kv_residency": "device",
                                          "partition_min_context": 1, "partition_below": 1.0},
                            {"num_gpus": 4, "gpus_per_node": 4, "gpus_per_instance": 4}),
    "coroutine-yield": ("coroutine", {"kv_residency": "device", "b_attn": 16, "b_moe": 16}, {}),
    "continuous": ("continuous", {}, {}),
    "sglang_opt": ("sglang_opt", {"two_batch_overlap": False}, {}),
    "static": ("static", {}, {}),
    "flexgen": ("flexgen", {}, {}),
    "moe_lightning": ("moe_lightning", {"micro_batch_size": 4, "num_micro_batches": 2}, {}),
    "zero_inference": ("zero_inference", {}, {}),
    "pd_disagg": ("pd_disagg", {"prefill_units": 1, "decode_units": 1, "unit_gpus": 1},
                  {"num_gpus": 2, "gpus_per_node": 2}),
    # groups of 4 prompts sharing their first 24 tokens: prefixes shared on device and in each node's host memory
    "coroutine-shared": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8},
                         {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4}),
    # ... sharing 28: the last 4 shared tokens of a prefix copied below a page, in the forward that writes them and
    # later from the page the prefix keeps
    "coroutine-shared-tail": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8},
                              {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4}),
    "continuous-shared-tail": ("continuous", {"prefix_tail": True, "token_budget": 64}, {}),
    # ... groups interleaved over the queue and prefills of a few prompts per rank: a rank that lacks a group's
    # prefix copies it from another's (core.prefix_fetch), over NVLink or across nodes
    "coroutine-shared-fetch": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8,
                                             "prefill_tokens_per_rank": 100},
                               {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4}),
    # ... on 2 GPUs with a small pool: yielded members resume onto the GPU that did not write their host copy, and
    # take their group's prefix there (core.prefix_pages.attach_restored), restoring the rest
    "coroutine-shared-resume": ("coroutine", {"kv_residency": "device", "b_attn": 4, "b_moe": 8},
                                {"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": 2}),
    # ... two system prompts of 20 tokens, each before two groups of prompts sharing 36 (nested levels: an outer
    # one written, taken and copied once, each inner one past it)
    "coroutine-shared-nested": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8,
                                              "prefill_tokens_per_rank": 100},
                                {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4}),
    "continuous-shared-nested": ("continuous", {"prefix_tail": True, "token_budget": 64}, {}),
}
SHARED = {"coroutine-shared": 24, "coroutine-shared-tail": 28, "continuous-shared-tail": 28,
          "coroutine-shared-fetch": 28, "coroutine-shared-resume": 24, "coroutine-shared-nested": 36,
          "continuous-shared-nested": 36}


def priced_and_performed(name, monkeypatch):
    policy, knobs, cluster = CASES[name]
    rng = np.random.default_rng(5)
    n = 16
    outputs = rng.integers(4, 60, n)
    outputs[:2] = 120  # two stragglers
    job = make_job(policy, "tiny_moe", "h100_8", rng.integers(20, 90, n), outputs, page_tokens=8,
                   policy_overrides=knobs, cluster_overrides={"num_gpus": 1, "gpus_per_node": 1,
                                                              "gpus_per_instance": None, **cluster})
    if name in SHARED:
        from batchgen.workload.prefix_tree import PrefixTree

        w, nested = job.workload, name.endswith("-nested")
        group = np.arange(n) % 4 if "fetch" in name or nested else np.arange(n) // 4
        tree = PrefixTree([-1, -1, 0, 1, 0, 1], [20, 20] + [SHARED[name]] * 4) if nested else None
        job = dataclasses.replace(job, workload=Workload(w.name, w.input_lens + SHARED[name], w.output_lens,
                                                         prefix_group=group + 2 * nested,
                                                         prefix_len=np.full(n, SHARED[name]), prefix_tree=tree))
    plans, synced = [], []
    execute_plan = exec_backend.ExecBackend.execute

    def executing(self, plan):
        plans.append(plan)
        result = yield from execute_plan(self, plan)  # priced as the simulator does, before the outcome is folded in
        synced.append((plan.gpus, synced_bytes(self.state, plan, result.produced, result.finished)
                       + prefill_to_host_bytes(self.state, plan),
                       *synced_gather_bytes(self.state, plan, result.produced, result.finished)))
        return result

    monkeypatch.setattr(exec_backend.ExecBackend, "execute", executing)
    out = execute(job, ExecSettings(device="cpu", dtype="float32", threads=1, kv_budget_mb=2))
    state = out.prepared.state
    G = state.topo.num_gpus
    priced = {t: np.zeros(G) for t in TIERS}
    for plan in plans:
        for t in TIERS:
            priced[t] += getattr(plan.moves, t)
    for gpus, d2h, peer, network in synced:
        priced["d2h"][gpus] += d2h
        priced["peer"][gpus] += peer
        priced["network"][gpus] += network
    acc = out.kv_account
    performed = {t: sum((acc.of(k)[t] for k in acc.kinds()), np.zeros(G)).astype(float) for t in TIERS}
    return priced, performed, out, acc, plans


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_byte_the_executor_copied_is_priced(name, monkeypatch):
    priced, performed, out, acc, plans = priced_and_performed(name, monkeypatch)
    for t in TIERS:
        assert np.array_equal(performed[t], priced[t]), (name, t, performed, priced, acc.as_dict())
    assert not any(acc.of(k)["host"].any() for k in acc.kinds())  # no copy the simulator has no price for
    if name.startswith("coroutine-shared"):  # host copies took their node's prefix, and wrote only the rest
        assert out.prepared.state.host_sharing and out.prepared.state.host_prefix_taken > 0
    if name.endswith("-nested"):  # inner levels created over the outer one (their share ops name it)
        assert any((p.ops.share_parent >= 0).any() for p in plans if p.ops is not None)
    if name.endswith("-tail"):  # tails copied on the GPU, priced as copied
        assert performed["local"].sum() > 0
    if name.endswith("-resume"):
        assert out.prepared.state.prefix_resumed > 0
    if name.endswith("-fetch"):  # prefixes copied from another GPU, priced as copied
        assert out.prepared.state.prefix_fetched > 0 and acc.of("share")["peer"].sum() + acc.of("share")["network"].sum()
