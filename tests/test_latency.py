"""Tests of the roofline latency model (batchgen.latency): regimes, scaling, vectorisation, invariants.

Sanity figure (printed by test_sanity_decode_step_deepseek_v3_8xh20, run with -s): one decode step of
DeepSeek-V3 (FP8 weights) on 8 x H20 (data-parallel attention, 8-way expert parallelism, 64 sequences per
rank) with 512 sequences x 8K context comes to ~203 ms with the default efficiencies, ~2.5 K tokens/s per node:
- attention ~117 ms (1.9 ms x 61 layers): absorbed MLA does 278 K FLOPs per (query, context token) pair, so
  64 x 8K pairs are 1.5e11 FLOPs per layer (1.6 ms at 60% of 148 TFLOP/s) against 0.2 ms to read the 604 MB
  of latent KV: compute-bound on the H20;
- routed experts ~74 ms (1.28 ms x 58 layers): 16 tokens per expert, 32 experts per rank; 1.4 GB of expert
  weights per rank and layer take 0.47 ms to read, but 32 small GEMMs padded by gemm_pad_rows cost more;
- all-to-all ~4 ms (NVLink), dense layers + shared experts + router + LM head ~8 ms.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.latency import Efficiency, Roofline
from batchgen.specs.hardware import HardwareSpec
from batchgen.specs.model import ModelSpec

# ---- specs (data-sheet numbers, dense tensor throughput, one direction per link) ----------------------------

DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3", num_layers=61, hidden_size=7168, vocab_size=129280, max_context=163840,
    attention="mla", num_heads=128, num_kv_heads=128, head_dim=0, intermediate_size=18432, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256,
    num_shared_experts=1, top_k=8, moe_intermediate_size=2048, first_dense_layers=3, weight_bytes=1.0,
    kv_bytes=2.0, act_bytes=2.0)
MIXTRAL_8X7B = ModelSpec(
    name="mixtral-8x7b", num_layers=32, hidden_size=4096, vocab_size=32000, max_context=32768,
    attention="gqa", num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, num_experts=8,
    top_k=2, moe_intermediate_size=14336)
DENSE_8B = ModelSpec(
    name="dense-8b", num_layers=32, hidden_size=4096, vocab_size=128256, max_context=8192, attention="gqa",
    num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
H20 = HardwareSpec(name="H20", bf16_tflops=148, fp8_tflops=296, hbm_gb=96, hbm_gbs=4000, pcie_gbs=64,
                   nvlink_gbs=450, network_gbs=25)
H100 = HardwareSpec(name="H100", bf16_tflops=989, fp8_tflops=1979, hbm_gb=80, hbm_gbs=3350, pcie_gbs=64,
                    nvlink_gbs=450, network_gbs=50)
A100 = HardwareSpec(name="A100", bf16_tflops=312, hbm_gb=80, hbm_gbs=2039, pcie_gbs=32, nvlink_gbs=300,
                    network_gbs=25)
PURE_ROOFLINE = Efficiency(gemm_pad_rows=0.0)


def per_expert_time(lm: Roofline, tokens_per_expert):
    """Slowest rank's routed-expert time when every expert gets `tokens_per_expert` tokens on average."""
    m = lm.model
    return lm.experts(np.asarray(tokens_per_expert, dtype=float) * m.num_experts / m.top_k)[0]


def roofline_intensity_tokens(lm: Roofline) -> float:
    """Tokens per expert where an expert GEMM's FLOPs per weight byte reach peak_flops / hbm_bw (achieved)."""
    return lm.gemm_flops * lm.model.weight_bytes / (2 * lm.mem_bw)


