"""A dead or hung peer becomes WorkerLost within seconds, never a hang.

The victim SIGKILLs itself in the middle of a loop of all-to-alls and all-reduces (the collectives of an MoE
step); the survivors must raise WorkerLost naming it within 10 s of the kill, with the default heartbeat
(0.5 s beats, lost after 3 s of silence). Killing rank 0 also kills the rendezvous store it hosts: the
survivors must still name rank 0. A peer that is alive but never joins a collective is bounded by the group's
collective timeout.
"""

import importlib
import itertools
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from batchgen.dist import Comm, Heartbeat, WorkerLost

from .conftest import run_procs

DETECT_WITHIN_S = 10.0


KILL_AT = 30  # the victim's step at which it kills itself: no survivor can complete a step after step 29


def _report_while_waiting(ctx, hb, where, every_s=2.0):
    """A survivor's step and heartbeat state, sent to the launcher every `every_s` (WorkerResult.progress):
    what the test shows if a survivor hangs and is killed at the join timeout."""
    def report():
        while True:
            time.sleep(every_s)
            ctx.report(f"rank {ctx.rank} in step {where['step']}: {hb.state()}")

    threading.Thread(target=report, daemon=True).start()


def _loop_until_lost(ctx, victim, killed_at, survivors_done):
    hb = Heartbeat.for_context(ctx).start()
    comm = Comm(heartbeat=hb)
    n, where = comm.size, {"step": -1}
    _report_while_waiting(ctx, hb, where)
    try:
        for i in itertools.count():
            where["step"] = i
            if ctx.rank == victim and i == KILL_AT:
                killed_at.value = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process on Linux
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                if i % 2:
                    comm.all_reduce(torch.ones(8))
                else:
                    comm.all_to_all_single(torch.empty(2 * n, 4), torch.full((2 * n, 4), float(ctx.rank)))
            except WorkerLost as e:
                return {"lost": e.rank, "after_s": time.monotonic() - killed_at.value, "message": str(e),
                        "step": i, "heartbeat": hb.state()}
            if i >= KILL_AT:  # impossible: the victim never takes part in step KILL_AT
                return {"lost": None, "after_s": time.monotonic() - killed_at.value, "step": i,
                        "heartbeat": hb.state(),
                        "message": f"step {i} completed although rank {victim} was killed before it"}
    finally:
        # survivors leave together: one that exits early (rank 0 hosts the store) would look lost to the other
        survivors_done.wait(timeout=30)


@pytest.mark.parametrize("victim", [2, 0])
def test_sigkilled_peer_is_reported_as_worker_lost(victim):
    """Each survivor raises WorkerLost naming the victim in step KILL_AT - 1 or KILL_AT (it may still be waiting
    for the other survivor in the last step the victim finished), within DETECT_WITHIN_S of the kill."""
    mp = multiprocessing.get_context("fork")
    killed_at, survivors_done = mp.Value("d", 0.0), mp.Barrier(2)
    results = run_procs(_loop_until_lost, 3, victim, killed_at, survivors_done, expect_ok=False)
    assert results[victim].exitcode == -signal.SIGKILL, f"victim {victim}: {results[victim].error}"
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, f"rank {r.rank}: {r.error}; last report: {r.progress[-1:] or 'none'}"
        got = r.value
        said = f"rank {r.rank}, step {got['step']}, {got['after_s']:.2f} s after the kill: {got['message']}; " \
               f"{got['heartbeat']}"
        assert got["lost"] == victim, said
        assert KILL_AT - 1 <= got["step"] <= KILL_AT, said
        assert got["after_s"] < DETECT_WITHIN_S, said
        print(f"victim {victim}: {said}")


def _hang_in_collective(ctx, hang_s):
    hb = Heartbeat.for_context(ctx).start()
    comm = Comm(heartbeat=hb)
    comm.barrier()
    if ctx.rank == 1:  # alive and beating, but never joins the all-reduce
        time.sleep(hang_s)
        return None
    t0 = time.time()
    try:
        comm.all_reduce(torch.ones(4))
    except WorkerLost as e:
        return e.rank, time.time() - t0, str(e)
    return None, time.time() - t0, "all-reduce completed without its peer"


def test_hung_collective_is_bounded_by_the_group_timeout():
    timeout_s = 2.0
    rank0, _ = run_procs(_hang_in_collective, 2, timeout_s + 1.5, timeout_s=timeout_s)
    lost_rank, after_s, message = rank0
    assert lost_rank == 1 and "all-reduce failed" in message, message
    assert timeout_s - 0.5 < after_s < timeout_s + 2.0, f"{after_s:.1f} s: {message}"
    print(f"hung peer: rank 0 raised after {after_s:.2f} s: {message}")


