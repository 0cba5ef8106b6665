"""The offloading systems' policies: their per-micro-batch pricing, their searches and their static blocks."""

import dataclasses

import numpy as np
import pytest

from batchgen.job import prepare
from batchgen.latency import LatencySettings, build_latency
from batchgen.memory import ConfigError
from batchgen.plan.decode import DecodeGrid, price_decode
from batchgen.pricing.microbatch import price_microbatched
from batchgen.policy import make_policy
from batchgen.results.metrics import summarize
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from conftest import make_job


def _lat(model="mixtral_8x7b", cluster="a5000_1"):
    c = load_cluster(cluster)
    m = load_model(model)
    return build_latency(LatencySettings(), m, c.gpu, ep_ranks=1, gpus_per_node=1, host=c.host)


def _grid(n, ctx, host=True):
    one = lambda v: np.full((1, 1), float(v))  # noqa: E731
    if host:
        return DecodeGrid(one(0), one(0), one(0), one(n), one(n * ctx), one(n))
    return DecodeGrid(one(n), one(n * ctx), one(1), one(0), one(0), one(n))


def test_an_ffn_per_micro_batch_costs_more_than_one_expert_batch_and_counts_its_calls():
    """Weights resident: 16 micro-batches of 64 through the experts one by one read every expert 16 times; one
    combined batch of 1024 reads them once. The calls are counted per micro-batch (the per-expert batch)."""
    lat = _lat()
    split, calls = price_microbatched(lat, _grid(1024, 600, host=False), 64, cpu_attention=False, pipelined=False)
    whole, one = price_microbatched(lat, _grid(1024, 600, host=False), 0, cpu_attention=False, pipelined=False)
    assert calls[0] == 16 and one[0] == 1
    assert split.iteration_s[0] > 1.5 * whole.iteration_s[0]
    combined = price_decode(lat, _grid(1024, 600, host=False), 64)
    assert whole.iteration_s[0] == pytest.approx(combined.iteration_s[0], rel=0.05)


def test_cgopipe_overlaps_cpu_attention_with_the_gpu_ffn():
    """With CPU attention and weights resident, pipelining the next micro-batch's attention behind this one's
    FFN shortens the layer; without weights to stream both are bounded below by the CPU's attention time."""
    lat = _lat()
    args = dict(cpu_attention=True)
    seq, _ = price_microbatched(lat, _grid(512, 2000), 64, pipelined=False, **args)
    pipe, _ = price_microbatched(lat, _grid(512, 2000), 64, pipelined=True, **args)
    assert pipe.iteration_s[0] < 0.9 * seq.iteration_s[0]
    cpu = float(lat.cpu_attention(np.array(512.0), np.array(512.0 * 2000), 8)) * lat.model.num_layers
    assert pipe.iteration_s[0] >= cpu


def test_streamed_weights_bound_the_layer_and_are_counted():
    lat = _lat()
    layer_bytes = 3 * lat.model.num_experts * lat.model.expert_params * lat.model.weight_bytes
    p, _ = price_microbatched(lat, _grid(256, 600), 32, cpu_attention=True, pipelined=True,
                              prefetch_bytes=layer_bytes)
    assert p.iteration_s[0] >= lat.model.num_moe_layers * float(lat.h2d(layer_bytes))
    assert p.h2d_bytes >= lat.model.num_moe_layers * layer_bytes


def _prepared(policy, model="mixtral_8x7b", n=2000, **knobs):
    job = make_job(policy, model, "a5000_1", inputs=np.full(n, 512), outputs=np.full(n, 256), policy_overrides=knobs)
    return prepare(job)