def decode_step(lm: Roofline, seqs_per_rank: int, context: int) -> dict[str, float]:
    """One decode step on one rank of an instance with data-parallel attention, modules run back to back."""
    dense, moe = lm.layer_counts()
    total = seqs_per_rank * lm.ep_ranks
    parts = {
        "attention": (dense + moe) * lm.attention_decode(seqs_per_rank, seqs_per_rank * context),
        "dense_ffn": dense * lm.dense_ffn(seqs_per_rank),
        "shared+router": moe * (lm.shared_experts(seqs_per_rank) + lm.router(seqs_per_rank)),
        "experts": moe * lm.experts(total)[0],
        "all_to_all": moe * lm.all_to_all(total),
        "lm_head": lm.lm_head(seqs_per_rank),
    }
    parts["total"] = sum(parts.values())
    return parts


# ---- Efficiency ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("compute", 0.0), ("memory", 1.5), ("link", -0.1), ("compute", math.nan),
                                         ("kernel_s", -1e-6), ("collective_per_peer_s", math.inf),
                                         ("gemm_pad_rows", -1.0)])
def test_efficiency_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        Efficiency(**{field: value})


def test_efficiency_round_trips_through_dict():
    eff = Efficiency(compute=0.5, kernel_s=1e-5)
    assert Efficiency(**eff.to_dict()) == eff


def test_latency_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ep_ranks"):
        Roofline(MIXTRAL_8X7B, H100, ep_ranks=0)
    with pytest.raises(ValueError, match="routing_skew"):
        Roofline(MIXTRAL_8X7B, H100, routing_skew=-1.0)
    with pytest.raises(ValueError, match="network"):
        Roofline(MIXTRAL_8X7B, HardwareSpec(name="x", bf16_tflops=1, hbm_gb=1, hbm_gbs=1, pcie_gbs=1),
                     ep_ranks=16)
    with pytest.raises(ValueError, match="tokens"):
        Roofline(MIXTRAL_8X7B, H100).dense_ffn(-1)


# ---- roofline regimes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("eff", [PURE_ROOFLINE, Efficiency()], ids=["pure", "default"])
def test_experts_memory_bound_small_compute_bound_large(eff):
    lm = Roofline(MIXTRAL_8X7B, H100, eff)
    n_star = roofline_intensity_tokens(lm)  # ~236 tokens per expert for bf16 on an H100
    assert 150 < n_star < 350
    # small batches: every expert's weights are read once whatever the batch, so time is ~flat
    assert per_expert_time(lm, 0.4 * n_star) == pytest.approx(per_expert_time(lm, 8), rel=0.05)
    # large batches: compute-bound, linear in tokens
    big = 20 * n_star
    assert per_expert_time(lm, 2 * big) / per_expert_time(lm, big) == pytest.approx(2.0, rel=0.05)
    # the knee (first 10% rise above the memory floor) sits near the peak_flops / hbm_bw intensity; the
    # activations in and out of each GEMM (which grow with tokens) make the floor rise a little before it
    grid = np.geomspace(8, 16 * n_star, 400)
    t = per_expert_time(lm, grid)
    knee = grid[np.argmax(t > 1.10 * t[0])]
    assert 0.5 * n_star < knee < 2 * n_star


def test_experts_saturate_at_hundreds_to_thousands_of_tokens_deepseek_v3_h20():
    """Pure roofline says an H20's FP8 expert GEMM is compute-bound past ~30 tokens per expert, but measured
    experts keep gaining up to hundreds-thousands (MoE-Gen: 2^10; BatchGen: ~16K tokens at the gate for
    256 experts, top-8 = 512 per expert). gemm_pad_rows carries that; here: 90% of peak throughput."""
    lm = Roofline(DEEPSEEK_V3, H20, ep_ranks=8, use_fp8=True)
    grid = np.geomspace(1, 1 << 16, 321)
    throughput = grid / per_expert_time(lm, grid)
    asymptote = 1e7 / per_expert_time(lm, 1e7)
    saturated = grid[np.argmax(throughput >= 0.9 * asymptote)]
    assert 100 <= saturated <= 4096
    gate_tokens = saturated * DEEPSEEK_V3.num_experts / DEEPSEEK_V3.top_k
    assert 4096 <= gate_tokens <= 65536  # the paper's ~16K tokens at the gate
    # with the pure roofline the same chip saturates at a few tens of tokens per expert
    pure = Roofline(DEEPSEEK_V3, H20, PURE_ROOFLINE, ep_ranks=8, use_fp8=True)
    tp = grid / per_expert_time(pure, grid)
    assert grid[np.argmax(tp >= 0.9 * (1e7 / per_expert_time(pure, 1e7)))] < 100