def _stop_cleanly_then_watch(ctx, gate):
    hb = Heartbeat.for_context(ctx, interval_s=0.2, dead_after_s=1.0).start()
    Comm(heartbeat=hb).barrier()
    if ctx.rank == 1:
        hb.stop()  # finished: marks itself done
        gate.wait(timeout=30)  # stay alive (rank 0 hosts the store) until rank 0 has looked
        return None
    time.sleep(2.5)  # 2.5 x dead_after_s without a beat from rank 1
    lost = hb.lost()
    gate.wait(timeout=30)
    return lost


def test_a_peer_that_stops_its_heartbeat_cleanly_is_not_lost():
    gate = multiprocessing.get_context("fork").Barrier(2)
    lost, _ = run_procs(_stop_cleanly_then_watch, 2, gate)
    assert lost == []


def _fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("bad plan on rank 1")
    return "fine"


def test_launcher_reports_each_ranks_outcome():
    ok, failed = run_procs(_fail_on_rank_1, 2, expect_ok=False)
    assert ok.ok and ok.value == "fine"
    assert not failed.ok and failed.exitcode == 1 and "ValueError: bad plan on rank 1" in failed.error


def _retire_a_stuck_collective(ctx):
    """Rank 1 leaves a broadcast pending on a group (its source, rank 0, never sends: a step abandoned on a loss)
    and retires the group, as a recovery does; rank 0 waits, up to 15 s, for rank 1's process to end."""
    import torch.distributed as dist

    from batchgen.dist.groups import retire

    group = dist.new_group([0, 1])
    if ctx.rank == 1:
        ctx.store.set("pid1", str(os.getpid()))
        retire(group, dist.broadcast(torch.empty(1), src=0, group=group, async_op=True))
        return "left"
    stat, t0 = f"/proc/{int(ctx.store.get('pid1'))}/stat", time.monotonic()
    while time.monotonic() - t0 < 15:
        try:
            with open(stat) as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":  # ended (the launcher reaps it later)
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process's state from /proc")
def test_a_process_that_retired_a_stuck_group_ends_at_once():
    """Freeing a group whose collective is stuck waits until its peer goes (or its timeout): a process that
    retired one ends without freeing it, and its result still arrives (spawn: the interpreter would free it)."""
    from batchgen.dist import launch

    results = launch(_retire_a_stuck_collective, 2, start_method="spawn", join_timeout_s=60)
    assert all(r.ok for r in results), [r.error for r in results]
    waited, left = [r.value for r in results]
    assert left == "left" and waited < 5, f"rank 1 ended {waited:.1f} s after returning"


def _late_peer(ctx, late_s):
    """Rank 1 takes part `late_s` late in a send/receive and in an all-reduce, each waited in 50 ms slices;
    then both exchange again over the same pair (it must still be open)."""
    hb = Heartbeat.for_context(ctx, interval_s=0.1, dead_after_s=5.0).start()
    comm = Comm(heartbeat=hb, slice_s=0.05)
    comm.barrier()
    got = torch.zeros(1000)
    try:
        for i in range(2):
            if ctx.rank == 1:
                time.sleep(late_s)
                comm.recv(got, 0)
            else:
                comm.send(torch.full((1000,), float(i + 1)), 1)
        if ctx.rank == 1:
            time.sleep(late_s)
        total = torch.ones(4)
        comm.all_reduce(total)
        comm.send(torch.full((1000,), 7.0), 0) if ctx.rank == 1 else comm.recv(got, 1)
    except WorkerLost as e:
        return f"lost: {e}"
    finally:
        hb.stop()
    return float(got[0]), float(total[0])


def test_a_slow_peer_is_waited_for_without_breaking_the_transfer():
    """A wait slice that expires must not break what it waits for: gloo closes a send/receive's pair when a
    timed wait on it expires ("Application timeout caused pair closure"), which under load turned a slow peer
    into a lost one (issue 26). Slices of 50 ms, a peer 1 s late, both ends beating."""
    rank0, rank1 = run_procs(_late_peer, 2, 1.0)
    assert rank0 == (7.0, 2.0), rank0
    assert rank1 == (2.0, 2.0), rank1


def _killed_while_others_wait(ctx, killed_at):
    hb = Heartbeat.for_context(ctx, interval_s=0.2, dead_after_s=60.0).start()
    comm = Comm(heartbeat=hb)
    comm.barrier()
    if ctx.rank == 1:
        killed_at.value = time.time()
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.recv(torch.empty(4), 1)  # the dead peer's socket closes; its heartbeat would be silent for 60 s
    except WorkerLost as e:
        return e.rank, time.time() - killed_at.value, str(e)
    return None, None, "received from a dead peer"


