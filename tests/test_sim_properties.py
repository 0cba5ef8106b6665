"""Properties of every simulated run, over random workloads, clusters and policies."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from batchgen.core.sequences import FINISHED
from batchgen.memory import ConfigError, MemorySettings, host_weight_bytes
from batchgen.sim.run import simulate
from conftest import make_job

POLICIES = ["coroutine", "continuous", "static", "sglang_opt", "flexgen", "moe_lightning", "zero_inference",
            "pd_disagg"]

jobs = st.fixed_dictionaries({
    "policy": st.sampled_from(POLICIES),
    "model": st.sampled_from(["tiny_moe", "qwen3_30b_a3b", "mixtral_8x7b"]),
    "cluster": st.sampled_from(["h100_8", "h20_16", "a100_8"]),
    "num_gpus": st.sampled_from([1, 2, 8, 16]),
    "instances": st.sampled_from([1, 2, 4]),
    "n": st.integers(1, 120),
    "max_in": st.integers(1, 3000),
    "max_out": st.integers(1, 1500),
    "seed": st.integers(0, 2**16),
    "page_tokens": st.sampled_from([16, 64]),
    "kv_gb": st.sampled_from([None, 0.5]),
    "host_seqs": st.sampled_from([None, 2, 6]),
    "routing_skew": st.sampled_from([0.0, 1.2]),
    "residency": st.sampled_from(["device", "host", "mixed"]),  # coroutine only: where running KV lives
    "b_moe": st.sampled_from([4, 64, 2048]),
    "cpu_attention": st.booleans(),
    "chunked": st.booleans(),                       # continuous only: chunked prefill ...
    "token_budget": st.sampled_from([16, 300, 8192]),  # ... within this many tokens per rank per forward
    "admission": st.sampled_from(["greedy", "conservative"]),  # ... admitting as vLLM or as SGLang does, ...
    "reserve_max_tokens": st.sampled_from([0, 64, 2000]),  # ... with this max_tokens (0: context - prompt)
})


def build(p):
    rng = np.random.default_rng(p["seed"])
    inputs = rng.integers(1, p["max_in"] + 1, p["n"])
    outputs = rng.integers(1, p["max_out"] + 1, p["n"])
    knobs = ({"kv_residency": p["residency"], "b_moe": p["b_moe"],
              "attention": "cpu" if p["cpu_attention"] else "gpu"} if p["policy"] == "coroutine" else {})
    if p["policy"] == "continuous":
        knobs = {"chunked_prefill": p["chunked"], "token_budget": p["token_budget"],
                 "admission": p["admission"] if p["chunked"] else "greedy",
                 "reserve_max_tokens": p["reserve_max_tokens"]}
    job = make_job(p["policy"], p["model"], p["cluster"], inputs, outputs, page_tokens=p["page_tokens"],
                   routing_skew=p["routing_skew"], policy_overrides=knobs)
    per_instance = max(p["num_gpus"] // p["instances"], 1)
    cluster = dataclasses.replace(job.cluster, num_gpus=p["num_gpus"], gpus_per_instance=per_instance)
    memory = MemorySettings()
    if p["kv_gb"]:  # squeeze the KV pool so that yields, evictions and preemptions happen
        from batchgen.job import prepare
        probe = prepare(dataclasses.replace(job, cluster=cluster))
        weights_gb = (probe.budget.weights_per_gpu_bytes + probe.budget.activation_bytes) / 1e9
        need = (p["max_in"] + p["max_out"] + 2 * p["page_tokens"]) * job.model.kv_bytes_per_token / 1e9
        usable = cluster.gpu.hbm_bytes / 1e9 * memory.gpu_memory_fraction
        memory = MemorySettings(activation_reserve_gb=max(usable - weights_gb - max(p["kv_gb"], need * 3), 0))
    if p["host_seqs"]:  # squeeze host memory to a few sequences' worth: host-KV policies must evict
        from batchgen.job import prepare
        probe = prepare(dataclasses.replace(job, cluster=cluster, memory=memory))
        weights_node = host_weight_bytes(job.model, probe.latency, probe.cluster.node_size)
        tokens = p["host_seqs"] * (p["max_in"] + p["max_out"] + 2 * p["page_tokens"])
        host = weights_node + tokens * job.model.kv_bytes_per_token
        memory = dataclasses.replace(memory, host_memory_fraction=min(host / (cluster.host_mem_gb_per_node * 1e9), 1.0))
    return dataclasses.replace(job, cluster=cluster, memory=memory)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs)
@example({  # coroutine offloaded a sequence and rebalanced it in the same boundary: two moves of one sequence
    "policy": "coroutine", "model": "mixtral_8x7b", "cluster": "h100_8", "num_gpus": 8, "instances": 1, "n": 105,
    "max_in": 265, "max_out": 172, "seed": 1, "page_tokens": 64, "kv_gb": 0.5, "host_seqs": None,
    "routing_skew": 0.0, "residency": "mixed", "b_moe": 2048, "cpu_attention": False, "chunked": False,
    "token_budget": 16, "admission": "greedy", "reserve_max_tokens": 0})
def test_every_sequence_finishes_once_with_its_length_and_memory_holds(p):
    try:
        job = build(p)
        out = simulate(job)  # check_invariants=True: bookkeeping recounted at every boundary
    except ConfigError:
        assume(False)  # an impossible job (weights or a sequence that fit nowhere) is rejected up front
        return  # check_invariants=True: bookkeeping recounted at every boundary
    state = out.prepared.state
    t = state.table
    assert np.all(t.where == FINISHED)
    assert np.array_equal(t.decoded, t.output_len)
    assert state.num_finished == len(t)
    assert np.all(state.peak_pages <= state.gpu_pages)
    assert np.all(state.peak_host <= state.host_kv_tokens)
    assert np.all(np.isfinite(t.finish_time)) and np.all(t.finish_time > 0)
    assert np.all(t.first_token_time <= t.finish_time + 1e-12)
    # the clock never goes backwards: each instance's steps start where the previous one ended
    for inst in range(state.topo.num_instances):
        steps = [r for r in out.records if r.instance == inst]
        starts = np.array([r.start for r in steps])
        ends = starts + np.array([r.duration for r in steps])
        assert np.all(np.diff(starts) >= 0)
        assert np.all(starts[1:] >= ends[:-1] - 1e-9)
        assert all(r.duration >= 0 for r in steps)
    assert t.finish_time.max() <= max(r.start + r.duration for r in out.records) + 1e-9


class ChunkRules:
    """A step observer that checks chunked prefill's rules after every forward: chunks plus decode tokens stay
    within each rank's token budget, and every running sequence done prefilling took part in the forward (decode
    never stalls while prompts wait or are part-way through)."""

    def __init__(self, budget: int):
        self.state, self.budget, self.chunked_forwards, self.split = None, budget, 0, 0

    def __call__(self, plan, result) -> None:
        t = self.state.table
        R = plan.gpus.size
        if plan.chunk_ids.size:
            self.chunked_forwards += 1
            self.split += int((~plan.chunk_completes).sum())
            tokens = np.bincount(plan.chunk_rank, weights=plan.chunk_len, minlength=R)
            decodes = np.bincount(plan.decode_rank, minlength=R)
            assert np.all(plan.chunk_len >= 1)
            assert np.all((tokens == 0) | (tokens + decodes <= self.budget)), (tokens, decodes)
            assert np.array_equal(plan.chunk_completes, t.prefilled[plan.chunk_ids] == 0)
            left = plan.chunk_ids[~plan.chunk_completes]  # part-way through: progress as far as this chunk
            assert np.array_equal(t.prefilled[left], (plan.chunk_start + plan.chunk_len)[~plan.chunk_completes])
        running = self.state.active[plan.instance]
        done_prefilling = running[t.prefilled[running] == 0]
        ran = np.concatenate([plan.decode_ids, plan.chunk_ids])
        assert np.isin(done_prefilling, ran).all(), "a running sequence sat out a forward"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs)
def test_chunked_prefill_keeps_its_budget_and_never_stalls_decode(p):
    p = {**p, "policy": "continuous", "chunked": True, "max_out": min(p["max_out"], 300)}
    import batchgen.sim.run as sim_run
    rules, real_prepare = ChunkRules(p["token_budget"]), sim_run.prepare

    def spy(*args, **kwargs):  # the observer needs the run's state, which simulate() builds
        prepared = real_prepare(*args, **kwargs)
        rules.state = prepared.state
        return prepared
    try:
        sim_run.prepare = spy
        out = simulate(build(p), on_step=rules)
    except ConfigError:
        assume(False)
        return
    finally:
        sim_run.prepare = real_prepare
    t = out.prepared.state.table
    assert np.all(t.where == FINISHED) and np.array_equal(t.decoded, t.output_len)
    assert np.all(t.prefilled == 0)


def test_chunked_prefill_splits_long_prompts_and_decodes_beside_them():
    """A budget smaller than the prompts: every prompt is split over several forwards, running sequences decode
    in each of them, and the old rule (whole prompts first) still runs unchanged when asked for."""
    import batchgen.sim.run as sim_run
    inputs, outputs = np.random.default_rng(1).integers(100, 400, 40), np.random.default_rng(2).integers(1, 200, 40)
    rules, real_prepare = ChunkRules(64), sim_run.prepare

    def spy(*args, **kwargs):
        prepared = real_prepare(*args, **kwargs)
        rules.state = prepared.state
        return prepared
    job = make_job("continuous", inputs=inputs, outputs=outputs, cluster_overrides={"num_gpus": 2},
                   policy_overrides={"token_budget": 64})
    try:
        sim_run.prepare = spy
        out = simulate(job, on_step=rules)
    finally:
        sim_run.prepare = real_prepare
    assert rules.split >= 40  # each prompt (100-400 tokens) took several forwards
    assert {"mixed", "decode"} <= {r.phase for r in out.records}
    old = simulate(make_job("continuous", inputs=inputs, outputs=outputs, cluster_overrides={"num_gpus": 2},
                            policy_overrides={"chunked_prefill": False}))
    assert {r.phase for r in old.records} == {"prefill", "decode"}


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_result(policy):
    a = simulate(make_job(policy, "qwen3_30b_a3b", "h20_16", n=300, seed=7))
    b = simulate(make_job(policy, "qwen3_30b_a3b", "h20_16", n=300, seed=7))
    assert np.array_equal(a.prepared.state.table.finish_time, b.prepared.state.table.finish_time)
    assert [r.duration for r in a.records] == [r.duration for r in b.records]
    c = simulate(make_job(policy, "qwen3_30b_a3b", "h20_16", n=300, seed=8))
    assert not np.array_equal(a.prepared.state.table.finish_time, c.prepared.state.table.finish_time)


@pytest.mark.parametrize("residency", ["host", "mixed"])
def test_host_resident_decode_runs_more_sequences_than_device_kv_holds(residency):
    """With host-resident KV the running set is bounded by b_moe and host memory, not by device pages (the
    bookkeeping, recounted at every boundary, keeps host-resident sequences page-free); with device-resident KV
    it is bounded by the pages."""
    from batchgen.job import prepare
    inputs, outputs = np.full(64, 200), np.full(64, 300)
    running = {}
    for mode in ("device", residency):
        job = make_job("coroutine", "tiny_moe", "h100_8", inputs, outputs, cluster_overrides={"num_gpus": 1},
                       policy_overrides={"kv_residency": mode, "b_moe": 64, "b_attn": 16, "attention": "gpu"})
        probe = prepare(job)
        usable = job.cluster.gpu.hbm_bytes / 1e9 * job.memory.gpu_memory_fraction
        kv_gb = 4 * 600 * job.model.kv_bytes_per_token / 1e9  # about four sequences' KV
        reserve = usable - (probe.budget.weights_per_gpu_bytes + probe.budget.activation_bytes) / 1e9 - kv_gb
        out = simulate(dataclasses.replace(job, memory=MemorySettings(activation_reserve_gb=reserve)))
        state = out.prepared.state
        assert np.array_equal(state.table.decoded, state.table.output_len)
        assert np.all(state.peak_pages <= state.gpu_pages)
        running[mode] = max(r.running for r in out.records if r.phase == "decode")
        holds = int(state.gpu_pages[0]) // -(-(200 + 1 + job.page_tokens) // job.page_tokens)
    assert running["device"] <= holds
    assert running[residency] >= 4 * holds
