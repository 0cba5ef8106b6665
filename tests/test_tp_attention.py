"""Tensor-parallel attention (policy.attention_tp), sglang_opt and two-batch overlap: memory and pricing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.job import prepare, resolve_attention_tp
from batchgen.memory import ConfigError
from batchgen.pricing.costs import decode_load
from batchgen.pricing.price import price
from batchgen.sim.run import simulate
from conftest import make_job


def _r1_job(tp, fraction=0.97, n=8):
    """R1 on 8 H20 with the smaller vLLM caps (256 sequences, 8,192 tokens), whose activations leave every
    degree from 2 up room for KV (the H20's own defaults, 1,024 and 16,384, leave none at degree 2)."""
    from batchgen.memory import MemorySettings
    return make_job("continuous", model="deepseek_r1", cluster="h20_8", inputs=np.full(n, 8192),
                    outputs=np.full(n, 64),
                    policy_overrides={"attention_tp": tp, "max_running": 256, "token_budget": 8192},
                    memory=MemorySettings(gpu_memory_fraction=fraction))


def test_tp_attention_shards_weights_and_counts_the_replicated_latent_once():
    """DeepSeek-R1 on 8 x H20: replicated attention does not fit; TP over 8 shards the non-expert weights
    (attention, dense FFN, shared experts, vocabulary) 1/8, and the group's KV pool is ONE GPU's pool (the MLA
    latent is replicated on each GPU of the group), not eight."""
    with pytest.raises(ConfigError, match="weights per GPU"):
        prepare(_r1_job(1))
    p = prepare(_r1_job(8))
    assert p.policy.attention_tp == 8 and p.state.topo.num_gpus == 1 and p.cluster.instance_size == 1
    m = p.latency.model
    replicated = p.latency.base.weight_bytes_per_rank()
    non_expert = (m.num_layers * m.attention_params_per_layer + m.num_dense_layers * m.dense_ffn_params
                  + m.embedding_params + m.num_moe_layers * m.shared_expert_params) * m.weight_bytes
    assert p.budget.weights_per_gpu_bytes == pytest.approx(replicated - non_expert * 7 / 8)
    per_gpu_kv = (0.97 * 97871 * 2**20 - 1e9 - p.budget.activation_bytes - p.budget.weights_per_gpu_bytes)
    pages = int(per_gpu_kv // (64 * m.kv_bytes_per_token))
    assert p.budget.kv_pages_per_gpu == pages  # the group's pages: one GPU's, not 8 x
    assert p.state.gpu_pages.sum() == pages


def test_auto_picks_dp_attention_when_it_fits_else_the_largest_kv_pool():
    small = make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", policy_overrides={"attention_tp": "auto"})
    assert resolve_attention_tp(small) == 1
    # R1's MLA latent is replicated in each group: of the degrees that fit, auto takes the largest KV pool
    pools = {}
    for t in (2, 4, 8):
        try:
            budget = prepare(_r1_job(t, 0.96)).budget
        except ConfigError:
            continue
        pools[t] = budget.kv_pages_per_gpu * 8 // t
    assert resolve_attention_tp(_r1_job("auto", 0.96)) == max(pools, key=pools.get) == 4 and len(pools) == 3
    assert resolve_attention_tp(_r1_job("auto", 0.9)) == 8  # the default fraction: the command runs
    with pytest.raises(ConfigError, match="fits from memory.gpu_memory_fraction"):
        resolve_attention_tp(_r1_job("auto", 0.85))
    with pytest.raises(ConfigError, match="attention_tp=3"):
        resolve_attention_tp(_r1_job(3))


def test_gqa_tp_group_holds_degree_pools():
    """GQA splits the KV heads: a group of t GPUs holds t GPUs' pools of whole tokens."""
    one = prepare(make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", policy_overrides={"attention_tp": 1}))
    two = prepare(make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", policy_overrides={"attention_tp": 2}))
    assert two.budget.weights_per_gpu_bytes < one.budget.weights_per_gpu_bytes
    per_gpu = (two.budget.kv_pages_per_gpu // 2)
    assert per_gpu >= one.budget.kv_pages_per_gpu and two.state.topo.num_gpus == 4


def test_tp_attention_prices_the_all_reduce_as_communication():
    p = prepare(_r1_job(8))
    load = decode_load(np.zeros(4, np.int64), np.full(4, 8192), np.full(4, 8), np.ones(4, np.int64), 1, 8, 0,
                       np.zeros(1), np.zeros(1))
    cost = price(p.latency, load)
    assert cost.rank_comm.sum() > 0  # the join of the heads (the instance is one group: no all-to-all)
    assert p.latency.all_to_all(4.0) == 0 or p.latency.ep_ranks == 8


@pytest.mark.parametrize("gpus", [1, 16])
def test_two_batch_overlap_hides_only_communication(gpus):
    """TBO on one GPU (nothing to hide) is slower than the whole forward (smaller GEMMs, twice the launches);
    with an all-to-all over 16 GPUs of two nodes (the network) it hides communication and the forward is
    faster."""
    p = prepare(make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", cluster_overrides={"num_gpus": gpus}))
    R = gpus
    n = 256 * R
    load = decode_load(np.arange(n) % R, np.full(n, 512), np.full(n, 16), np.ones(n, np.int64), R, 16, 0,
                       np.zeros(R), np.zeros(R))
    whole, tbo = price(p.latency, load), price(p.latency, load, tbo=True)
    if gpus == 1:
        assert tbo.compute_s > whole.compute_s and tbo.rank_comm.sum() == whole.rank_comm.sum() == 0
    else:
        assert tbo.rank_comm.sum() < whole.rank_comm.sum()
        assert tbo.compute_s < whole.compute_s


def test_sglang_opt_runs_with_memory_derived_caps_and_its_memory_fraction():
    job = make_job("sglang_opt", model="qwen3_30b_a3b", cluster="h20_8", n=40,
                   inputs=np.full(40, 2048), outputs=np.full(40, 64))
    out = simulate(job, progress=False)
    assert out.prepared.state.all_finished()
    cont = prepare(dataclasses.replace(job, policy=make_job("continuous").policy))
    assert out.prepared.budget.kv_pages_per_gpu > cont.budget.kv_pages_per_gpu  # 0.95 of HBM, not 0.9


@pytest.mark.parametrize("policy,knobs", [("continuous", {}), ("sglang_opt", {}),
                                          ("coroutine", {"kv_residency": "host"})])
def test_tp_attention_runs_to_completion_with_invariants(policy, knobs):
    """Groups of 2 on 4 GPUs (2 scheduler ranks): every sequence finishes, the engine's invariants hold, and the
    attention all-reduce shows up as communication even within one group's node (coroutine: host-resident)."""
    job = make_job(policy, model="tiny_moe", n=60, cluster_overrides={"num_gpus": 4},
                   policy_overrides={"attention_tp": 2, **knobs})
    out = simulate(job, progress=False)
    assert out.prepared.state.all_finished() and out.prepared.state.topo.num_gpus == 2
    assert sum(float(r.rank_comm.sum()) for r in out.records) > 0
    if policy == "coroutine":
        assert out.host_bytes > 0


def test_two_batch_overlap_with_one_sequence_per_rank_is_the_whole_forward():
    """Nothing to split (one sequence per rank): the second micro-batch is empty, so TBO costs exactly the
    whole forward, neither a gain nor a doubled launch."""
    p = prepare(make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", cluster_overrides={"num_gpus": 16}))
    R = 16
    load = decode_load(np.arange(R), np.full(R, 512), np.full(R, 8), np.ones(R, np.int64), R, 8, 0,
                       np.zeros(R), np.zeros(R))
    whole, tbo = price(p.latency, load), price(p.latency, load, tbo=True)
    assert tbo.compute_s == pytest.approx(whole.compute_s)


def test_a_tp_group_restores_its_share_of_host_kv():
    """Host-resident KV under TP attention: each GPU of a group restores its share of every token over its own
    link, in parallel: GQA 1/degree of the KV heads, MLA the whole (replicated) latent."""
    gqa = prepare(make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", policy_overrides={"attention_tp": 4}))
    mla = prepare(_r1_job(8))
    for p, split in ((gqa, 4), (mla, 1)):
        base = p.latency.base
        assert p.latency.kv_restore(80_000.0, 2) == pytest.approx(base.kv_restore(80_000.0 / split, 2))
        assert p.latency.kv_append(64.0) == pytest.approx(base.kv_append(64.0 / split))


def _r1_coroutine(n=64, **knobs):
    rng = np.random.default_rng(1)
    return make_job("coroutine", model="deepseek_r1", cluster="h20_8", inputs=np.full(n, 2048),
                    outputs=rng.integers(2000, 12000, n), policy_overrides=knobs, check_invariants=False)


def test_coroutine_plans_its_attention_degree_and_prefill_chunk():
    """R1 on 8 x H20: data-parallel attention fits only by streaming experts from host every iteration; with
    the degree and the prefill chunk planned, coroutine runs TP-attention groups with every weight resident,
    and the plan it keeps predicts at least the throughput of every degree's own plan."""
    auto = prepare(_r1_coroutine(attention_tp="auto", prefill_tokens_per_rank="auto"))
    assert auto.policy.attention_tp > 1 and auto.plan.streamed_layers == 0
    assert auto.state.topo.num_gpus == 8 // auto.policy.attention_tp  # a scheduler rank per group
    assert auto.plan.ranks == auto.state.topo.num_gpus
    for t in (1, 2, 4, 8):
        try:
            fixed = prepare(_r1_coroutine(attention_tp=t, prefill_tokens_per_rank="auto"))
        except ConfigError:
            continue
        assert auto.plan.batch_tokens_per_s >= fixed.plan.batch_tokens_per_s * (1 - 0.01), t
    dp = prepare(_r1_coroutine())  # the defaults: DP attention, 32K-token prefill chunks
    assert dp.plan.streamed_layers > 0 and auto.plan.batch_tokens_per_s > dp.plan.batch_tokens_per_s


def test_planned_group_kv_matches_the_memory_budget():
    """The planner sizes a group's device KV as the memory budget does: GQA groups hold degree GPUs' shares of
    each token, so a TP-2 group plans about twice the device sequences of a DP rank."""
    seqs = {}
    for t in (1, 2):
        job = make_job("coroutine", model="qwen3_30b_a3b", cluster="h20_8", inputs=np.full(64, 30_000),
                       outputs=np.full(64, 4000), policy_overrides={"attention_tp": t, "kv_residency": "device",
                                                                     "b_moe": 1024}, check_invariants=False)
        p = prepare(job)
        pages = -(-(p.plan.typical_context + job.page_tokens) // job.page_tokens)
        assert p.plan.device_seqs == p.budget.kv_pages_per_gpu // pages, t  # b_moe 1024: device KV bounds it
        seqs[t] = p.plan.device_seqs
    assert seqs[2] >= 2 * seqs[1] - 1


def test_two_batch_overlap_is_off_where_there_is_no_all_to_all_to_hide():
    """SGLang's TBO (asked for: SGLang leaves it off) hides the expert all-to-all: a dense model (each GPU its
    own replica) or an MoE model on one-GPU instances runs whole forwards; an MoE model over several GPUs keeps
    it, also when one TP-attention group spans them all (the experts' all-to-all is over the instance's GPUs)."""
    for model, gpus, tp, kept in (("llama2_7b", 8, 1, False), ("qwen3_30b_a3b", 1, 1, False),
                                  ("qwen3_30b_a3b", 8, 1, True), ("qwen3_30b_a3b", 4, 4, True)):
        job = make_job("sglang_opt", model=model, n=8, cluster_overrides={"num_gpus": gpus},
                       policy_overrides={"attention_tp": tp, "two_batch_overlap": True})
        assert prepare(job).policy.two_batch_overlap is kept, (model, gpus, tp)
