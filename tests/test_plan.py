"""The static plan: the per-layer DAG and its critical path, decode pricing on it, and the planner's choice."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.latency import Efficiency, Roofline
from batchgen.memory import ConfigError, MemorySettings, activation_bytes, batch_shape_of, staging_bytes
from batchgen.plan import (Dag, DecodeGrid, LayerCosts, WorkloadStats, build_layer_dag, compute_time, layer_time,
                           plan_job, price_decode)
from batchgen.plan.planner import Candidate, choose
from batchgen.policy.coroutine import CoroutinePolicy
from batchgen.pricing.costs import decode_load
from batchgen.pricing.price import price
from batchgen.specs import HardwareSpec, HostSpec, load_cluster, load_model

# ---- the DAG -------------------------------------------------------------------------------------------------


def test_tiny_dag_critical_path_by_hand():
    """a(2) on the GPU; b(3) after a on the h2d link; c(1) on the GPU (after a, same stream); d(4) after b, c.
    dp: a=2, b=5, c=3, d=max(5, 3)+4=9; the path is a -> b -> d."""
    dag = Dag()
    a = dag.add("a", 2.0, resource="gpu")
    b = dag.add("b", 3.0, after=[a], resource="h2d")
    c = dag.add("c", 1.0, resource="gpu")
    dag.add("d", 4.0, after=[b, c], resource="gpu")
    assert dag.finish == [2.0, 5.0, 3.0, 9.0]
    assert dag.length() == 9.0
    assert dag.path() == ["a", "b", "d"]


def test_a_resource_runs_its_nodes_one_after_another():
    shared, apart = Dag(), Dag()
    for name in ("x", "y"):
        shared.add(name, 2.0, resource="h2d")
        apart.add(name, 2.0, resource=f"link {name}")
    assert shared.length() == 4.0 and apart.length() == 2.0


def test_chain_equals_the_plain_sum_exactly():
    costs = [0.1, 0.2, 0.3, 1e-6, 7.7, 0.013]
    dag = Dag()
    for i, c in enumerate(costs):
        dag.add(f"n{i}", c, resource="gpu")
    assert dag.length() == sum(costs)


def test_sync_waits_for_the_slowest_rank_on_a_grid():
    dag = Dag()
    a = dag.add("attention", np.array([[1.0, 2.0], [3.0, 1.0]]), resource="gpu")  # 2 ranks x 2 iterations
    m = dag.add("moe", np.array([0.5, 0.5]), after=[a], resource="gpu", sync=True)
    assert np.array_equal(dag.finish[m], [[3.5, 2.5]])


def test_nodes_must_be_added_in_topological_order():
    with pytest.raises(ValueError, match="topological"):
        Dag().add("x", 1.0, after=[3])


# ---- the decode layer ----------------------------------------------------------------------------------------


def test_layer_without_host_traffic_is_the_chain():
    """Built as a DAG (not short-cut), two layers: layer 2 - layer 1 = max over ranks (attention + FFN) + MoE."""
    rng = np.random.default_rng(1)
    c = LayerCosts(dev_attn=rng.random((4, 5)), ffn=rng.random((4, 5)), moe=rng.random(5))
    dag, ends = build_layer_dag(c)
    want = (c.dev_attn + c.ffn).max(axis=0) + c.moe
    assert np.allclose(dag.finish[ends[1]][0] - dag.finish[ends[0]][0], want, rtol=1e-12)
    assert np.array_equal(layer_time(c), want)
    assert layer_time(LayerCosts(dev_attn=1.0, ffn=0.25, moe=2.0)) == 3.25


def test_restore_bound_layer_by_hand():
    """Three host micro-batches, restores of 3 s each, attention 1 s, MoE 1 s: the link is the bottleneck,
    9 s per layer; the compute alone would take 4 s."""
    c = LayerCosts(dev_attn=0.0, ffn=0.0, moe=1.0, host_attn=[1.0] * 3, restore=[3.0] * 3, append=[0.0] * 3)
    assert layer_time(c) == 9.0 and compute_time(c) == 4.0


def test_double_buffering_hides_restores_behind_the_previous_layer():
    """Two micro-batches, attention 1 s each, MoE 2 s: the next layer's two restores run during this layer's
    second attention and MoE. Restores of 1.5 s (3 s per layer) hide behind 4 s of compute; with a MoE of
    0.5 s (2.5 s of compute) they do not, and the link's 3 s show."""
    hidden = LayerCosts(dev_attn=0.0, ffn=0.0, moe=2.0, host_attn=[1.0, 1.0], restore=[1.5, 1.5], append=[0, 0])
    assert layer_time(hidden) == compute_time(hidden) == 4.0
    shown = dataclasses.replace(hidden, moe=0.5)
    assert compute_time(shown) == 2.5 and layer_time(shown) == 3.0


