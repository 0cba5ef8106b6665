"""Joining the survivors' new generation as one all-or-nothing step, so that a further loss while they regroup
sends them all back to regroup again without it (issue 26: a loss during a regroup, a second loss).

An attempt at generation `number` (`attempt`) is: regroup (recovery.regroup: meet, create the group, start the
new heartbeat), rebuild this process's part over it and settle its kept cache (run._rebuild), then commit. After
the commit no survivor waits on another until the engine's first command, so a loss from then on is an ordinary
loss in the committed generation (the next recovery starts from it). Until the commit, the
generation the engine ran in (the *base*) keeps its heartbeat, which every survivor watches: a loss anywhere in
the attempt ends it on every survivor within seconds, and rank 0 alone decides its outcome (abort or commit),
so that no survivor goes on in a generation the others left. After an abort every survivor is back in the base
generation: rank 0 decides the survivors again from the base heartbeat and publishes attempt `number + 1`
(recovery.publish), the others wait for it (recovery.await_decision), and the engine's state, numbered by the
base generation, is requeued only once an attempt commits.
"""

from __future__ import annotations

import time

from batchgen.dist.errors import WorkerLost
from batchgen.dist.fence import fence
from batchgen.dist.recovery import Generation, regroup
from batchgen.dist.rendezvous import await_peers

_COMMIT, _ABORT = b"commit", b"abort"
_ABANDONED: list = []  # heartbeats of aborted attempts, stopped once a later attempt commits


class RegroupAborted(RuntimeError):
    """The attempt at generation `number` was abandoned; `cause`: the loss that ended it (its rank in the base
    generation's numbering, or None)."""

    def __init__(self, number: int, cause: WorkerLost):
        self.number, self.cause = number, cause
        super().__init__(f"regroup into generation {number} abandoned: {cause}")


def attempt(base: Generation, survivors: list[int], number: int, build, *, interval_s: float,
            dead_after_s: float):
    """Regroup `base`'s `survivors` into generation `number` and `build(new)` this process's part over it;
    returns (the new generation, what build returned) once every survivor has built (rank 0 commits), and only
    then stops `base`'s heartbeat. Raises RegroupAborted on any loss meanwhile."""
    new, phase = None, "regroup"
    try:
        new = regroup(base, survivors, interval_s=interval_s, dead_after_s=dead_after_s, number=number)
        phase = "build"
        built = build(new)
        phase = "commit"
        _commit(base, survivors, number)
    except WorkerLost as e:
        cause = _in_base(e, base, new) if phase == "build" else e
        if new is not None:
            _ABANDONED.append(new.heartbeat)  # still beating: members still waiting on it see the real loss
        if base.rank == 0:
            base.ctx.store.set(_key(number), _ABORT)
        raise RegroupAborted(number, cause) from e
    base.heartbeat.stop()
    while _ABANDONED:
        _ABANDONED.pop().stop()
    return new, built


def _key(number: int) -> str:
    return f"batchgen/commit/gen{number}"


def _commit(base: Generation, survivors: list[int], number: int) -> None:
    """Rank 0 waits (under the base heartbeat) until every survivor has built, then commits; the others say they
    built and wait for rank 0's word. Raises WorkerLost on a loss, or when rank 0 aborted."""
    store, hb, what = base.ctx.store, base.heartbeat, f"the commit of generation {number}"
    if base.rank == 0:
        await_peers(store, f"batchgen/built/gen{number}", 0, survivors, hb, base.ctx.timeout_s, what)
        store.set(_key(number), _COMMIT)
        return
    store.set(f"batchgen/built/gen{number}/{base.rank}", "1")
    deadline = time.monotonic() + base.ctx.timeout_s
    while not store.check([_key(number)]):
        if hb.lost([0]):
            raise WorkerLost(0, f"{hb.cause(0)}, during {what}")
        if time.monotonic() >= deadline:
            raise WorkerLost(0, f"no word from rank 0 within {base.ctx.timeout_s:g} s ({what})")
        time.sleep(hb.interval_s / 5)
    if store.get(_key(number)) != _COMMIT:
        raise WorkerLost(None, f"rank 0 abandoned {what} after another loss")


def _in_base(e: WorkerLost, base: Generation, new: Generation | None) -> WorkerLost:
    """A loss found under the new generation's heartbeat, numbered as in the base generation."""
    if new is None or e.rank is None or e.rank >= len(new.members):
        return WorkerLost(None, e.cause)
    return WorkerLost(base.members.index(new.members[e.rank]), e.cause)


# ---- rank 0, stopping -----------------------------------------------------------------------------------
def fence_ranks(lost: list[int], store) -> tuple[list[int], list[int]]:
    """Rank 0: every lost (launch) rank's process made dead before the run goes on (fence.py). Returns the
    ranks known dead, and those of them that were still running (stalled) and were killed."""
    dead, killed = [], []
    for r in lost:
        is_dead, signalled = fence(store, r)
        if is_dead:
            dead.append(r)
        if signalled:
            killed.append(r)
    return dead, killed


def fence_found_lost(gen: Generation, err: WorkerLost) -> None:
    """Rank 0, stopping the run: fence the rank the error named and every rank the heartbeat calls lost."""
    peers = [r for r in range(gen.size) if r != gen.rank]
    fence_ranks([gen.members[r] for r in set(gen.heartbeat.lost(peers)) | {err.rank} if r in peers],
                gen.ctx.store)


def with_partial(error: BaseException, partial) -> BaseException:
    """The launcher sends `error.partial` back with the error (launch._worker)."""
    error.partial = partial
    return error
