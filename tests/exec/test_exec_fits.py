"""A job the machine cannot hold is refused before any weight is built (batchgen.exec.fits)."""
import pytest
import torch

from batchgen.exec.fits import check_fits
from batchgen.memory import ConfigError
from conftest import make_job

GB = 1e9


def test_a_model_larger_than_free_memory_is_refused_with_its_size_and_the_fix():
    job = make_job("coroutine", model="qwen3_30b_a3b", n=4)
    with pytest.raises(ConfigError, match=r"30\.\dB parameters: 122\.\d GB of float32.*model=tiny_moe"):
        check_fits(job, None, 64, [torch.device("cpu")], torch.float32, 1, free=lambda d: int(24 * GB))
    # half the bytes in bf16, and a machine with room for them: accepted
    check_fits(job, None, 64, [torch.device("cpu")], torch.bfloat16, 1, free=lambda d: int(100 * GB))


def test_kv_budget_counts_for_every_rank_of_the_device():
    job = make_job("coroutine", model="tiny_moe", n=4)
    fits = dict(job=job, model_path=None, devices=[torch.device("cpu")], dtype=torch.float32)
    check_fits(**fits, kv_budget_mb=1024, ranks_per_instance=1, free=lambda d: int(2 * GB))
    with pytest.raises(ConfigError, match="backend.kv_budget_mb"):
        check_fits(**fits, kv_budget_mb=1024, ranks_per_instance=8, free=lambda d: int(2 * GB))


def test_unknown_free_memory_does_not_block():
    job = make_job("coroutine", model="qwen3_30b_a3b", n=4)
    check_fits(job, None, 64, [torch.device("cpu")], torch.float32, 1, free=lambda d: None)


def test_processes_that_each_build_the_whole_model_count_one_copy_each():
    """backend=dist: every process on the machine builds the whole model before keeping its expert shard."""
    job = make_job("coroutine", model="qwen3_30b_a3b", n=4)
    one = dict(job=job, model_path=None, kv_budget_mb=64, devices=[torch.device("cpu")], dtype=torch.bfloat16)
    check_fits(**one, ranks_per_instance=1, free=lambda d: int(100 * GB))  # 61 GB once: fits
    with pytest.raises(ConfigError, match=r"in each of 2 processes.*fewer processes \(backend.procs\)"):
        check_fits(**one, ranks_per_instance=2, weight_copies=2, free=lambda d: int(100 * GB))


def test_backend_dist_refuses_a_model_the_machine_cannot_build_once_per_process(monkeypatch):
    import functools

    from batchgen.dist import run as dist_run
    from batchgen.dist.run import DistSettings, check_dist

    monkeypatch.setattr(dist_run, "check_fits", functools.partial(check_fits, free=lambda d: int(150 * GB)))
    job = make_job("coroutine", model="qwen3_30b_a3b", n=4, cluster_overrides={"num_gpus": 2})
    with pytest.raises(ConfigError, match="in each of 2 processes"):  # 122 GB of fp32 weights fit once, not twice
        check_dist(job, DistSettings(device="cpu", procs=2, kv_budget_mb=512))


def test_backend_dist_counts_what_data_parallel_prefill_keeps_beside_the_model(monkeypatch):
    """Under policy.prefill_parallel=dp each process keeps its expert shard and two ring slots beside the host
    copy of every expert (the layers it built): Qwen3-30B-A3B in fp32 over 2 processes, 122 GB a model, fits 300
    GB free twice (245 GB with the KV budgets), not with 63 GB more per process."""
    import functools

    from batchgen.dist import settings as dist_settings
    from batchgen.dist.run import DistSettings, check_dist

    monkeypatch.setattr(dist_settings, "check_fits", functools.partial(check_fits, free=lambda d: int(300 * GB)))
    settings = DistSettings(device="cpu", procs=2, kv_budget_mb=512, host_kv_gb=1.0)
    job = make_job("coroutine", model="qwen3_30b_a3b", n=4, cluster_overrides={"num_gpus": 2},
                   policy_overrides={"attention_tp": 1})
    check_dist(job, settings)
    dp = make_job("coroutine", model="qwen3_30b_a3b", n=4, cluster_overrides={"num_gpus": 2},
                  policy_overrides={"attention_tp": 1, "prefill_parallel": "dp"})
    with pytest.raises(ConfigError, match="data-parallel prefill's expert shards and ring"):
        check_dist(dp, settings)