def test_streamed_experts_share_the_link_with_restores():
    c = LayerCosts(dev_attn=0.5, ffn=0.0, moe=0.5, host_attn=[0.1], restore=[1.0], append=[0.0], prefetch=2.0)
    assert layer_time(c) == pytest.approx(3.0, rel=1e-12)  # 1 s of restore + 2 s of experts per layer, one link
    assert layer_time(dataclasses.replace(c, host_attn=[], restore=[], append=[])) == 2.0


def test_cpu_attention_layer():
    """Projections on the GPU (0.1), queries down (0.2), CPU attention (2), outputs back (0.1), then FFN (0.1)
    and MoE (0.2): the next layer's attention needs this layer's MoE output, so nothing overlaps across layers;
    with two micro-batches the second one's copies and projection hide behind the first one's CPU work."""
    one = LayerCosts(dev_attn=0.0, ffn=0.1, moe=0.2, host_attn=[0.1], append=[0.2], cpu_attn=[2.0],
                     ship_back=[0.1], cpu_attention=True)
    assert layer_time(one) == pytest.approx(0.1 + 0.2 + 2.0 + 0.1 + 0.1 + 0.2, rel=1e-12)
    two = dataclasses.replace(one, host_attn=[0.1] * 2, append=[0.2] * 2, cpu_attn=[2.0] * 2, ship_back=[0.1] * 2)
    assert layer_time(two) == pytest.approx(0.1 + 0.2 + 2.0 + 2.0 + 0.1 + 0.1 + 0.2, rel=1e-12)
    assert compute_time(two) == pytest.approx(0.5, rel=1e-12)


# ---- decode pricing ------------------------------------------------------------------------------------------


def mixtral_lat(pcie_gbs=32.0, dram_gbs=10_000.0, **kw):
    gpu = HardwareSpec(name="g", bf16_tflops=150, hbm_gb=80, hbm_gbs=2000, pcie_gbs=pcie_gbs)
    host = HostSpec(name="h", sockets=1, cores_per_socket=32, dram_gbs_per_socket=dram_gbs, tflops_per_socket=4)
    return Roofline(load_model("mixtral_8x7b"), gpu, ep_ranks=1, gpus_per_node=1, host=host, **kw)


def grid(n_dev, n_host, ctx, iterations=3, b_attn=64):
    full = lambda v: np.full((1, iterations), float(v))  # noqa: E731
    return DecodeGrid(full(n_dev), full(n_dev * ctx), np.ceil(full(n_dev) / b_attn), full(n_host),
                      full(n_host * ctx), full(n_dev + n_host))