def test_attention_decode_memory_bound_by_kv():
    lm = Roofline(MIXTRAL_8X7B, H100)
    # doubling every sequence's context ~doubles the time once KV dominates the weights
    t1, t2 = lm.attention_decode(256, 256 * 4096), lm.attention_decode(256, 256 * 8192)
    assert t2 / t1 == pytest.approx(2.0, rel=0.05)
    kv = 256 * 4096 * MIXTRAL_8X7B.kv_bytes_per_token_per_layer
    assert t1 == pytest.approx(kv / lm.mem_bw, rel=0.05)
    # micro-batching re-reads the weights and pays launches: never cheaper
    assert lm.attention_decode(256, 256 * 4096, micro_batches=4) > t1


def test_attention_prefill_compute_bound_and_quadratic():
    lm = Roofline(MIXTRAL_8X7B, H100)
    t8k = lm.attention_prefill(8192, 8192**2)
    t32k = lm.attention_prefill(32768, 32768**2)
    assert t32k / t8k > 4  # the score term grows with L^2
    # causal halving: score FLOPs are half of the full L^2 grid
    m = MIXTRAL_8X7B
    flops = 2 * m.attention_params_per_layer * 8192 + 0.5 * m.attention_score_flops_prefill * 8192**2
    assert t8k > 0.5 * flops / lm.gemm_flops


def test_fp8_speeds_up_compute_bound_gemms_only_when_possible():
    big = 1 << 20
    fp8 = Roofline(DEEPSEEK_V3, H20, use_fp8=True)
    bf16 = Roofline(DEEPSEEK_V3, H20, use_fp8=False)
    assert bf16.experts(big)[0] / fp8.experts(big)[0] == pytest.approx(2.0, rel=0.02)
    assert Roofline(MIXTRAL_8X7B, H100, use_fp8=True).experts(big) == \
        Roofline(MIXTRAL_8X7B, H100).experts(big)  # 2-byte weights: bf16 GEMMs
    assert Roofline(MIXTRAL_8X7B, A100, use_fp8=True).gemm_flops == Roofline(MIXTRAL_8X7B, A100).gemm_flops


# ---- expert parallelism -------------------------------------------------------------------------------------


def test_routing_skew_makes_slowest_rank_slower_than_mean():
    for tokens in (512, 16384, 1 << 20):
        flat = Roofline(DEEPSEEK_V3, H20, ep_ranks=64, routing_skew=0.0).experts(tokens)
        assert flat[0] == pytest.approx(flat[1], rel=1e-12)
        skewed = Roofline(DEEPSEEK_V3, H20, ep_ranks=64, routing_skew=1.0).experts(tokens)
        assert skewed[0] > 1.2 * skewed[1]
    # large batches: the mean rank does the same work with or without skew, the slowest rank more
    big = 1 << 20
    flat = Roofline(DEEPSEEK_V3, H20, ep_ranks=64).experts(big)
    skewed = Roofline(DEEPSEEK_V3, H20, ep_ranks=64, routing_skew=1.0).experts(big)
    assert skewed[1] == pytest.approx(flat[1], rel=1e-6)
    assert skewed[0] > 2 * flat[0]


