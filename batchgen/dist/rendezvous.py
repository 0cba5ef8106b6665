"""Meeting the other processes on the rendezvous store under the heartbeat, before a step that would otherwise
wait on the store for the whole collective timeout.

Creating process groups (`init_process_group`, `new_group`) blocks on store keys that every member writes:
a member that died or stalled before writing its key kept the others waiting `backend.timeout_s` (120 s), with
no heartbeat asked (issue 26: a kill during a regroup stopped the run after a 120 s store timeout). So every
member first announces itself here and waits, polling, for the others: a member the heartbeat calls lost ends
the wait at once with `WorkerLost` naming it, and the group creation that follows runs only when everyone is
there (a loss inside it, a window of milliseconds, is still bounded by the collective timeout).
"""

from __future__ import annotations

import time
from typing import Iterable

from batchgen.dist.errors import WorkerLost
from batchgen.dist.failure import Heartbeat


def await_peers(store, key: str, rank: int, ranks: Iterable[int], heartbeat: Heartbeat, timeout_s: float,
                what: str) -> None:
    """Announce `rank` under `key` and wait until every rank of `ranks` (the heartbeat's numbering) has.
    Raises WorkerLost naming a rank the heartbeat finds lost meanwhile, or the first missing one after
    `timeout_s` (alive but never there: the collective timeout, as before)."""
    ranks = list(ranks)
    store.set(f"{key}/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    missing = [r for r in ranks if r != rank]
    while True:
        lost = heartbeat.lost([r for r in ranks if r != rank])
        if lost:
            raise WorkerLost(lost[0], f"{heartbeat.cause(lost[0])}, while the others waited for it ({what})")
        try:
            missing = [r for r in missing if not store.check([f"{key}/{r}"])]
        except Exception as e:  # noqa: BLE001 (the store's host (rank 0) is gone)
            raise WorkerLost(heartbeat.store_host_rank, f"the store stopped answering ({e}) during {what}") from None
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise WorkerLost(missing[0], f"not there within {timeout_s:g} s ({what}) though beating")
        time.sleep(heartbeat.interval_s / 5)
