"""Properties of every simulated run, over random workloads, clusters and policies."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchgen.core.sequences import FINISHED
from batchgen.memory import ConfigError, MemorySettings, host_weight_bytes
from batchgen.sim.run import simulate
from conftest import make_job

POLICIES = ["coroutine", "continuous", "static"]

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
})


def build(p):
    rng = np.random.default_rng(p["seed"])
    inputs = rng.integers(1, p["max_in"] + 1, p["n"])
    outputs = rng.integers(1, p["max_out"] + 1, p["n"])
    knobs = ({"kv_residency": p["residency"], "b_moe": p["b_moe"],
              "attention": "cpu" if p["cpu_attention"] else "gpu"} if p["policy"] == "coroutine" else {})
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
        usable = cluster.gpu.hbm_gb * memory.gpu_memory_fraction
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
        usable = job.cluster.gpu.hbm_gb * job.memory.gpu_memory_fraction
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