def test_uneven_expert_placement_without_skew():
    lm = Roofline(MIXTRAL_8X7B, H100, ep_ranks=3)  # ranks hold 3, 3, 2 experts
    worst, mean = lm.experts(1 << 16)
    assert worst > mean
    assert Roofline(MIXTRAL_8X7B, H100, ep_ranks=16).experts(1 << 16)[1] > 0  # idle ranks average in


def test_more_ranks_less_expert_time_per_rank():
    times = [Roofline(DEEPSEEK_V3, H20, ep_ranks=r).experts(16384)[0] for r in (1, 8, 64, 256)]
    assert all(a > b for a, b in zip(times, times[1:]))


def test_all_to_all_grows_with_ranks_and_crosses_to_network():
    per_rank = 256
    ranks = (1, 2, 4, 8, 16, 32, 64, 128)
    t = {r: Roofline(DEEPSEEK_V3, H20, ep_ranks=r).all_to_all(per_rank * r) for r in ranks}
    assert t[1] == 0.0
    values = list(t.values())
    assert all(a < b for a, b in zip(values, values[1:]))
    assert t[16] > 3 * t[8]  # beyond one node, the network (25 GB/s) replaces NVLink (450 GB/s)
    # the same 16 ranks within one (16-GPU) node stay on NVLink
    assert Roofline(DEEPSEEK_V3, H20, ep_ranks=16, gpus_per_node=16).all_to_all(per_rank * 16) < t[16]
    # every peer is reached at once: at one token per rank, 128 ranks cost about what 16 do (DeepEP's latency
    # grows from 118 to 192 us between them, with the bytes), not 112 more peers' latencies
    lm16, lm128 = Roofline(DEEPSEEK_V3, H20, ep_ranks=16), Roofline(DEEPSEEK_V3, H20, ep_ranks=128)
    assert lm16.all_to_all(16) < lm128.all_to_all(128) < 1.2 * lm16.all_to_all(16)
    assert Roofline(DENSE_8B, H20, ep_ranks=8).all_to_all(4096) == 0.0


def test_all_to_all_formula():
    """Two phases; in each, the 7 NVLink peers (a per-peer latency each, the all_to_all link fraction) and the
    8 network peers (the network module's latency and link fraction) in parallel, after the fixed latency."""
    eff = Efficiency(modules={"network": {"link": 0.5, "collective_s": 30e-6}})
    lm = Roofline(MIXTRAL_8X7B, H100, eff, ep_ranks=16)
    total = 8192
    sent = total / 16 * 2 * 4096 * 2  # each rank's copies (top-2, bf16 rows), its own included
    intra = 7 * eff.collective_per_peer_s + sent * 7 / 16 / (H100.nvlink_bw * eff.link)
    inter = 30e-6 + sent * 8 / 16 / (H100.network_bw * 0.5)
    phase = eff.collective_s + max(intra, inter)
    assert lm.all_to_all(total) == pytest.approx(2 * phase, rel=1e-12)


# ---- transfers and conveniences -----------------------------------------------------------------------------


def test_copies_and_network():
    lm = Roofline(MIXTRAL_8X7B, H100)
    assert lm.h2d(1e9) == pytest.approx(lm.eff.kernel_s + 1e9 / (64e9 * 0.75))
    assert lm.d2h(1e9) == lm.h2d(1e9)
    intra, inter = lm.network([1e8, 1e8], [False, True])
    assert inter > intra > 0
    assert lm.network(1e8, True) == inter
    assert lm.h2d(0) == lm.network(0, True) == 0.0


