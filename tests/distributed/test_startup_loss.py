"""A process lost at start-up, before the first step (startup.py): nothing has run, so the run starts again on
the others and finishes with the undisturbed tokens, within seconds of the loss, never after a store timeout
(backend.timeout_s is 120 s here); where the others cannot hold the job, it stops at once saying why."""

from __future__ import annotations

import importlib
import os
import signal
import time

import pytest

from batchgen.dist import run as run_module
from batchgen.dist import startup as startup_module
from batchgen.dist.errors import DistConfigError
from batchgen.dist.run import DistRunFailed, execute_dist
from tests.distributed.test_dist_backend import N, dist_settings, job_for
from tests.distributed.test_recovery import reference

pytestmark = pytest.mark.usefixtures("one_thread")
launch_module = importlib.import_module("batchgen.dist.launch")  # the module (the package exports a function)


def _signal_once(rank: int, sig: int, flag) -> None:
    """The process of launch rank `rank` sends itself `sig`, in the first start only (`flag`: a file that the
    restarted processes find)."""
    if os.environ.get("RANK") == str(rank) and not flag.exists():
        flag.write_text("1")
        os.kill(os.getpid(), sig)


def _patch(monkeypatch, moment: str, rank: int, sig: int, flag) -> None:
    if moment == "joining the world group":  # before the heartbeat runs: the launcher sees it
        join = launch_module.join_group

        def dying(*args, **kw):
            _signal_once(rank, sig, flag)
            return join(*args, **kw)
        monkeypatch.setattr(launch_module, "join_group", dying)
    elif moment == "building the model":  # under the heartbeat, before the group meets again
        build = run_module.build_model

        def dying(*args, **kw):
            _signal_once(rank, sig, flag)
            return build(*args, **kw)
        monkeypatch.setattr(run_module, "build_model", dying)
    else:  # "creating the groups": inside the creation, which waits on the store for every member
        create = run_module.control_groups

        def dying(*args, **kw):
            _signal_once(rank, sig, flag)
            return create(*args, **kw)
        monkeypatch.setattr(run_module, "control_groups", dying)


@pytest.mark.slow  # two starts of 3 processes: 5-20 s on the loaded 2-core machine
@pytest.mark.parametrize("moment,sig,rank", [("joining the world group", signal.SIGKILL, 2),
                                             ("joining the world group", signal.SIGSTOP, 2),
                                             ("building the model", signal.SIGKILL, 2),
                                             ("building the model", signal.SIGSTOP, 0),
                                             ("creating the groups", signal.SIGSTOP, 2)])
def test_a_process_lost_at_start_up_and_the_run_starts_again_without_it(saved, loop_kernel, monkeypatch, tmp_path,
                                                                         moment, sig, rank):
    """Rank 0 too: nothing has run, so its loss costs nothing either (its stopped process is killed by the
    launcher once every other one has ended)."""
    _, path = saved
    _patch(monkeypatch, moment, rank, sig, tmp_path / "signalled")
    t0 = time.monotonic()
    out = execute_dist(job_for(3)[0], dist_settings(path, 3, timeout_s=120.0, lost_after_s=3.0))
    took = time.monotonic() - t0
    assert took < 60, f"{took:.1f} s: a store timeout, not the launcher or the heartbeat, ended the start"
    ref = reference(path, 3)
    assert [out.tokens.generated[s] for s in range(N)] == [ref.tokens.generated[s] for s in range(N)]
    assert out.procs == 2 and not out.recoveries and len(out.restarts) == 1, out.restarts
    assert f"rank {rank} lost" in out.restarts[0] or f"rank {rank} was stopped" in out.restarts[0] \
        or f"rank {rank} ended" in out.restarts[0], out.restarts
    assert "started again on 2 processes" in out.restarts[0], out.restarts


def test_a_start_up_loss_the_others_cannot_hold_stops_at_once_saying_why(saved, loop_kernel, monkeypatch,
                                                                          tmp_path):
    _, path = saved
    _patch(monkeypatch, "building the model", 1, signal.SIGKILL, tmp_path / "signalled")

    def refuse(job, settings, launched=True):
        raise DistConfigError(f"{settings.procs} processes cannot hold this model")
    monkeypatch.setattr(startup_module, "check_dist", refuse)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as e:
        execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=120.0))
    assert time.monotonic() - t0 < 30
    line = e.value.headline
    assert "rank 1 lost during start-up" in line and "nothing ran" in line, line
    assert "cannot start again on the other 1 processes: 1 processes cannot hold this model" in line, line


def test_rank_0_says_who_was_lost_at_start_up():
    """The others call rank 0 lost once it has ended (it ends too, after a loss at start-up): its own list is
    the one to start again without; without rank 0's word, rank 0 and whoever died by a signal."""
    from batchgen.dist.launch import WorkerResult as R
    from batchgen.dist.startup import StartupLoss, lost_at_start

    ended = [R(0, 1, StartupLoss([2], "a"), "LostAtStart"), R(1, 1, StartupLoss([0, 2], "b"), "LostAtStart"),
             R(2, -9)]
    assert lost_at_start(ended) == {2}
    rank0_gone = [R(0, None, None, "stopped by a signal after every other process had ended: killed"),
                  R(1, 1, StartupLoss([0], "c"), "LostAtStart"), R(2, 1, StartupLoss([0, 1], "d"), "LostAtStart")]
    assert lost_at_start(rank0_gone) == {0}
    assert lost_at_start([R(0, 0, object()), R(1, 0)]) is None