def test_searches_bound_the_expert_batch_by_gpu_memory():
    """FlexGen and MoE-Lightning pick micro-batches whose prefill activations fit beside the weight ring, and
    ZeRO-Inference a batch whose whole KV (at the longest sequence) fits the device."""
    for name in ("flexgen", "moe_lightning"):
        pr = _prepared(name)
        plan = pr.policy.block_plan()
        assert plan.kv_on_host and 1 <= plan.micro_batch <= 512 and plan.block >= 4 * plan.micro_batch
        assert pr.budget.activation_bytes <= 20e9
    z = _prepared("zero_inference")
    plan = z.policy.block_plan()
    assert not plan.kv_on_host and plan.micro_batch == 0
    assert plan.block * -(-(768 + 64) // 64) <= z.budget.kv_pages_per_gpu
    # twice the batch does not fit: its KV and prefill activations exceed the device (the batch is memory-bound)
    from batchgen.policy.offload.search import Rig, score
    job = make_job("zero_inference", "mixtral_8x7b", "a5000_1", inputs=np.full(2000, 512), outputs=np.full(2000, 256))
    rig = Rig.of(job.model, job.cluster, z.latency, job.memory, job.workload, job.page_tokens)
    assert score(rig, dataclasses.replace(z.policy, batch_size=2 * plan.block)) is None
    assert score(rig, z.policy) is not None


def test_offload_runs_have_small_expert_batches_and_static_blocks():
    """Simulated on the A5000: the decode per-expert batch of flexgen is at most one micro-batch's, far below
    coroutine's; a block's running set never grows while it decodes (static blocks)."""
    inputs, outputs = np.full(600, 512), np.random.default_rng(0).integers(50, 300, 600)
    rows = {}
    for name, knobs in (("flexgen", {"gpu_batch_size": 32, "num_gpu_batches": 8, "cache_on": "cpu"}),
                        ("coroutine", {"b_moe": 600, "b_attn": 128, "kv_residency": "host", "attention": "cpu"})):
        out = simulate(make_job(name, "mixtral_8x7b", "a5000_1", inputs=inputs, outputs=outputs, policy_overrides=knobs))
        rows[name] = summarize(out)
        if name == "flexgen":
            m = out.prepared.latency.model
            assert rows[name]["decode_expert_batch"] <= 32 * m.top_k / m.num_experts + 1e-9
            decode = [r for r in out.records if r.phase == "decode"]
            for a, b in zip(decode, decode[1:]):
                assert b.running <= a.running or b.start > a.start  # refills only between blocks
            assert max(r.running for r in decode) <= 256
    assert rows["coroutine"]["decode_expert_batch"] > 4 * rows["flexgen"]["decode_expert_batch"]


def test_bad_knobs_are_refused_before_work_starts():
    with pytest.raises(ValueError, match="cache_on"):
        make_policy({"name": "flexgen", "cache_on": "disk"})
    with pytest.raises(ValueError, match="gpu_batch_size"):
        make_policy({"name": "flexgen", "gpu_batch_size": 0})
    with pytest.raises(ValueError, match="kv_offload"):
        make_policy({"name": "zero_inference", "kv_offload": "yes"})
    with pytest.raises(ConfigError, match="cpu_delegation"):
        _prepared("flexgen", model="deepseek_v2", n=100, cpu_delegation=True)
    with pytest.raises(ConfigError, match="attention=cpu"):
        _prepared("moe_lightning", model="deepseek_v2", n=100, attention="cpu")


def test_a_search_scores_every_candidate_as_alone_when_it_shares_prices():
    """Within one search candidates share the prices they have in common (`score`'s memo): each one scores
    exactly as it does scored alone, and memo entries are shared across KV placements of one block shape."""
    from batchgen.policy.offload.search import Rig, score

    job = make_job("flexgen", "mixtral_8x7b", "a5000_1", inputs=np.full(300, 512), outputs=np.full(300, 256))
    pr = prepare(job)
    rig = Rig.of(job.model, job.cluster, pr.latency, job.memory, job.workload, job.page_tokens)
    candidates = [dataclasses.replace(c, max_prompt=rig.max_input) for c in job.policy.candidates(rig)]
    memo = {}
    shared = [score(rig, c, memo) for c in candidates]
    alone = [score(rig, c) for c in candidates]
    assert shared == alone and sum(s is not None for s in shared) > 10
    assert len(memo) < 2 * sum(s is not None for s in shared)  # some prices were shared


def test_on_a_cpu_device_restores_and_appends_take_their_turn_on_the_compute_cores():
    """The executor on a CPU restores, attends and appends on the thread that computes: nothing overlaps, so a
    staged layer costs the sum of its nodes. On a GPU the restores run on the h2d link beside the compute."""
    from batchgen.pricing.microbatch import _costs, _host_micro_batches
    from batchgen.specs import load_hardware

    gpu, cpu = _lat(), _lat()
    cpu.gpu = load_hardware("cpu_epyc_milan_2c")
    for lat, overlaps in ((gpu, True), (cpu, False)):
        grid = _grid(256, 600)
        price, _ = price_microbatched(lat, grid, 64, cpu_attention=False, pipelined=False)
        tokens, context, launches = _host_micro_batches(grid.host_tokens, grid.host_context, 64)
        c, _ = _costs(lat, tokens, context, launches, "staged", True, 1, 0.0)
        layer = sum(float(np.asarray(x).sum()) for part in (c.attn, c.ffn, c.moe, c.restore, c.append) for x in part)
        head = float(np.asarray(lat.lm_head(grid.gate_tokens) + lat.step_overhead(grid.gate_tokens)).max())
        serial = head + lat.model.num_layers * layer
        if overlaps:
            assert price.iteration_s[0] < 0.99 * serial
        else:
            assert price.iteration_s[0] == pytest.approx(serial, rel=1e-9)
