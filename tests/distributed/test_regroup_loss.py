"""A second loss while the survivors regroup (issue 26, item 2): the survivors regroup again without it and
finish with the undisturbed run's tokens, within seconds of each loss, never after a store timeout.

Rank 1 is SIGKILLed at its 30th forward; the others regroup (recovery.regroup, rejoin.attempt), and one of them
SIGKILLs itself in the middle of it: as the survivors start creating their new process group (a creation waits
on the store for every member, and no heartbeat bounds it), or as it starts rebuilding its part over the new
group. The first attempt is abandoned on every survivor; the second, without the new loss, commits and the run
finishes. backend.timeout_s is 120 s: a store timeout would show in the run's time."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchgen.dist import recovery as recovery_module
from batchgen.dist import run as run_module
from batchgen.dist.run import execute_dist
from tests.distributed.test_dist_backend import N, dist_settings, job_for
from tests.distributed.test_recovery import reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _die_on(rank: int):
    if os.environ.get("RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # three or four processes, two losses: 10-30 s on the loaded 2-core machine
@pytest.mark.parametrize("moment,procs", [("creating the group", 4), ("rebuilding", 3)])
def test_a_second_loss_during_the_regroup_is_recovered_from(saved, loop_kernel, kill_at, monkeypatch, moment,
                                                            procs):
    victim = procs - 1
    if moment == "creating the group":
        join = recovery_module.join_group

        def dying_join(*args, **kw):
            _die_on(victim)
            return join(*args, **kw)
        monkeypatch.setattr(recovery_module, "join_group", dying_join)
    else:
        build = run_module._build_rank

        def dying_build(gen, *args, **kw):
            if gen.number == 1:
                _die_on(victim)
            return build(gen, *args, **kw)
        monkeypatch.setattr(run_module, "_build_rank", dying_build)
    _, path = saved
    kill_at(1, 30)
    t0 = time.monotonic()
    out = execute_dist(job_for(procs)[0], dist_settings(path, procs, timeout_s=120.0))
    took = time.monotonic() - t0
    assert took < 90, f"{took:.1f} s: a store timeout, not the heartbeat, ended an attempt"
    ref = reference(path, procs)
    assert [out.tokens.generated[s] for s in range(N)] == [ref.tokens.generated[s] for s in range(N)]
    assert out.prepared.state.all_finished()
    assert len(out.recoveries) == 1, out.recoveries
    rec = out.recoveries[0]
    survivors = [r for r in range(procs) if r not in (1, victim)]
    assert rec.lost == [1, victim] and rec.survivors == survivors and rec.generation == 2, rec
    assert "then" in rec.cause and f"rank {victim}" in rec.cause, rec.cause
