"""Fencing: a rank declared lost is made dead before the survivors act on it (issue 9, part 4).

The heartbeat declares a rank lost after a few seconds of silence, which a dead process and a stalled one
(stopped, swapped out, stuck in a long system call) look alike from outside. A stalled one is a hazard to
recovery: it could wake and rewrite its shared host index or reuse host pages while rank 0 reads its
sequences from them, and the one-machine launcher would wait for it until its join timeout after the run
ended. So rank 0 kills every lost rank's process on its machine before it goes on, as clusters fence a node
they have declared dead, and reads a lost rank's host copies only once its process is known dead.

Each process registers `host:pid:start` in the rendezvous store (`register`); `start` (the kernel's start
time of the process, /proc/<pid>/stat field 22) guards against a reused pid: a process whose start differs is
not the one registered and is never signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import time

_KEY = "batchgen/pid/{rank}"


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when it has no /proc entry (gone, or
    not Linux); a zombie still has one and is reported as 'Z:<start>'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and parentheses
    state, start = fields[0], fields[19]
    return f"Z:{start}" if state in ("Z", "X") else start


def register(store, rank: int) -> None:
    """Record this process (launch rank `rank`) in the store, for rank 0 to fence it if it is ever lost."""
    start = start_time(os.getpid()) or ""
    store.set(_KEY.format(rank=rank), f"{socket.gethostname()}:{os.getpid()}:{start}")


def fence(store, rank: int, within_s: float = 5.0) -> tuple[bool, bool]:
    """Make sure the process of lost launch rank `rank` is dead: SIGKILL it when it is still running on this
    machine, then wait (at most `within_s`) until it has exited. Returns (dead, killed): `dead` is whether its
    death is known here (False: another machine, no /proc to check, or still running after `within_s`);
    `killed` whether this call signalled it (it was alive: stalled, not dead)."""
    key = _KEY.format(rank=rank)
    try:
        if not store.check([key]):
            return False, False
        host, pid, start = store.get(key).decode().rsplit(":", 2)
    except Exception:  # noqa: BLE001 (a store that cannot answer cannot tell us who it was)
        return False, False
    if host != socket.gethostname() or not start:
        return False, False
    pid = int(pid)
    now = start_time(pid)
    if now is None or now != start:  # gone (reaped), a zombie, or the pid is another process's now
        return True, False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True, False
    except PermissionError:
        return False, False
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if start_time(pid) != start:  # exited: gone or a zombie its parent has not reaped yet
            return True, True
        time.sleep(0.01)
    return False, True
