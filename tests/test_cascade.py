"""Cascade attention in the engine and the simulator (batchgen.core.cascade): who cascades, what the decode queries
read, and that the simulator prices the reads the engine accounts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchgen.core.cascade import CascadeRule, decode_reads
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.latency.build import LatencySettings, build_latency
from batchgen.pricing.costs import cascade_load, cascade_pays
from batchgen.results.metrics import summarize
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from batchgen.workload import Workload

NONE = np.empty(0, np.int64)


def test_groups_cascade_two_or_more_holders_on_a_rank_where_it_pays():
    rank = np.array([0, 0, 0, 1, 1, 1])
    group = np.array([3, 3, 4, 3, 3, 3])
    held = np.array([512, 512, 512, 512, 512, 0])
    context = held + 100
    eligible = np.array([True, True, True, True, False, True])  # rank 1's second holder is host-resident
    rule = CascadeRule("groups")
    np.testing.assert_array_equal(rule.groups(rank, group, held, context, eligible, 0, NONE, NONE),
                                  [3, 3, -1, -1, -1, -1])
    asked = []
    never = CascadeRule("groups", pays=lambda *a: asked.append(a) or np.zeros(a[2].size, bool))
    assert (never.groups(rank, group, held, context, eligible, 4, NONE, NONE) == -1).all()
    # the one candidate: rank 0's two holders of group 3, among its three device queries over 1,836 tokens
    (queries, summed, members, prefix, mb), = asked
    assert (queries, summed, members.tolist(), prefix.tolist(), mb) == (3, 1836.0, [2.0], [512.0], 4)
    assert (CascadeRule("off").groups(rank, group, held, context, eligible, 0, NONE, NONE) == -1).all()


def test_the_priced_test_takes_memory_bound_cascades_and_leaves_compute_bound_ones():
    """On the roofline a cascade pays where the prefix's reads it saves outweigh its extra calls: many members over
    a long prefix of Qwen3's GQA cache, not two members over a short one, nor many small groups that split a rank's
    calls (B_attn 64), nor DeepSeek-R1's MLA (its decode attention is bound by its scores, not its small latent)."""
    qwen = cascade_pays(build_latency(LatencySettings(), load_model("qwen3_30b_a3b"), load_cluster("h100_8").gpu))
    n, prefix = np.array([64.0, 2.0]), np.array([4096.0, 64.0])
    np.testing.assert_array_equal(qwen(66, float(n @ (prefix + 200)), n, prefix, 0), [True, False])
    split = qwen(256, 256 * 400.0, np.full(32, 8.0), np.full(32, 64.0), 64)
    assert not split.any()
    r1 = cascade_pays(build_latency(LatencySettings(), load_model("deepseek_r1"), load_cluster("h20_16").gpu))
    assert not r1(64, 64 * 4296.0, n[:1], prefix[:1], 0).any()


def test_batch_follows_vllms_rule_the_whole_forward_shares_one_long_prefix():
    n = 40
    rank, group, held = np.zeros(n, np.int64), np.full(n, 7), np.full(n, 4096)
    yes = np.ones(n, bool)
    gqa = CascadeRule("batch", heads=32, kv_heads=4, sm_count=132)
    assert (gqa.groups(rank, group, held, held, yes, 0, NONE, NONE) == 7).all()
    # a prompt chunk in the forward that holds the prefix too: still one cascade; one that does not: none
    assert (gqa.groups(rank, group, held, held, yes, 0, np.array([0]), np.array([7])) == 7).all()
    assert (gqa.groups(rank, group, held, held, yes, 0, np.array([0]), np.array([-1])) == -1).all()
    short, few = np.full(n, 192), slice(0, 7)
    assert (gqa.groups(rank, group, short, short, yes, 0, NONE, NONE) == -1).all()  # under 256 tokens
    assert (gqa.groups(rank[few], group[few], held[few], held[few], yes[few], 0, NONE,
                       NONE) == -1).all()  # under 8 requests
    mixed = group.copy()
    mixed[0] = 8
    assert (gqa.groups(rank, mixed, held, held, yes, 0, NONE, NONE) == -1).all()  # two prefixes in the forward
    assert (CascadeRule("batch", heads=128, kv_heads=128, mla=True).groups(rank, group, held, held, yes, 0, NONE,
                                                                           NONE) == -1).all()
    # decodes only: the wave model prefers flash decoding for few requests (8 x 4 KV heads fill few SMs)
    eight = slice(0, 8)
    assert (gqa.groups(rank[eight], group[eight], held[eight], held[eight], yes[eight], 0, NONE,
                       NONE) == -1).all()


def _reads_by_iteration(context, produced, rank, group, shared, micro_batch):
    """decode_reads spelt out: every iteration, every query over its context, each cascade's calls their prefix."""
    total = prefix = 0
    for k in range(int(produced.max())):
        alive = produced > k
        own = np.where(group >= 0, shared, 0)
        total += int(((context + k - own) * alive).sum())
        for r, g in {(int(a), int(b)) for a, b in zip(rank[group >= 0], group[group >= 0])}:
            members = int((alive & (rank == r) & (group == g)).sum())
            calls = math.ceil(members / micro_batch) if micro_batch else int(members > 0)
            prefix += calls * int(shared[(rank == r) & (group == g)][0])
    return total + prefix, prefix