def test_weight_bytes_per_rank():
    m = DEEPSEEK_V3
    assert Roofline(m, H20).weight_bytes_per_rank() == pytest.approx(m.weight_bytes_total)
    per_rank = Roofline(m, H20, ep_ranks=64).weight_bytes_per_rank()
    routed = m.num_moe_layers * m.num_experts * m.expert_params * m.weight_bytes
    assert per_rank == pytest.approx(m.weight_bytes_total - routed + routed / 64)
    assert 20e9 < per_rank < 35e9  # ~16 GB non-expert (incl. 1.9 GB embeddings) + 10 GB of experts
    assert Roofline(DENSE_8B, H20, ep_ranks=8).weight_bytes_per_rank() == pytest.approx(DENSE_8B.weight_bytes_total)
    # uneven placement: the busiest rank's share
    mix = Roofline(MIXTRAL_8X7B, H100, ep_ranks=3).weight_bytes_per_rank()
    assert mix == pytest.approx(MIXTRAL_8X7B.weight_bytes_total
                                - 32 * 5 * MIXTRAL_8X7B.expert_params * MIXTRAL_8X7B.weight_bytes)


def test_layer_counts_and_expert_batch():
    lm = Roofline(DEEPSEEK_V3, H20, ep_ranks=8)
    assert lm.layer_counts() == (3, 58)
    assert lm.expert_batch_per_expert(16384) == 512.0
    np.testing.assert_array_equal(lm.expert_batch_per_expert([0, 32]), [0.0, 1.0])
    dense = Roofline(DENSE_8B, H20)
    assert dense.layer_counts() == (32, 0)
    assert dense.expert_batch_per_expert(1000) == 0.0


def test_dense_model_has_no_moe_costs():
    lm = Roofline(DENSE_8B, H20)
    assert lm.experts(4096) == (0.0, 0.0)
    assert lm.shared_experts(4096) == lm.router(4096) == lm.all_to_all(4096) == 0.0
    assert lm.dense_ffn(4096) > 0
    assert Roofline(MIXTRAL_8X7B, H100).shared_experts(4096) == 0.0  # MoE without shared experts


# ---- vectorisation and invariants ---------------------------------------------------------------------------

LATENCY_MODELS = [
    Roofline(DEEPSEEK_V3, H20, ep_ranks=16, use_fp8=True, routing_skew=0.8),
    Roofline(MIXTRAL_8X7B, H100, ep_ranks=4),
    Roofline(DENSE_8B, A100),
]
ONE_ARG = ["dense_ffn", "shared_experts", "router", "lm_head", "all_to_all", "h2d", "d2h",
           "expert_batch_per_expert"]


@pytest.mark.parametrize("lm", LATENCY_MODELS, ids=lambda lm: lm.model.name)
def test_vectorised_matches_scalar(lm):
    rng = np.random.default_rng(0)
    ranks, iters = 5, 7
    tokens = rng.integers(0, 600, size=(ranks, iters)).astype(float)
    tokens[0, 0] = 0
    ctx = tokens * rng.integers(1, 9000, size=(ranks, iters))
    mb = rng.integers(1, 4, size=(ranks, iters))
    for name, args in [("attention_decode", (tokens, ctx, mb)), ("attention_prefill", (tokens, ctx * 50, mb))]:
        grid = getattr(lm, name)(*args)
        assert grid.shape == (ranks, iters)
        for i in np.ndindex(ranks, iters):
            assert grid[i] == pytest.approx(getattr(lm, name)(*(float(a[i]) for a in args)), rel=1e-12)
    for name in ONE_ARG:
        grid = getattr(lm, name)(tokens)
        for i in np.ndindex(ranks, iters):
            assert grid[i] == pytest.approx(getattr(lm, name)(float(tokens[i])), rel=1e-12)
    worst, mean = lm.experts(tokens * 16)
    for i in np.ndindex(ranks, iters):
        assert (worst[i], mean[i]) == pytest.approx(lm.experts(float(tokens[i] * 16)), rel=1e-12)
    cross = tokens > 300
    grid = lm.network(tokens * 1e6, cross)
    for i in np.ndindex(ranks, iters):
        assert grid[i] == pytest.approx(lm.network(float(tokens[i] * 1e6), bool(cross[i])), rel=1e-12)