def test_device_only_decode_prices_as_the_plain_sum():
    lat = mixtral_lat()
    rank = np.zeros(100, np.int64)
    ctx = np.full(100, 700)
    alive = np.full(100, 4)
    load = decode_load(rank, ctx, alive, np.ones(100, np.int64), 1, 4, 32, np.zeros(1, np.int64),
                       np.zeros(1, np.int64))
    plain = price(lat, load)
    g = DecodeGrid(load.attn_tokens, load.attn_context, load.micro_batches, np.zeros((1, 4)), np.zeros((1, 4)),
                   load.gate_tokens)
    dag = price_decode(lat, g, 32)
    assert np.allclose(dag.iteration_s, plain.iteration_s, rtol=1e-12)
    assert np.allclose(dag.rank_busy, plain.rank_busy, rtol=1e-12)
    assert dag.h2d_bytes == dag.d2h_bytes == 0


def test_a_restore_that_cannot_hide_shows_as_time():
    """Doubling PCIe bandwidth lowers the priced time when restores bound the layer, not when compute does."""
    restore_bound = grid(0, 512, 4000)
    compute_bound = grid(1024, 2, 50)
    slow, fast = mixtral_lat(pcie_gbs=16), mixtral_lat(pcie_gbs=32)
    t = {name: (price_decode(slow, g, 64).iteration_s[0], price_decode(fast, g, 64).iteration_s[0])
         for name, g in (("restore", restore_bound), ("compute", compute_bound))}
    assert t["restore"][1] < 0.6 * t["restore"][0]
    assert t["compute"][1] == pytest.approx(t["compute"][0], rel=1e-12)
    p = price_decode(slow, restore_bound, 64)
    assert p.exposed_s[0] > 0.5 * p.iteration_s[0]  # most of it is transfer the GPU waits for
    assert p.h2d_bytes == pytest.approx(32 * 3 * 512 * 4000 * slow.model.kv_bytes_per_token_per_layer)


def test_host_link_is_the_pcie_or_the_gpus_share_of_dram():
    lat = mixtral_lat(pcie_gbs=64, dram_gbs=100)
    assert lat.host_link_bw == pytest.approx(64e9 * lat.eff.link)  # one GPU: PCIe is the narrower
    wide = Roofline(lat.model, lat.gpu, ep_ranks=8, gpus_per_node=8, host=lat.host)
    assert wide.host_link_bw == pytest.approx(100e9 * lat.eff.host_memory / 8)  # eight share the DRAM


def test_cpu_attention_is_bound_by_the_hosts_share_of_dram():
    lat = mixtral_lat(dram_gbs=200)
    kv = lat.model.kv_bytes_per_token_per_layer
    t = lat.cpu_attention(256, 256 * 1000)
    assert t == pytest.approx((256 * 1000 + 256) * kv / lat.host_mem_bw
                              + 2 * 256 * 32 * 128 * 2 / lat.host_mem_bw + lat.eff.host_kernel_s, rel=1e-9)
    g = grid(0, 512, 1000)
    gpu_attn, cpu_attn = price_decode(lat, g, 256), price_decode(lat, g, 256, cpu_attention=True)
    assert cpu_attn.h2d_bytes < gpu_attn.h2d_bytes / 100  # no KV crosses PCIe, only queries and outputs


def test_cpu_attention_refused_for_mla():
    m, c = load_model("deepseek_r1"), load_cluster("h20_8")
    lat = Roofline(m, c.gpu, ep_ranks=8, gpus_per_node=8, host=c.host)
    with pytest.raises(ValueError, match="MLA"):
        lat.cpu_attention(1, 100)
    stats = WorkloadStats(2000, 8192, 2048, 16384)
    plan = plan_job(m, c, lat, MemorySettings(), CoroutinePolicy(), stats, page_tokens=64)
    assert plan.attention == "gpu"  # never offered
    with pytest.raises(ConfigError, match="not offered"):
        plan_job(m, c, lat, MemorySettings(), CoroutinePolicy(attention="cpu"), stats, page_tokens=64)


# ---- the planner ---------------------------------------------------------------------------------------------


