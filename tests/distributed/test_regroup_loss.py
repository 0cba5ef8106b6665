"""A second loss while the survivors regroup stops the run within seconds, saying what finished, never after a
store timeout (issue 26, item 2).

Three processes; rank 1 is SIGKILLed at its 30th forward; ranks 0 and 2 regroup (recovery.regroup), and rank 2
SIGKILLs itself in the middle of it: as the survivors start creating their new process group (a creation waits
on the store for every member, and no heartbeat bounds it), or as it starts rebuilding its part over the new
group. Rank 0 must stop within seconds (not after backend.timeout_s, 120 s here), naming the second loss, and
keep every finished sequence, with the reference's tokens."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchgen.dist import recovery as recovery_module
from batchgen.dist import run as run_module
from batchgen.dist.run import DistRunFailed, execute_dist
from tests.distributed.test_dist_backend import N, dist_settings, job_for
from tests.distributed.test_recovery import reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _die_on_rank_2():
    if os.environ.get("RANK") == "2":
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # three processes, two losses: about 15 s on the loaded 2-core machine
@pytest.mark.parametrize("moment", ["creating the group", "rebuilding"])
def test_a_second_loss_during_the_regroup_stops_the_run_within_seconds(saved, loop_kernel, kill_at, monkeypatch,
                                                                      moment):
    if moment == "creating the group":
        join = recovery_module.join_group

        def dying_join(*args, **kw):
            _die_on_rank_2()
            return join(*args, **kw)
        monkeypatch.setattr(recovery_module, "join_group", dying_join)
    else:
        build = run_module._build_rank

        def dying_build(gen, *args, **kw):
            if gen.number == 1:
                _die_on_rank_2()
            return build(gen, *args, **kw)
        monkeypatch.setattr(run_module, "_build_rank", dying_build)
    _, path = saved
    kill_at(1, 30)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as err:
        execute_dist(job_for(3)[0], dist_settings(path, 3, timeout_s=120.0))
    took = time.monotonic() - t0
    assert took < 45, f"{took:.1f} s: a store timeout, not the heartbeat, ended the regroup\n{err.value}"
    by_rank = {r.rank: r for r in err.value.results}
    assert by_rank[1].exitcode == by_rank[2].exitcode == -signal.SIGKILL, str(err.value)
    rank0 = by_rank[0].error or ""
    assert "during the recovery" in rank0 and "rank 1" in rank0 and f"of {N} sequences had finished" in rank0, \
        str(err.value)
    partial = err.value.partial
    assert partial is not None and partial.total == N and partial.finished
    ref = reference(path, 3)
    assert all(toks == ref.tokens.generated[sid] for sid, toks in partial.finished.items())