# ---- the host KV pools (host copies of every node's sequences) ---------------------------------------------
from batchgen.exec.host_pool import tokens_within  # noqa: E402


def _no_weights(*args, **kwargs):
    raise AssertionError("the job should have been refused before any weight was built")


def test_a_host_kv_budget_the_machine_cannot_hold_is_refused_before_any_weight(monkeypatch):
    from batchgen.exec import run as exec_run
    from batchgen.exec.run import ExecSettings, execute

    monkeypatch.setattr(exec_run, "build_model", _no_weights)
    monkeypatch.setattr(exec_run, "free_bytes", lambda d: int(16 * GB))
    job = make_job("coroutine", n=4, cluster_overrides={"num_gpus": 2, "gpus_per_node": 1})  # two nodes
    with pytest.raises(ConfigError, match=r"backend.host_kv_gb=10 .*2 nodes.*16\.0 GB free.*lower backend.host_kv_gb"):
        execute(job, ExecSettings(device="cpu", host_kv_gb=10))


def test_a_sequence_longer_than_the_host_kv_budget_is_refused_before_any_weight(monkeypatch):
    from batchgen.exec import run as exec_run
    from batchgen.exec.run import ExecSettings, execute

    monkeypatch.setattr(exec_run, "build_model", _no_weights)
    job = make_job("coroutine", n=4, inputs=[300] * 4, outputs=[100] * 4, page_tokens=16)
    # tiny_moe in fp32: 4,096 bytes of KV per token, so 1 MB holds 256 tokens
    with pytest.raises(ConfigError, match=r"sequence 0 needs 400 tokens of KV .* raise backend.host_kv_gb"):
        execute(job, ExecSettings(device="cpu", host_kv_gb=0.001))


@pytest.mark.usefixtures("one_thread")
def test_the_state_plans_within_the_host_kv_the_executor_can_hold(monkeypatch):
    """The policy's host budget is the executor's: its host pools (one per node) hold that much and refuse to grow
    past it; without backend.host_kv_gb it comes from the memory the machine has available."""
    from batchgen.exec import run as exec_run
    from batchgen.exec.run import ExecSettings, execute

    job = make_job("coroutine", n=12, inputs=[40] * 12, outputs=[24] * 12, page_tokens=8,
                   cluster_overrides={"num_gpus": 2, "gpus_per_node": 2}, policy_overrides={"b_moe": 4})
    budget = 0.0016  # GB per node: 48 pages of 8 tokens (32 KB each); the job's KV is 12 x 64 tokens
    out = execute(job, ExecSettings(device="cpu", host_kv_gb=budget, kv_budget_mb=0.5))
    (pool,) = out.host_pools  # one node: its GPUs share one host pool
    assert pool["budget_pages"] == int(budget * GB) // (8 * 4096) == 48
    assert pool["peak_pages"] <= pool["capacity_pages"] <= pool["budget_pages"]
    state = out.prepared.state
    # what the pool surely holds, whatever the copies' last pages leave empty (copies of >= 40 tokens take at most
    # 6 pages per 40 tokens: 48 pages hold 320 tokens)
    assert state.host_kv_tokens.tolist() == [tokens_within(48, 8, 40, 12)] == [320]
    assert 0 < state.peak_host[0] <= 320 and all(len(g) == 24 for g in out.tokens.generated)
    # from the machine's available memory, when not given
    monkeypatch.setattr(exec_run, "free_bytes", lambda d: int(1 * GB))
    settings = ExecSettings(device="cpu", kv_budget_mb=0.5)
    auto = exec_run.host_pools(job, settings, exec_run.model_config(job, settings), torch.float32,
                               [torch.device("cpu")], 1, 1, 2)
    # 0.9 of the free GB, less the weights (56 MB of fp32) and the ranks' device KV (here on the CPU too)
    assert 0.8 * GB < auto.budget_pages * auto.page_bytes <= 0.9 * GB - 2 * 0.5 * 2**20
    assert auto.tokens == tokens_within(auto.budget_pages, 8, 40, 12) and "free memory" in auto.setting
