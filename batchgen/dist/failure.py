"""Finding a dead peer within seconds, and naming it.

Two signals, because neither is enough alone:

- gloo raises at once when a socket it reads from closes (the kernel closes a SIGKILLed process's sockets),
  but only on the ranks connected to the dead one in that collective, and its message names an address, not a
  rank. A rank waiting on a survivor that itself just failed (a ring all-reduce) would wait for the group's
  collective timeout, which must be long (it also bounds legitimate waits on a slow peer).
- `Heartbeat`: a daemon thread per process bumps a counter in the rendezvous store every `interval_s` and
  reads everyone else's; a peer is lost when its process is gone (a peer on this machine: its pid, published
  beside its counter, has exited; checked every beat, so a SIGKILLed peer is found within an interval) or its
  counter has not moved for `dead_after_s` (by this process's clock, so clocks need not agree: a stalled
  process, or one on another machine). Nothing else declares a peer lost: a slow peer on a loaded machine
  keeps beating and is waited for, so `dead_after_s` (backend.lost_after_s) can be generous. The thread needs
  the GIL only briefly and torch kernels release it, so a busy but healthy process keeps beating. When the
  store itself stops answering (a closed connection, or no answer for dead_after_s: a slow store is slow),
  the rank that hosts it (rank 0 with the one-machine launcher) is the lost one; time the store did not
  answer does not count as a peer's silence.

The thread never ends on an error while the run goes on: an error is kept for `state()` and the next beat
tries again on a new connection. A detector that ended silently on the store host would leave that process
unable to find any loss, every wait on a dead peer then bounded only by the collective timeout.

`Comm` (comm.py) waits for every collective in slices of `interval_s` and checks `lost()` between slices, so
a collective blocked on a dead peer raises `WorkerLost(rank)` within about dead_after_s + interval_s whichever
peer it was waiting for; a gloo error (closed socket, gloo's own timeout) also becomes WorkerLost, naming the
rank whose heartbeat stops within the next dead_after_s. A peer that finishes cleanly calls `stop()`, which
marks it done instead of lost; shut a job down with a barrier first, then stop the heartbeats.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch.distributed as dist

from batchgen.dist.errors import DistConfigError
from batchgen.dist.fence import start_time

_DONE = b"done"


@dataclass
class _Watch:
    """What the heartbeat thread knows of its peers between beats."""
    seen: dict[int, tuple[bytes | None, float]]  # rank: (its counter when it last changed, when that was seen)
    known: list[int]  # peers whose key exists (multi_get blocks on a missing key)
    local: dict[int, tuple[int, str]]  # peers on this machine: (pid, start time), to see them exit


class Heartbeat:
    def __init__(self, addr: str, port: int, rank: int, world_size: int, *, interval_s: float = 0.5,
                 dead_after_s: float = 3.0, store_host_rank: int | None = 0, prefix: str = "batchgen/hb"):
        if not 0 < interval_s < dead_after_s:
            raise DistConfigError(f"heartbeat interval ({interval_s} s) must be positive and shorter than the "
                                  f"time after which a silent peer counts as lost ({dead_after_s} s)")
        self.addr, self.port, self.rank, self.world_size = addr, port, rank, world_size
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.store_host_rank, self.prefix = store_host_rank, prefix
        self._lost: frozenset[int] = frozenset()
        self._cause: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None  # the last unexpected error of the thread (it goes on)
        self._store_error = ""  # the store's last error, until it answers again
        self._answered = 0.0  # monotonic time the store last answered
        self._beats = 0
        self._beat_began = 0.0  # when the beat under way began (0: none under way)
        self._beat_done = 0.0

    @classmethod
    def for_context(cls, ctx, **kw) -> "Heartbeat":
        """The heartbeat of a `launch.DistContext`'s process, on its rendezvous store."""
        prefix = getattr(ctx, "namespace", "") + kw.pop("prefix", "batchgen/hb")
        return cls(ctx.env.master_addr, ctx.env.master_port, ctx.rank, ctx.world_size,
                   store_host_rank=ctx.store_host_rank, prefix=prefix, **kw)

    # ---- control --------------------------------------------------------------------------------------
    def start(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        self._ready.wait(self.dead_after_s + 5)
        if self._error is not None:
            raise DistConfigError(f"heartbeat cannot reach the store at {self.addr}:{self.port}: {self._error}")
        return self

    def stop(self) -> None:
        """Stop beating and tell the others this process finished (it is not lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.dead_after_s + 1)

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- queries ---------------------------------------------------------------------------------------
    def lost(self, ranks: Iterable[int] | None = None) -> list[int]:
        """The given ranks (default: all peers) that stopped beating, ascending."""
        self._check_stuck()
        lost = self._lost
        return sorted(lost if ranks is None else lost.intersection(ranks))

    def cause(self, rank: int) -> str:
        return self._cause.get(rank, "no heartbeat")

    def state(self) -> str:
        """What this detector knows, in one line, for a failure message."""
        alive = self._thread is not None and self._thread.is_alive()
        since = f"{time.monotonic() - self._beat_done:.1f} s ago" if self._beat_done else "never"
        parts = [f"heartbeat of rank {self.rank} {'running' if alive else 'not running'}",
                 f"{self._beats} beats, last {since}",
                 "lost: " + (", ".join(f"{r} ({self._cause[r]})" for r in sorted(self._lost)) or "none")]
        if self._store_error:
            parts.append(f"store error: {self._store_error}")
        if self._error is not None:
            parts.append(f"error: {type(self._error).__name__}: {self._error}")
        return "; ".join(parts)

    def wait_for_loss(self, ranks: Iterable[int], within_s: float | None = None) -> int | None:
        """After an error that says some peer failed: the first of `ranks` to be found lost within
        `within_s` (default dead_after_s + 2 intervals), or None if all of them keep beating."""
        ranks = list(ranks)
        deadline = time.monotonic() + (self.dead_after_s + 2 * self.interval_s if within_s is None else within_s)
        while True:
            lost = self.lost(ranks)
            if lost:
                return lost[0]
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.interval_s / 4)

    def _check_stuck(self) -> None:
        """A store call that a stalled store host never answers blocks the thread for good (TCPStore's timeout
        bounds the wait for a reply, not the read after it): a beat that has not ended for dead_after_s + 2
        intervals is the store host's silence."""
        host, began = self.store_host_rank, self._beat_began
        if host is None or host == self.rank or host in self._lost or not began or self._stop.is_set():
            return
        stuck_s = time.monotonic() - began
        if stuck_s > self.dead_after_s + 2 * self.interval_s:
            self._mark({host: f"the store it hosts has not answered for {stuck_s:.1f} s"})

    # ---- the thread --------------------------------------------------------------------------------------
    def _connect(self):
        client = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=self.dead_after_s))
        return dist.PrefixStore(self.prefix, client)

    def _run(self) -> None:
        try:
            store = self._connect()
            store.set(f"pid/{self.rank}", f"{socket.gethostname()}:{os.getpid()}:{start_time(os.getpid()) or ''}")
            store.set(str(self.rank), "0")
        except Exception as e:  # noqa: BLE001 (reported by start)
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        peers = [r for r in range(self.world_size) if r != self.rank]
        self._answered = time.monotonic()
        watch = _Watch({r: (None, self._answered) for r in peers}, [], {})
        while not self._stop.wait(self.interval_s):
            self._beat_began = time.monotonic()
            try:
                store = self._beat(store, peers, watch)
            except Exception as e:  # noqa: BLE001 (a detector that ended silently would never find a loss)
                self._error = e
            self._beats += 1
            self._beat_done, self._beat_began = time.monotonic(), 0.0
            if store is None and self.store_host_rank in self._lost:
                return  # its store went with it: nothing left to read (and no run left to finish)
        try:
            if store is not None:
                store.set(str(self.rank), _DONE.decode())
        except Exception:  # noqa: BLE001 (the store may be gone at shutdown; nobody is waiting then)
            pass

    def _beat(self, store, peers: list[int], watch: _Watch):
        """One beat: bump this process's counter, read the others', mark the silent and the gone. Returns the
        store connection to use next time (None after a failed call: a reply that came late would be read as
        the next call's, so the next beat connects anew)."""
        values = None
        try:
            if store is None:
                store = self._connect()
            store.set(str(self.rank), str(self._beats + 1))
            for r in peers:
                if r not in watch.known and store.check([str(r)]):
                    watch.known.append(r)
                    watch.local.update(self._local_process(store, r))
            values = store.multi_get([str(r) for r in watch.known]) if watch.known else []
        except Exception as e:  # noqa: BLE001 (torch's store errors; judged below)
            store = None
            self._store_error = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            host, silent_s = self.store_host_rank, time.monotonic() - self._answered
            # a refused or closed connection: the host is gone; a timeout: slow, until it lasts dead_after_s
            if host is not None and host != self.rank and (silent_s > self.dead_after_s or "imeout" not in str(e)):
                self._mark({host: f"the store it hosts stopped answering ({self._store_error})"})
        now = time.monotonic()
        if values is not None:
            if self._store_error:  # silence counts only while this process could read the counters
                watch.seen = {r: (v, now) for r, (v, _) in watch.seen.items()}
                self._store_error = ""
            self._answered = now
            for r, v in zip(watch.known, values):
                if v != watch.seen[r][0]:
                    watch.seen[r] = (v, now)
            self._mark({r: f"no heartbeat for {now - t:.1f} s" for r, (v, t) in watch.seen.items()
                        if v != _DONE and now - t > self.dead_after_s})
        gone = [r for r, (pid, start) in watch.local.items()
                if r not in self._lost and watch.seen[r][0] != _DONE and start_time(pid) != start]
        if gone and store is not None:
            try:  # one that finished cleanly (said done) since its counter was read is not lost
                gone = [r for r in gone if store.get(str(r)) != _DONE]
                self._mark({r: f"its process (pid {watch.local[r][0]}) is gone" for r in gone})
            except Exception:  # noqa: BLE001 (asked again next beat, on a new connection)
                store = None
        return store

    @staticmethod
    def _local_process(store, rank: int) -> dict[int, tuple[int, str]]:
        """{rank: (pid, start time)} when the peer runs on this machine (and /proc tells its start time)."""
        host, pid, start = store.get(f"pid/{rank}").decode().rsplit(":", 2)
        return {rank: (int(pid), start)} if host == socket.gethostname() and start else {}

    def _mark(self, causes: dict[int, str]) -> None:
        new = {r: c for r, c in causes.items() if r not in self._lost}
        if new:
            self._cause.update(new)
            self._lost = self._lost | frozenset(new)