def test_choice_between_two_hand_computed_dags():
    """Device-resident: 2 sequences, a 4 s chain per layer (0.5 tokens/s/layer). Host-resident: 6 sequences,
    restore-bound at 9 s per layer (0.67). Host wins; with restores of 5 s (15 s, 0.4) device wins."""
    device = LayerCosts(dev_attn=1.0, ffn=1.0, moe=2.0)

    def host(restore):
        return LayerCosts(dev_attn=0.0, ffn=0.0, moe=1.0, host_attn=[1.0] * 3, restore=[restore] * 3,
                          append=[0.0] * 3)

    for restore, winner in ((3.0, "host"), (5.0, "device")):
        cands = [Candidate(2 / layer_time(device), 2, kv_residency="device"),
                 Candidate(6 / layer_time(host(restore)), 6, kv_residency="host")]
        assert layer_time(host(restore)) == 3 * restore
        assert choose(cands).kv_residency == winner


def test_choose_prefers_the_simpler_plan_within_the_tie():
    cands = [Candidate(100.0, 64, 5e9, "host"), Candidate(99.5, 64, 0.0, "device"), Candidate(80.0, 32)]
    assert choose(cands).kv_residency == "device"
    assert choose(cands, tie=0.0).kv_residency == "host"


POLICY = CoroutinePolicy(b_attn=64, b_moe=1024, attention="gpu", prefill_tokens_per_rank=256)  # residency planned


def tiny_case(pcie_gbs, kv_seqs):
    """tiny_moe on one GPU whose KV (device residency, activations of the policy's batch shape aside) holds
    `kv_seqs` sequences of the typical context."""
    m = load_model("tiny_moe")
    c = dataclasses.replace(load_cluster("a5000_1"),
                            gpu=HardwareSpec(name="g", bf16_tflops=100, hbm_gb=4.0, hbm_gbs=1000, pcie_gbs=pcie_gbs),
                            host=HostSpec(name="h", sockets=1, cores_per_socket=8, dram_gbs_per_socket=1e6,
                                          tflops_per_socket=1))
    lat = Roofline(m, c.gpu, ep_ranks=1, gpus_per_node=1, host=c.host)
    stats = WorkloadStats(2048, 200, 200, 600)
    seq = -(-(stats.typical_context + 64) // 64) * 64 * m.kv_bytes_per_token
    shape = batch_shape_of(dataclasses.replace(POLICY, kv_residency="device"), stats.max_context)
    act = activation_bytes(m, shape, stats.max_context) if shape else 0.0
    reserve = c.gpu.hbm_bytes / 1e9 * 0.9 - (lat.weight_bytes_per_rank() + act + (kv_seqs + 0.5) * seq) / 1e9
    staging = staging_bytes(m, POLICY.b_attn, stats.max_context) if shape else 0.0
    return m, c, lat, stats, MemorySettings(activation_reserve_gb=reserve), seq, staging


def test_planner_fills_device_kv_and_goes_to_host_only_when_the_link_pays():
    m, c, lat, stats, mem, seq, staging = tiny_case(pcie_gbs=1e-3, kv_seqs=400)
    plan = plan_job(m, c, lat, mem, POLICY, stats, page_tokens=64)
    assert (plan.kv_residency, plan.device_seqs, plan.host_seqs) == ("device", 400, 0)  # PCIe too slow
    m, c, lat, stats, mem, seq, staging = tiny_case(pcie_gbs=1e5, kv_seqs=400)  # a link that costs ~nothing
    plan = plan_job(m, c, lat, mem, POLICY, stats, page_tokens=64)
    assert plan.kv_residency in ("mixed", "host") and plan.device_seqs + plan.host_seqs == 1024
    # mixed: the device keeps what its KV holds once the staging buffers are carved out of it
    assert plan.device_seqs == (int(400.5 - staging / seq) if plan.kv_residency == "mixed" else 0)
    # the prediction is the same pricing the simulator uses, for the chosen shape
    g = grid(plan.device_seqs, plan.host_seqs, stats.typical_context, iterations=1, b_attn=64)
    assert plan.iteration_s == pytest.approx(price_decode(lat, g, 64).iteration_s[0], rel=1e-12)
    assert plan.tokens_per_s == pytest.approx(1024 / plan.iteration_s)


def test_resolved_policy_keeps_explicit_knobs():
    m, c, lat, stats, mem, seq, staging = tiny_case(pcie_gbs=64, kv_seqs=40)
    policy = CoroutinePolicy(b_attn=64, kv_residency="device", prefill_tokens_per_rank=256)
    plan = plan_job(m, c, lat, mem, policy, stats, page_tokens=64)
    resolved = plan.resolve(policy)
    assert (resolved.b_attn, resolved.kv_residency) == (64, "device")
    assert resolved.b_moe == plan.b_moe and resolved.attention == plan.attention
    assert plan.describe().startswith("plan: b_attn=64") and plan.to_dict()["kv_residency"] == "device"


def test_planner_streams_experts_only_when_they_do_not_fit():
    m, c = load_model("mixtral_8x7b"), load_cluster("a5000_1")
    lat = Roofline(m, c.gpu, ep_ranks=1, gpus_per_node=1, host=c.host)
    stats = WorkloadStats(4000, 512, 256, 1536)
    plan = plan_job(m, c, lat, MemorySettings(), CoroutinePolicy(), stats, page_tokens=64)
    assert 2 <= plan.streamed_layers <= m.num_moe_layers  # 93 GB of weights on a 24 GB card
    assert plan.host_seqs > plan.device_seqs  # host-resident KV lets B_moe reach thousands
    huge = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, hbm_gb=2000.0, memory_mib=0.0))  # everything fits
    lat_huge = Roofline(m, huge.gpu, ep_ranks=1, gpus_per_node=1, host=huge.host)
    plan = plan_job(m, huge, lat_huge, MemorySettings(), CoroutinePolicy(), stats, page_tokens=64)
    assert (plan.streamed_layers, plan.kv_residency, plan.host_bytes_per_iter) == (0, "device", 0.0)