def test_broadcasting_rank_by_iteration_grid():
    lm = LATENCY_MODELS[0]
    tokens = np.array([1.0, 64.0, 512.0])[:, None]  # ranks
    context = np.array([1e3, 1e5, 1e6, 1e7])[None, :]  # iterations
    assert lm.attention_decode(tokens, context).shape == (3, 4)
    assert lm.experts(np.arange(10.0)[:, None] * np.ones(3))[0].shape == (10, 3)
    assert isinstance(lm.dense_ffn(5), float) and isinstance(lm.experts(5)[0], float)


@pytest.mark.parametrize("lm", LATENCY_MODELS, ids=lambda lm: lm.model.name)
def test_zero_tokens_cost_nothing(lm):
    assert lm.attention_decode(0, 0) == lm.attention_decode(0, 0, micro_batches=4) == 0.0
    assert lm.attention_prefill(0, 0) == 0.0
    for name in ONE_ARG:
        assert getattr(lm, name)(0) == 0.0
    assert lm.experts(0) == (0.0, 0.0)
    assert lm.network(0, False) == 0.0


@pytest.mark.parametrize("lm", LATENCY_MODELS, ids=lambda lm: lm.model.name)
@settings(max_examples=60, deadline=None)
@given(a=st.floats(0, 1e6), b=st.floats(0, 1e6), ca=st.floats(0, 1e10), cb=st.floats(0, 1e10),
       mb=st.integers(1, 8))
def test_monotonic_in_tokens_and_context(lm, a, b, ca, cb, mb):
    (a, b), (ca, cb) = sorted((a, b)), sorted((ca, cb))
    tol = 1 + 1e-12

    def le(x, y):
        return 0.0 <= x <= y * tol

    assert le(lm.attention_decode(a, ca, mb), lm.attention_decode(b, ca, mb))
    assert le(lm.attention_decode(b, ca, mb), lm.attention_decode(b, cb, mb))
    assert le(lm.attention_prefill(a, ca, mb), lm.attention_prefill(b, ca, mb))
    assert le(lm.attention_prefill(b, ca, mb), lm.attention_prefill(b, cb, mb))
    for name in ONE_ARG:
        assert le(getattr(lm, name)(a), getattr(lm, name)(b))
    (wa, ma), (wb, mb_) = lm.experts(a), lm.experts(b)
    assert le(wa, wb) and le(ma, mb_) and ma <= wa * tol


# ---- sanity figures -----------------------------------------------------------------------------------------


def test_sanity_decode_step_deepseek_v3_8xh20():
    """DeepSeek-V3 decode step, 8 x H20, 512 sequences x 8K context: ~203 ms (see the module docstring)."""
    lm = Roofline(DEEPSEEK_V3, H20, ep_ranks=8, use_fp8=True)
    parts = decode_step(lm, seqs_per_rank=64, context=8192)
    print({k: f"{v * 1e3:.2f} ms" for k, v in parts.items()}, f"{512 / parts['total']:.0f} tok/s")
    assert 0.05 < parts["total"] < 0.5
    assert parts["experts"] > parts["all_to_all"]  # within a node, NVLink keeps all-to-all small
    assert parts["attention"] > 0.1 * parts["total"]


def test_sample_numbers():
    """Reference numbers for the report (printed with -s); loose bounds so that recalibration passes."""
    mix = Roofline(MIXTRAL_8X7B, H100)
    for seqs in (1, 64, 1024):
        layer = (mix.attention_decode(seqs, seqs * 4096) + mix.router(seqs) + mix.experts(seqs)[0])
        print(f"Mixtral-8x7B H100 decode layer, {seqs} x 4K: {layer * 1e3:.3f} ms")
    ds = Roofline(DEEPSEEK_V3, H20, ep_ranks=64, use_fp8=True)
    for total in (512, 16384):
        worst, _ = ds.experts(total)
        print(f"DeepSeek-V3 H20 EP64 experts, {total} gate tokens: {worst * 1e3:.3f} ms, "
              f"all-to-all {ds.all_to_all(total) * 1e3:.3f} ms")
    # 32x the tokens for much less than 32x the time: the small batch wastes the weight reads
    assert ds.experts(16384)[0] < 12 * ds.experts(512)[0]