@pytest.mark.parametrize("seed", range(6))
def test_decode_reads_count_each_call_once_and_the_pricing_reads_the_same(seed):
    rng = np.random.default_rng(seed)
    n, R, K = 30, 3, 12
    rank = rng.integers(0, R, n)
    group = np.where(rng.random(n) < 0.7, rng.integers(0, 3, n), -1)
    shared = np.where(group >= 0, 64 * (group + 1), 0)
    context = shared + rng.integers(1, 200, n)
    produced = rng.integers(1, K + 1, n)
    micro_batch = int(rng.integers(0, 4))
    assert decode_reads(context, produced, rank, group, shared, micro_batch) == _reads_by_iteration(
        context, produced, rank, group, shared, micro_batch)
    load = cascade_load(rank, group, shared, produced, micro_batch, R, K)
    assert load.kv.sum() == decode_reads(context, produced, rank, group, shared, micro_batch)[1]
    assert load.pairs.sum() == (produced * shared * (group >= 0)).sum()


def _system_prompt(n: int, prefix: int = 2048) -> Workload:
    rng = np.random.default_rng(0)
    inputs = prefix + rng.integers(16, 128, n)
    return Workload("system", inputs, rng.integers(64, 256, n), prefix_group=np.zeros(n, np.int64),
                    prefix_len=np.full(n, prefix))


@pytest.mark.parametrize("policy", ["continuous", "coroutine"])
def test_cascades_read_the_prefix_once_and_shorten_the_batch(policy):
    """Qwen3-30B-A3B on 8 H100, 400 requests after one 2,048-token system prompt: at each policy's default
    (continuous: vLLM's rule; coroutine: groups) decode reads less KV per iteration and the batch ends sooner."""
    runs = {}
    for mode in ("off", "batch" if policy == "continuous" else "groups"):
        job = Job(load_model("qwen3_30b_a3b"), load_cluster("h100_8"), _system_prompt(400),
                  make_policy({"name": policy, "cascade_attention": mode}))
        out = simulate(job)
        runs[mode] = (out.prepared.state, summarize(out))
    (off, off_res), (on, on_res) = runs["off"], runs[next(m for m in runs if m != "off")]
    assert off.cascade_prefix_read == 0 < on.cascade_prefix_read
    assert on_res["kv_bytes_read_per_decode_iter"] < 0.5 * off_res["kv_bytes_read_per_decode_iter"]
    assert on_res["bct_s"] < off_res["bct_s"]
    assert on_res["prefill_tokens_computed"] == off_res["prefill_tokens_computed"]


def test_staged_groups_cascade_host_resident_members_two_or_more_per_rank():
    rank = np.array([0, 0, 0, 1, 1, 1, 1])
    group = np.array([2, 2, 2, 2, 5, 5, -1])
    tokens = np.array([256, 256, 256, 256, 64, 64, 0])
    staged = np.array([True, True, False, True, True, True, True])  # the third is device-resident
    np.testing.assert_array_equal(CascadeRule("groups").staged_groups(rank, group, tokens, staged),
                                  [2, 2, -1, -1, 5, 5, -1])
    for mode in ("off", "batch"):  # vLLM's rule is for device pages only
        assert (CascadeRule(mode).staged_groups(rank, group, tokens, staged) == -1).all()


def test_host_resident_cascades_restore_each_prefix_once_per_call():
    """coroutine with every running sequence host-resident (DeepSeek-R1 on 16 H20, 600 requests after one 2,048-token
    system prompt): a group's members on a rank are called together and each call restores the prefix once, so the
    host link carries much less per decode iteration and the batch ends sooner; what the members read is counted."""
    runs = {}
    for mode in ("off", "groups"):
        job = Job(load_model("deepseek_r1"), load_cluster("h20_16"), _system_prompt(600),
                  make_policy({"name": "coroutine", "cascade_attention": mode, "kv_residency": "host"}))
        out = simulate(job)
        runs[mode] = (out.prepared.state, summarize(out))
    (off, off_res), (on, on_res) = runs["off"], runs["groups"]
    assert off.cascade_prefix_read == 0 < on.cascade_prefix_read
    assert on_res["host_bytes_per_decode_iter"] < 0.5 * off_res["host_bytes_per_decode_iter"]
    assert on_res["bct_s"] < off_res["bct_s"]


def test_sglang_opt_keeps_its_default_and_refuses_a_cascade_with_two_batch_overlap():
    assert make_policy({"name": "sglang_opt"}).cascade_attention == "off"
    assert make_policy({"name": "sglang_opt", "cascade_attention": False}).cascade_attention == "off"  # YAML's off
    with pytest.raises(ValueError, match="cascade_attention=off"):
        make_policy({"name": "sglang_opt", "two_batch_overlap": True, "cascade_attention": "batch"})
    with pytest.raises(ValueError, match="groups"):
        make_policy({"name": "coroutine", "cascade_attention": "always"})