def test_planner_streams_whole_layers_where_the_memory_budget_does():
    """DeepSeek-V2's attention and shared experts alone exceed an A5000: the memory budget then streams every
    decoder layer whole, and the planner prices that same layout (it found no plan at all before)."""
    from batchgen.memory import plan_memory

    m, c = load_model("deepseek_v2"), load_cluster("a5000_1")
    lat = Roofline(m, c.gpu, ep_ranks=1, gpus_per_node=1, host=c.host)
    policy = CoroutinePolicy(prefill_tokens_per_rank=2048)
    plan = plan_job(m, c, lat, MemorySettings(), policy, WorkloadStats(4000, 512, 256, 1536), page_tokens=64)
    assert plan.streamed_layers == m.num_moe_layers
    resolved = dataclasses.replace(policy, b_attn=plan.b_attn, b_moe=plan.b_moe, kv_residency=plan.kv_residency,
                                   attention=plan.attention)
    budget = plan_memory(m, c, lat, MemorySettings(), page_tokens=64, can_stream_weights=True, uses_host_kv=True,
                         policy_name="coroutine", batch_shape=batch_shape_of(resolved, 1536), max_context=1536,
                         streamed_layers=plan.streamed_layers)
    assert budget.whole_layers
    assert plan.device_gb["weights"] == pytest.approx(budget.weights_per_gpu_bytes / 1e9, abs=1e-3)


def test_planner_is_fast_and_cached():
    import time
    m, c = load_model("qwen3_30b_a3b"), load_cluster("h20_16")
    lat = Roofline(m, c.gpu, Efficiency(), ep_ranks=16, gpus_per_node=8, host=c.host)
    stats = WorkloadStats(6000, 8192, 2048, 16384)
    start = time.perf_counter()
    first = plan_job(m, c, lat, MemorySettings(), CoroutinePolicy(), stats, page_tokens=64)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    assert plan_job(m, c, lat, MemorySettings(), CoroutinePolicy(), stats, page_tokens=64) is first
    assert cold < 2.0 and time.perf_counter() - start < 0.01


