"""A second loss after rank 0 commits the survivors' new generation, before the engine runs again (issue 26,
item 2: "during a second loss"): the survivors regroup once more and finish with the undisturbed run's tokens.

Rank 1 is SIGKILLed at its 30th forward; the others regroup into generation 1, and the last rank SIGKILLs
itself either while the survivors settle their caches (before the commit: the attempt is abandoned and
generation 2 is formed without it) or right after it has read rank 0's commit (the engine of generation 1
finds it lost and a second recovery forms generation 2). backend.timeout_s is 120 s: a store timeout would
show in the run's time."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchgen.dist import rejoin as rejoin_module
from batchgen.dist import run as run_module
from batchgen.dist.run import execute_dist
from tests.distributed.test_dist_backend import N, dist_settings, job_for
from tests.distributed.test_recovery import reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _die_on(rank: int):
    if os.environ.get("RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # four processes, two losses: 10-30 s on the loaded 2-core machine
@pytest.mark.parametrize("moment", ["settling the caches", "after the commit"])
def test_a_loss_after_the_regroup_before_the_engine_runs_is_recovered_from(saved, loop_kernel, kill_at, monkeypatch,
                                                                          moment):
    procs, victim = 4, 3
    if moment == "settling the caches":
        settle = run_module.settle_caches

        def dying_settle(worker, *args, **kw):
            _die_on(victim)
            return settle(worker, *args, **kw)
        monkeypatch.setattr(run_module, "settle_caches", dying_settle)
    else:
        commit = rejoin_module._commit

        def dying_commit(base, survivors, number):
            commit(base, survivors, number)
            _die_on(victim)
        monkeypatch.setattr(rejoin_module, "_commit", dying_commit)
    _, path = saved
    kill_at(1, 30)
    t0 = time.monotonic()
    out = execute_dist(job_for(procs)[0], dist_settings(path, procs, timeout_s=120.0))
    took = time.monotonic() - t0
    assert took < 90, f"{took:.1f} s: a store timeout, not the heartbeat, ended a wait"
    ref = reference(path, procs)
    assert [out.tokens.generated[s] for s in range(N)] == [ref.tokens.generated[s] for s in range(N)]
    assert out.prepared.state.all_finished()
    lost = [r.lost for r in out.recoveries]
    if moment == "settling the caches":  # one recovery, whose first attempt was abandoned
        assert lost == [[1, victim]] and out.recoveries[0].generation == 2, out.recoveries
        assert "then" in out.recoveries[0].cause
    else:  # two recoveries: generation 1 committed, then lost a member
        assert lost == [[1], [victim]] and [r.generation for r in out.recoveries] == [1, 2], out.recoveries
    assert out.recoveries[-1].survivors == [0, 2]
