"""Bad multi-process configurations are refused before anything starts, with what to change."""

from types import SimpleNamespace

import pytest
import torch

from batchgen.dist import DistConfigError, DistEnv, ExpertPlacement, check_procs, instance_ranks, launch
from batchgen.exec.models.config import ExecModelConfig
from batchgen.exec.models.loading import init_random


def test_contiguous_placement_blocks():
    p = ExpertPlacement.contiguous(10, 4)
    assert [p.experts_of(r) for r in range(4)] == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
    owner, slot = p.tables()
    assert owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert slot.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    assert p.max_local == 3


@pytest.mark.parametrize("make, match", [
    (lambda: ExpertPlacement.contiguous(2, 3), "at most 2 processes"),
    (lambda: ExpertPlacement((0, 0, 2), 3), "ranks \\[1\\] own no expert"),
    (lambda: ExpertPlacement((0, 3), 2), "outside ranks 0..1"),
    (lambda: check_procs(0), "positive integer"),
    (lambda: check_procs(9, num_experts=8), "at most 8 processes"),
    (lambda: check_procs(2, world_size=4), "set backend.procs=4"),
    (lambda: instance_ranks(4, [2, 1]), "need 3 processes in all"),
    (lambda: instance_ranks(4, [4, 0]), "at least one process"),
    (lambda: DistEnv.from_env({"RANK": "0"}), "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset"),
    (lambda: DistEnv.from_env(dict(RANK="2", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="x", MASTER_PORT="1")),
     "RANK=2 must be in 0..WORLD_SIZE-1"),
    (lambda: launch(print, 0), "positive integer"),
])
def test_bad_config_is_refused(make, match):
    with pytest.raises(DistConfigError, match=match):
        make()


def test_instance_ranks_are_consecutive_blocks():
    assert instance_ranks(5, [2, 3]) == [(0, 1), (2, 3, 4)]


@torch.no_grad()
def test_expert_shard_holds_only_its_experts_and_refuses_the_full_path():
    cfg = ExecModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=24)
    moe = init_random(cfg, seed=3, std=0.3).moe(0)
    shard = moe.expert_shard([3, 1])
    assert type(shard) is type(moe) and shard.gate is moe.gate and shard.num_experts == 4
    assert torch.equal(shard.w_down[0], moe.w_down[3]) and torch.equal(shard.w_gate[1], moe.w_gate[1])
    assert moe.w_gate.shape[0] == 4  # the original keeps every expert
    x = torch.randn(5, 16)
    with pytest.raises(RuntimeError, match="holds 2 of 4 experts"):
        shard(x)
    with pytest.raises(ValueError, match="outside 0..3"):
        moe.expert_shard([4])


@pytest.mark.parametrize("procs,threads,device,cores,warned", [
    (8, 1, "cpu", 2, True),      # the case: 8 processes on 2 cores, 1.7x slower
    (2, 1, "cpu", 2, False),
    (2, 2, "cpu", 2, True),      # 2 processes x 2 threads on 2 cores
    (2, None, "cpu", 2, False),  # threads unset: one each
    (4, 8, "cuda", 4, False),    # on GPUs each process drives its device: its threads are not counted
    (8, 1, "cuda", 4, True),
])
def test_more_processes_than_cores_is_warned(procs, threads, device, cores, warned):
    from batchgen.dist.settings import oversubscription

    message = oversubscription(procs, threads, device, cores)
    assert (message is not None) is warned
    if warned:
        assert f"backend.procs={procs}" in message and f"gives {cores}" in message and "backend.procs<=" in message


def test_the_launcher_prints_the_warning_before_it_starts(monkeypatch, capsys):
    """execute_dist warns on stderr, in one line, before any process starts (the launch itself is stubbed)."""
    from batchgen.dist import run as dist_run

    class Started(Exception):
        pass

    def no_launch(*args, **kwargs):
        raise Started

    monkeypatch.setattr(dist_run, "check_dist", lambda job, settings: None)
    monkeypatch.setattr(dist_run, "available_cores", lambda: 2)
    monkeypatch.setattr(dist_run, "launch", no_launch)
    monkeypatch.setattr(dist_run, "under_torchrun", lambda: False)
    job = SimpleNamespace(policy=SimpleNamespace(attention_tp=1))
    settings = dist_run.DistSettings(procs=8, device="cpu", shared_host_copies=False)
    with pytest.raises(Started):
        dist_run.execute_dist(job, settings)
    err = capsys.readouterr().err
    assert err.startswith("warning: backend.procs=8: 8 processes x 1 thread need 8 cores but this machine gives 2")
    assert err.count("\n") == 1