def test_plan_prices_the_batch_drain_not_only_the_steady_state():
    """DeepSeek-R1, 10K x 12K->4K (long-tailed outputs) on 128 H20 as 2 x 64: each rank sees 79 sequences.
    Streaming every MoE layer's experts would hold 58 running sequences per rank against 48 with the weights
    resident, 4% more decode throughput in the steady state; but as the share drains, the last sequences
    decode nearly alone and still pay 10 GB of streamed weights per iteration. Over the batch the resident
    plan wins (the simulator agreed: BCT 3,159 s against 4,645 s for the streaming plan, December 1, 2026)."""
    from batchgen.job import prepare
    from conftest import make_job
    from batchgen.workload import build_workload
    from omegaconf import OmegaConf
    from batchgen.confdir import conf_dir

    w = build_workload(OmegaConf.load(conf_dir() / "workload" / "longbench_12k_4k.yaml"), seed=0)
    job = make_job("coroutine", model="deepseek_r1", cluster="h20_128", inputs=w.input_lens,
                   outputs=w.output_lens, cluster_overrides={"gpus_per_instance": 64})
    plan = prepare(job).plan
    assert plan.streamed_layers == 0 and plan.device_seqs == 48
    assert plan.batch_tokens_per_s < 0.8 * plan.tokens_per_s  # the drain costs over a fifth here


def test_occupancy_replays_a_rank_share():
    from batchgen.plan.waves import occupancy, price_points, share_outputs, weighted_seconds

    outs = np.array([10, 10, 10, 10, 10])
    assert occupancy(outs, 2) == {2: 20, 1: 10}  # two full waves, then the fifth alone
    assert occupancy(outs, 8) == {5: 10}  # everything at once
    # refilled at run boundaries (coroutine's page-long runs): the third waits for the run the first two share
    assert occupancy(np.array([5, 10, 10]), 2) == {2: 10, 1: 5}
    assert occupancy(np.array([5, 10, 10]), 2, steps=64) == {2: 5, 1: 15}
    assert occupancy(np.array([5, 10, 10]), 2, steps=4) == {2: 7, 1: 11}  # the third joins at 8, one slot idle 3
    rng = np.random.default_rng(1)
    outs = rng.integers(1, 500, 300)
    hist = occupancy(outs, 37)
    assert occupancy(outs, 37, steps=1) == hist  # a run of one step refills every finished slot at once
    assert sum(m * k for m, k in occupancy(outs, 37, steps=64).items()) == outs.sum()
    assert sum(m * k for m, k in hist.items()) == outs.sum()  # every token decoded once
    assert max(hist) == 37 and sum(hist.values()) >= outs.sum() / 37
    assert price_points(37) == [1, 2, 3, 5, 10, 19, 37]
    assert weighted_seconds({1: 4, 3: 2}, [1, 5], [1.0, 5.0]) == 4 * 1.0 + 2 * 3.0
    lens = share_outputs((1.0, 2.0, 100.0), 40, 0.0)
    assert lens.size == 40 and lens.min() >= 1 and lens.max() <= 100
    assert (share_outputs((), 3, 7.4) == 7).all()


def _replayed_runs(outs: np.ndarray, running: int, steps: int) -> dict[int, int]:
    """The run-boundary occupancy replayed run by run (the checker): sort the set, run min(steps, longest)
    iterations, drop who ended, refill in arrival order."""
    hist: dict[int, int] = {}
    left, nxt = [int(o) for o in outs[:running]], min(running, outs.size)
    while left:
        k, done = min(steps, max(left)), 0
        for m, end in enumerate(sorted(min(o, k) for o in left)):
            hist[len(left) - m] = hist.get(len(left) - m, 0) + end - done
            done = end
        left = [o - k for o in left if o > k]
        take = min(running - len(left), outs.size - nxt)
        left += [int(o) for o in outs[nxt:nxt + take]]
        nxt += take
    return {m: k for m, k in sorted(hist.items()) if k > 0}


