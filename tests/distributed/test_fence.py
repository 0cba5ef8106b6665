"""fence.py: a lost rank's process is killed only when it is the very process registered (host, pid, start
time), and its death is known before rank 0 reads its files."""

import os
import signal
import socket
import subprocess

import pytest
import torch.distributed as dist

from batchgen.dist.fence import start_time, fence, register

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="fencing reads /proc (Linux)")


@pytest.fixture
def stopped():
    """A child process that is alive but stalled (SIGSTOP), as a hung worker looks."""
    proc = subprocess.Popen(["sleep", "60"])
    os.kill(proc.pid, signal.SIGSTOP)
    yield proc
    proc.kill()
    proc.wait()


def _entry(store, rank, host, pid, start):
    store.set(f"batchgen/pid/{rank}", f"{host}:{pid}:{start}")


def test_a_stalled_process_is_killed_and_known_dead(stopped):
    store = dist.HashStore()
    _entry(store, 3, socket.gethostname(), stopped.pid, start_time(stopped.pid))
    assert fence(store, 3) == (True, True)
    assert stopped.wait(timeout=5) == -signal.SIGKILL
    assert fence(store, 3) == (True, False)  # reaped: dead, nothing to signal


def test_a_reused_pid_another_host_or_no_entry_is_never_signalled(stopped):
    store = dist.HashStore()
    _entry(store, 1, socket.gethostname(), stopped.pid, "12345")   # the pid now belongs to another process
    _entry(store, 2, "elsewhere.example", stopped.pid, start_time(stopped.pid))
    assert fence(store, 1) == (True, False)   # the registered process is gone
    assert fence(store, 2) == (False, False)  # cannot tell from here
    assert fence(store, 5) == (False, False)  # never registered
    assert stopped.poll() is None             # still there, untouched


def test_register_records_this_process():
    store = dist.HashStore()
    register(store, 0)
    host, pid, start = store.get("batchgen/pid/0").decode().rsplit(":", 2)
    assert (host, int(pid), start) == (socket.gethostname(), os.getpid(), start_time(os.getpid()))
