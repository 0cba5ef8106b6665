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
