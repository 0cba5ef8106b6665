"""Simulated runs with host-resident decode: priced on the per-layer DAG, every byte counted, the plan used."""

import dataclasses

import numpy as np
import pytest

from batchgen.job import prepare
from batchgen.memory import ConfigError
from batchgen.sim.run import simulate
from batchgen.specs import HostSpec
from conftest import make_job

N = 600


def mixtral_job(n=N, output=48, **policy):
    """Mixtral-8x7B on one A5000 (weights streamed, KV pages for ~100 sequences), short outputs."""
    knobs = {"b_attn": 128, "attention": "gpu", "prefill_tokens_per_rank": 8192, **policy}
    return make_job("coroutine", "mixtral_8x7b", "a5000_1", np.full(n, 512), np.full(n, output),
                    policy_overrides=knobs, check_invariants=False)


def decode_steps(out):
    return [r for r in out.records if r.phase == "decode"]


def expert_batch(out):
    steps = decode_steps(out)
    return sum(r.expert_tokens for r in steps) / sum(r.expert_calls for r in steps)


def test_host_resident_decode_grows_the_expert_batch_past_device_kv():
    device = simulate(mixtral_job(b_moe=4096, kv_residency="device"))
    host = simulate(mixtral_job(b_moe=4096, kv_residency="host"))
    for out in (device, host):
        t, s = out.prepared.state.table, out.prepared.state
        assert np.array_equal(t.decoded, t.output_len) and np.all(t.where == -3)  # all finished, once
        assert np.all(s.peak_pages <= s.gpu_pages) and np.all(s.peak_host <= s.host_kv_tokens)
    assert expert_batch(host) > 3 * expert_batch(device)
    assert host.prepared.state.peak_pages.max() == 0  # host-resident: no device pages at all
    bct = {k: float(o.prepared.state.table.finish_time.max()) for k, o in (("device", device), ("host", host))}
    assert bct["host"] < bct["device"]
    # more bytes per iteration (KV restores on top of the streamed experts), fewer in all (fewer iterations)
    assert host.host_bytes_per_iteration > device.host_bytes_per_iteration > 0
    assert 0 < host.host_bytes < device.host_bytes


def test_restore_bound_runs_get_faster_with_a_wider_link():
    """KV restores do not hide behind compute here: doubling PCIe bandwidth shortens the run; the part the GPU
    waited for shows in rank_comm (there is no all-to-all on one GPU)."""
    def run(pcie):
        job = mixtral_job(n=200, output=16, b_moe=256, kv_residency="host")
        cluster = dataclasses.replace(job.cluster, gpu=dataclasses.replace(job.cluster.gpu, pcie_gbs=pcie),
                                      host=HostSpec(name="big", sockets=2, cores_per_socket=64,
                                                    dram_gbs_per_socket=1000, tflops_per_socket=5))
        return simulate(dataclasses.replace(job, cluster=cluster))
    slow, fast = run(32.0), run(64.0)
    decode = lambda out: sum(r.duration for r in decode_steps(out))  # noqa: E731
    assert decode(fast) < 0.75 * decode(slow)
    assert all(r.rank_comm.sum() > 0 for r in decode_steps(slow))
    assert slow.host_bytes == pytest.approx(fast.host_bytes)  # the same bytes, moved faster


def test_cpu_attention_moves_no_kv_over_pcie():
    gpu = simulate(mixtral_job(n=200, output=16, b_moe=256, kv_residency="host"))
    cpu = simulate(mixtral_job(n=200, output=16, b_moe=256, kv_residency="host", attention="cpu"))
    assert cpu.host_bytes_per_iteration < gpu.host_bytes_per_iteration
    assert np.array_equal(cpu.prepared.state.table.decoded, cpu.prepared.state.table.output_len)


def test_auto_knobs_are_planned_and_the_run_uses_the_plan():
    job = mixtral_job(n=200, output=16, b_attn="auto", b_moe="auto", kv_residency="auto", attention="auto")
    prepared = prepare(job)
    plan, policy = prepared.plan, prepared.policy
    assert plan is not None and "auto" not in (policy.b_attn, policy.b_moe, policy.kv_residency, policy.attention)
    assert (policy.b_attn, policy.b_moe, policy.kv_residency) == (plan.b_attn, plan.b_moe, plan.kv_residency)
    assert prepared.budget.streamed_layers == plan.streamed_layers > 0  # the memory plan follows the plan
    out = simulate(job)
    assert out.prepared.policy == policy
    assert max(r.running for r in decode_steps(out)) > 100  # more than the device KV alone would run


def test_explicit_knobs_are_not_planned():
    job = mixtral_job(n=50, output=8, b_attn=64, b_moe=128, kv_residency="mixed", attention="gpu")
    prepared = prepare(job)
    assert prepared.plan is None and prepared.policy == job.policy


def test_cpu_attention_is_refused_for_mla():
    job = make_job("coroutine", "deepseek_r1", "h20_8", np.full(8, 100), np.full(8, 10),
                   policy_overrides={"attention": "cpu"})
    with pytest.raises(ConfigError, match="MLA"):
        prepare(job)


def test_a_prompt_whose_one_token_is_its_last_is_not_priced_as_offloaded():
    """Prefill bound for host: a sequence that ends with its prefill's token stays where it is (the executors
    write nothing down for it), so the simulator charges its KV no device -> host copy; one that runs on does."""
    one_gpu = {"num_gpus": 1, "gpus_per_instance": None}
    done = simulate(make_job("coroutine", "tiny_moe", "h100_8", np.full(8, 100), np.ones(8, np.int64),
                             cluster_overrides=one_gpu), progress=False)
    assert done.host_bytes == 0.0
    on = simulate(make_job("coroutine", "tiny_moe", "h100_8", np.full(8, 100), np.full(8, 2),
                           cluster_overrides=one_gpu), progress=False)
    assert on.host_bytes == 2 * 8 * 100 * on.prepared.state.kv_bytes_per_token  # written down, then restored