def test_a_dead_process_is_lost_at_once_whatever_the_heartbeat_timeout():
    """A peer whose process is gone is lost within a heartbeat interval or two, not after dead_after_s (set long
    here: the generous setting that lets a slow peer be slow)."""
    killed_at = multiprocessing.get_context("fork").Value("d", 0.0)
    rank0, victim = run_procs(_killed_while_others_wait, 2, killed_at, expect_ok=False)
    assert victim.exitcode == -signal.SIGKILL
    assert rank0.ok, rank0.error
    lost, after_s, message = rank0.value
    assert lost == 1 and after_s < 3.0, message
    assert "is gone" in message or "failed" in message, message


def _store_host_stalls(ctx, pid0):
    """Rank 0 (hosting the store) stops itself; rank 1 must find it lost, then wakes it so both can end."""
    hb = Heartbeat.for_context(ctx, interval_s=0.2, dead_after_s=1.0).start()
    if ctx.rank == 0:
        pid0.value = os.getpid()
    Comm(heartbeat=hb).barrier()
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    pid, t0 = pid0.value, time.monotonic()
    time.sleep(0.2)
    lost = hb.wait_for_loss([0], within_s=10)
    after_s, state = time.monotonic() - t0, hb.state()
    os.kill(pid, signal.SIGCONT)
    return lost, after_s, state


def test_a_stalled_store_host_is_lost():
    """A stalled store host never answers a read (TCPStore's timeout bounds the wait for a reply to start, then
    reads without one): the heartbeat thread stays blocked in that read, and its owner counts the beat that
    never ended as the host's silence."""
    pid0 = multiprocessing.get_context("fork").Value("i", 0)
    _, (lost, after_s, state) = run_procs(_store_host_stalls, 2, pid0)
    assert lost == 0 and after_s < 4.0, f"{after_s:.1f} s: {state}"


def test_a_stalled_store_host_whose_joined_message_lags_is_not_lost_at_start(monkeypatch):
    """Rank 0's own "joined" never reaches the launcher (a queue's feeder thread stopped with its process before
    writing it): rank 1's, which comes back from the same barrier, says that both are in the group, so the stop
    after it is the heartbeat's to find, not a process lost at start-up."""
    from multiprocessing.queues import Queue

    launch_module = importlib.import_module("batchgen.dist.launch")
    put = Queue.put
    monkeypatch.setattr(Queue, "put", lambda self, item, *a, **kw: None if item == (0, launch_module._JOINED, None)
                        else put(self, item, *a, **kw))
    pid0 = multiprocessing.get_context("fork").Value("i", 0)
    _, (lost, after_s, state) = run_procs(_store_host_stalls, 2, pid0)
    assert lost == 0 and after_s < 4.0, f"{after_s:.1f} s: {state}"


def _beat_fails_once_on_the_store_host(ctx):
    hb = Heartbeat.for_context(ctx, interval_s=0.2, dead_after_s=1.0).start()
    Comm(heartbeat=hb).barrier()
    if ctx.rank == 1:
        time.sleep(0.5)  # past rank 0's failed beat
        os.kill(os.getpid(), signal.SIGKILL)
    return hb.wait_for_loss([1], within_s=5), hb.state()


def test_the_heartbeat_outlives_an_error_on_the_store_host(monkeypatch):
    """An error in one beat of the store host's heartbeat (it used to end the thread, silently: that process
    then never found a loss) is kept for state() and the next beat goes on."""
    beat, failed = Heartbeat._beat, {"done": False}

    def flaky(self, *args):
        if self.rank == 0 and not failed["done"]:
            failed["done"] = True
            raise RuntimeError("injected store error")
        return beat(self, *args)

    monkeypatch.setattr(Heartbeat, "_beat", flaky)
    rank0, victim = run_procs(_beat_fails_once_on_the_store_host, 2, expect_ok=False)
    assert victim.exitcode == -signal.SIGKILL
    lost, state = rank0.value
    assert lost == 1 and "injected store error" in state, state


def test_a_process_lost_during_start_up_stops_the_others_at_once(monkeypatch):
    """A process that dies before the group exists (here SIGKILLed just before joining) would leave the others
    waiting in the group's creation for its whole timeout (a store timeout): the launcher stops them at once and
    says so."""
    launch_module = importlib.import_module("batchgen.dist.launch")  # the module (the package exports a function)
    join = launch_module.init_distributed

    def dying(env, *args, **kw):
        if env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return join(env, *args, **kw)

    monkeypatch.setattr(launch_module, "init_distributed", dying)
    t0 = time.monotonic()
    results = run_procs(_fail_on_rank_1, 3, expect_ok=False, timeout_s=60)
    took = time.monotonic() - t0
    assert results[1].exitcode == -signal.SIGKILL
    for r in (results[0], results[2]):
        assert not r.ok and "rank 1 ended (exit code -9) during start-up" in r.error and "nothing ran" in r.error, \
            r.error
    assert took < 15, f"{took:.1f} s"