@pytest.mark.parametrize("model,gpu,ranks", [(DEEPSEEK_V3, H20, 64), (MIXTRAL_8X7B, H100, 3)])
def test_uniform_fast_path_matches_general_expectation(model, gpu, ranks):
    tokens = np.array([0.0, 1.0, 7.0, 100.0, 5000.0, 1e6])
    uniform = Roofline(model, gpu, ep_ranks=ranks).experts(tokens)
    general = Roofline(model, gpu, ep_ranks=ranks, routing_skew=1e-300).experts(tokens)  # same shares
    np.testing.assert_allclose(uniform, general, rtol=1e-12)


# ---- the host: CPUs and DRAM of a node, KV restore / append, CPU attention ------------------------------------


def test_default_host_matches_its_yaml_and_clusters_name_their_hosts():
    from batchgen.specs import DEFAULT_HOST, host_names, load_cluster, load_host
    assert load_host(DEFAULT_HOST.name) == DEFAULT_HOST
    assert {"xeon_8480_2s", "epyc_7453_1s", "epyc_7742_2s"} <= set(host_names())
    rig = load_cluster("a5000_1").host
    assert (rig.cores, rig.dram_bw, rig.flops) == (28, 204.8e9, 2.464e12)  # the paper's EPYC 7453 rig
    assert Roofline(MIXTRAL_8X7B, H20).host == DEFAULT_HOST  # no host given: the default


def test_host_spec_validation():
    from batchgen.specs import HostSpec
    with pytest.raises(ValueError, match="host.sockets must be a positive integer"):
        HostSpec(name="h", sockets=0, cores_per_socket=8, dram_gbs_per_socket=100, tflops_per_socket=1)
    with pytest.raises(ValueError, match="unknown host field"):
        HostSpec.from_dict({"name": "h", "sockets": 1, "cores_per_socket": 8, "dram_gbs_per_socket": 100,
                            "tflops_per_socket": 1, "gpus": 8})


def test_kv_restore_and_append_formulas():
    lm = Roofline(MIXTRAL_8X7B, H20, gpus_per_node=8)
    kv = MIXTRAL_8X7B.kv_bytes_per_token_per_layer
    bw = min(64e9 * lm.eff.link, lm.host.dram_bw * lm.eff.host_memory / 8)
    assert lm.kv_restore(1000, 2) == pytest.approx(2 * lm.eff.kernel_s + 1000 * kv / bw)
    assert lm.kv_append(16) == pytest.approx(lm.eff.kernel_s + 16 * kv / bw)
    assert lm.kv_restore(0) == 0.0 and lm.kv_append(0) == 0.0
    assert np.allclose(lm.kv_restore(np.array([[0.0, 1e6]])), [[0.0, lm.kv_restore(1e6)]])


def test_cpu_attention_compute_bound_on_a_slow_cpu():
    from batchgen.specs import HostSpec
    slow = HostSpec(name="s", sockets=1, cores_per_socket=1, dram_gbs_per_socket=1000, tflops_per_socket=0.001)
    lm = Roofline(MIXTRAL_8X7B, H20, gpus_per_node=1, host=slow)
    flops = MIXTRAL_8X7B.attention_score_flops_decode * 1e5
    assert lm.cpu_attention(100, 1e5) == pytest.approx(flops / (1e9 * lm.eff.host_compute) + lm.eff.host_kernel_s)
    down, back = lm.cpu_attention_ship(100)
    assert down > back > 0  # queries and new KV go down, outputs come back
    with pytest.raises(ValueError, match="MLA"):
        Roofline(DEEPSEEK_V3, H20).cpu_attention_ship(1)