@given(st.lists(st.integers(1, 300), min_size=0, max_size=80), st.integers(1, 25), st.integers(1, 70))
@settings(max_examples=300, deadline=None)
def test_run_occupancy_counted_per_sequence_equals_the_run_by_run_replay(outs, running, steps):
    from batchgen.plan.waves import occupancy

    assert occupancy(np.array(outs, np.int64), running, steps=steps) == _replayed_runs(
        np.array(outs, np.int64), running, steps)


def test_planned_prefill_chunk_is_the_largest_that_costs_decode_nothing():
    """`prefill_tokens_per_rank: auto`: a chunk's activations come out of what device KV can hold. With room
    to spare the largest chunk is kept; where the activations of a 32K-token chunk crowd out device KV the
    plan takes a smaller one, predicts more decode throughput than the 32K plan, and the resolved policy
    carries the chunk."""
    from batchgen.plan.planner import PREFILL_CHUNKS

    m, c, lat, stats, mem, seq, staging = tiny_case(pcie_gbs=64, kv_seqs=400)
    auto = CoroutinePolicy(b_attn=64, b_moe=1024, kv_residency="device", prefill_tokens_per_rank="auto")
    roomy = dataclasses.replace(mem, activation_reserve_gb=0.0)
    assert plan_job(m, c, lat, roomy, auto, stats, page_tokens=64).prefill_tokens == PREFILL_CHUNKS[0]
    plan = plan_job(m, c, lat, mem, auto, stats, page_tokens=64)
    largest = plan_job(m, c, lat, mem, dataclasses.replace(auto, prefill_tokens_per_rank=PREFILL_CHUNKS[0]),
                       stats, page_tokens=64)
    assert plan.prefill_tokens < PREFILL_CHUNKS[0] and plan.device_seqs > largest.device_seqs
    assert plan.batch_tokens_per_s > largest.batch_tokens_per_s
    assert plan.resolve(auto).prefill_tokens_per_rank == plan.prefill_tokens
    assert f"prefill chunk {plan.prefill_tokens:,}" in plan.describe()


def test_the_memory_plan_counts_a_shared_prefix_once_per_group():
    """4,096-token system prompt before every one of 2,000 requests (coroutine's device KV): with prefix caching each
    running sequence holds only its own tokens past the prompt's pages, beside the prompt once, so the plan fits
    about as many more on a rank as the context is longer than them; without it, the whole context each."""
    from batchgen.workload.spec import Workload
    m, c = load_model("qwen3_30b_a3b"), load_cluster("h100_8")
    lat = Roofline(m, c.gpu, ep_ranks=8, gpus_per_node=8, host=c.host)
    n = 2000
    w = Workload("system", np.full(n, 4096 + 200), np.full(n, 400), prefix_group=np.zeros(n, np.int64),
                 prefix_len=np.full(n, 4096))
    policy = CoroutinePolicy(kv_residency="device", b_moe=2048, b_attn=512)
    shared, whole = WorkloadStats.of(w, 64, sharing=True), WorkloadStats.of(w, 64, sharing=False)
    assert whole.shared == whole.prefix_tokens == 0 and shared.shared == shared.prefix_tokens == 4096
    on = plan_job(m, c, lat, MemorySettings(), policy, shared, page_tokens=64)
    off = plan_job(m, c, lat, MemorySettings(), policy, whole, page_tokens=64)
    # (4,096 + 200 + 200 + 64) / (200 + 200 + 64) tokens a sequence, in pages: about 9x as many fit
    assert on.device_seqs >= 8 * off.device_seqs


