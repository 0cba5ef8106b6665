"""Tensor-parallel attention (policy.attention_tp), sglang_opt and two-batch overlap: memory and pricing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.job import prepare, resolve_attention_tp
from batchgen.memory import ConfigError
from batchgen.sim.costs import decode_load, price
from batchgen.sim.run import simulate
from conftest import make_job


def _r1_job(tp, fraction=0.97, n=8):
    from batchgen.memory import MemorySettings
    return make_job("continuous", model="deepseek_r1", cluster="h20_8", inputs=np.full(n, 8192),
                    outputs=np.full(n, 64), policy_overrides={"attention_tp": tp},
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


@pytest.mark.parametrize("policy", ["continuous", "sglang_opt"])
def test_tp_attention_runs_to_completion_with_invariants(policy):
    """Groups of 2 on 4 GPUs (2 scheduler ranks): every sequence finishes, the engine's invariants hold, and the
    attention all-reduce shows up as communication even within one group's node."""
    job = make_job(policy, model="tiny_moe", n=60, cluster_overrides={"num_gpus": 4},
                   policy_overrides={"attention_tp": 2})
    out = simulate(job, progress=False)
    assert out.prepared.state.all_finished() and out.prepared.state.topo.num_gpus == 2
    assert sum(float(r.rank_comm.sum()) for r in out.records) > 0


def test_two_batch_overlap_with_one_sequence_per_rank_is_the_whole_forward():
    """Nothing to split (one sequence per rank): the second micro-batch is empty, so TBO costs exactly the
    whole forward, neither a gain nor a doubled launch."""
    p = prepare(make_job("continuous", model="qwen3_30b_a3b", cluster="h20_8", cluster_overrides={"num_gpus": 16}))
    R = 16
    load = decode_load(np.arange(R), np.full(R, 512), np.full(R, 8), np.ones(R, np.int64), R, 8, 0,
                       np.zeros(R), np.zeros(R))
    whole, tbo = price(p.latency, load), price(p.latency, load, tbo=True)
    assert tbo.compute_s == pytest.approx(whole.compute_s)