def test_a_prefix_per_group_is_counted_at_most_once_per_sequence():
    """Many groups of one sequence each hold no more than their whole contexts: `_fits` takes the larger count."""
    from batchgen.plan.planner import _fits
    assert _fits(1000.0, 0.0, 10.0, 10.0) == 100
    assert _fits(1000.0, 400.0, 2.0, 10.0) == 300      # the prefixes once, then 2 bytes each
    assert _fits(1000.0, 5000.0, 2.0, 10.0) == 100     # more prefixes than room: a whole context each


def test_a_share_just_past_device_kv_runs_in_one_run_not_two():
    """DeepSeek-R1, fewshot_eval on 16 H20: each rank sees 878 short-answered questions (1-32 tokens), and device KV
    holds about 835. Refilled only when a page-long run ends, the other 43 would wait for a second run of their own
    that pays every streamed expert layer again per iteration; the plan lets them run host-resident in the first
    (the simulator: BCT 97.2 s with the two runs, 83.6 s with one)."""
    from omegaconf import OmegaConf

    from batchgen.confdir import conf_dir
    from batchgen.job import Job, prepare
    from batchgen.policy import make_policy
    from batchgen.setup import policy_config
    from batchgen.workload import build_workload

    m = load_model("deepseek_r1")
    w = build_workload(OmegaConf.load(conf_dir() / "workload" / "fewshot_eval.yaml"), seed=0)
    plan = prepare(Job(m, load_cluster("h20_16"), w, make_policy(policy_config("coroutine", m)))).plan
    share = -(-len(w) // 16)
    assert plan.device_seqs < share <= plan.device_seqs + plan.host_seqs


def test_the_memory_plan_counts_a_nested_prefix_once_beneath_its_groups():
    """A system prompt of 4,096 tokens before 100 prompts of 200 sampled 20 times: the plan's prefixes are the system
    prompt once and each prompt's own 192 whole-page tokens (one level would count the system prompt per prompt)."""
    from batchgen.workload.prefix_tree import PrefixTree
    from batchgen.workload.spec import Workload

    n, prompts = 2000, 100
    group = 1 + np.arange(n) // 20
    w = Workload("nested", np.full(n, 4296), np.full(n, 400), prefix_group=group, prefix_len=np.full(n, 4296),
                 prefix_tree=PrefixTree([-1, *[0] * prompts], [4096, *[4296] * prompts]))
    nested = WorkloadStats.of(w, 64, sharing=True)
    flat = WorkloadStats.of(dataclasses.replace(w, prefix_tree=None), 64, sharing=True)
    assert nested.shared == flat.shared == 4288  # each sequence holds its prompt's whole pages
    assert nested.prefix_tokens == 4096 + prompts * 192 and flat.prefix_tokens == prompts * 4288


def test_the_plan_counts_host_copies_whole_where_the_backend_keeps_them_whole():
    """backend=dist's processes keep each host copy whole (its capability `host_prefixes` is off): the plan counts
    them so, where the simulator and exec hold a node's system prompt once beneath them."""
    from batchgen.job import prepare
    from conftest import make_job
    from batchgen.workload.spec import Workload

    n = 2000
    w = Workload("system", np.full(n, 4096 + 200), np.full(n, 400), prefix_group=np.zeros(n, np.int64),
                 prefix_len=np.full(n, 4096))
    job = dataclasses.replace(make_job("coroutine", "qwen3_30b_a3b", "h100_8", n=2, policy_overrides={
        "kv_residency": "host", "b_moe": 256, "b_attn": 128}), workload=w)
    shared, whole = prepare(job, host_prefixes=True).plan, prepare(job, host_prefixes=False).plan
    # 256 running x 8 GPUs: each copy's 4,096 shared tokens once a node, or in every copy
    assert whole.host_gb["kv"] > 5 * shared.host_gb["kv"]
