"""backend=dist recovers from a lost worker: a rank other than 0 is SIGKILLed mid-run; the survivors build a
new process group, re-place the experts over themselves and finish every sequence, with greedy outputs equal
to an undisturbed run's token for token (the unfinished sequences are restored from the lost rank's shared host
copies where the latency model prices that lower, else recomputed from prompt + generated tokens: recovery.py,
shared_host.py). With recover=false, or when rank 0 dies, the run stops within 30 s with a one-line error.

The reference is the single-process executor, which test_dist_backend shows equal to an undisturbed
backend=dist run over 1, 2 and 4 processes (loop expert kernel, bit-identical logits)."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from batchgen.dist.restore import choose, restore_lost
from batchgen.dist.shared_host import (SHM_DIR, PublishedIndex, SharedHostFiles, index_path, remove_rank, sweep,
                                      sweep_orphans)
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.dist.run import DistRunFailed, execute_dist
from batchgen.exec.run import ExecSettings, execute
from batchgen.results import summarize
from tests.distributed.test_dist_backend import N, dist_settings, job_for
from tests.exec.test_exec_parity import kv_mb_for

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(path, procs):
    return execute(job_for(procs)[0], ExecSettings(device="cpu", model_path=str(path),
                                                   kv_budget_mb=kv_mb_for(path, 80), threads=1))


def check_recovered(out, ref, procs, lost, survivors, kept=True):
    assert [out.tokens.generated[s] for s in range(N)] == [ref.tokens.generated[s] for s in range(N)]
    t = out.prepared.state.table
    assert out.prepared.state.all_finished() and np.array_equal(t.decoded, t.output_len)
    assert len(out.recoveries) == 1, out.recoveries
    rec = out.recoveries[0]
    assert rec.lost == lost and rec.survivors == survivors and rec.generation == 1
    # the survivors kept their KV (running or suspended there); what the lost rank held was recomputed
    assert rec.finished_before > 0 and (rec.kept > 0) == kept and rec.on_lost_rank > 0
    assert rec.on_lost_rank <= rec.requeued and rec.finished_before + rec.kept + rec.requeued <= N
    assert "rank" in rec.cause and rec.at_s > 0 and rec.regroup_s > 0
    assert t.recomputes.sum() >= rec.requeued  # the requeued sequences were prefilled again
    assert out.kv_moves.get("evict", 0) == 0  # (this workload evicts nothing undisturbed: every recompute is
    assert t.recomputes.sum() == rec.requeued  # the recovery's)
    # records line up over the generations, per launch rank; the lost rank did no work after the loss
    after = [r for r in out.records if r.start >= rec.at_s]
    assert after and all(r.rank_busy.shape == (procs,) for r in out.records)
    assert all(r.rank_busy[lost[0]] == 0 for r in after)
    assert len(out.rank_busy_s) == len(survivors) and all(b > 0 for b in out.rank_busy_s)
    assert all(np.isfinite(t.finish_time)) and np.all(t.first_token_time <= t.finish_time)


@pytest.mark.parametrize("keep,shared", [(True, True), (False, True), (True, False)],
                         ids=["survivor-keeps-its-kv", "nothing-kept", "no-shared-host-copies"])
def test_a_killed_worker_is_recovered_from_on_the_survivor(saved, loop_kernel, kill_at, monkeypatch, keep, shared):
    """2 processes, rank 1 killed at its 30th forward (some sequences done, one running on rank 1 and some whose
    host copies it holds, one of rank 0's mid-forward): rank 0 alone (the plain MoE layer) finishes the job,
    keeping the KV its cache holds (its interrupted forward's slot dropped), restoring the suspended ones from rank
    1's shared host pool (each published copy holds exactly prompt + generated - 1 tokens, and the job's latency
    model prices its restore below its prefill) and recomputing the one that was running there; or, with
    nothing kept (the path of a survivors' memory plan that gives another pool), recomputing every unfinished
    sequence of its own; or, without shared host copies, recomputing rank 1's suspended ones too."""
    from batchgen.dist import run as run_module

    if not keep:
        monkeypatch.setattr(run_module, "keep_plan", lambda table, generated, done, inventories, split=None:
                            [{} for _ in inventories])
    _, path = saved
    kill_at(1, 30)
    t0 = time.monotonic()
    out = execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=60.0, shared_host_copies=shared))
    took = time.monotonic() - t0
    check_recovered(out, reference(path, 2), 2, lost=[1], survivors=[0], kept=keep)
    assert took < 60
    rec = out.recoveries[0]
    if shared:  # restored from the dead process's file, not recomputed (check_recovered: recomputes == requeued)
        assert rec.restored == rec.restorable >= 1, rec
        assert rec.finished_before + rec.kept + rec.restored + rec.requeued == N
    else:
        assert rec.restored == rec.restorable == 0, rec
    assert not glob.glob(f"{SHM_DIR}/batchgen-{os.getpid()}-*")  # every file of the run removed
    summary = summarize(out)  # what results.json gets: the recovery, and whose the per-rank numbers are
    assert summary["recoveries"][0]["lost"] == [1] and summary["rank_ids"] == [0]
    json.dumps(summary)


def test_a_stalled_worker_is_fenced_and_the_run_finishes(saved, loop_kernel, kill_at):
    """Rank 1 stops (SIGSTOP) at its 30th forward: alive, silent, holding its files. The heartbeat declares it
    lost; rank 0 kills it before reading its host copies (fence.py) and finishes on its own, as after a death.
    Unfenced, the stopped process would outlive the run and the launcher would wait for it for 600 s."""
    _, path = saved
    kill_at(1, 30, signal.SIGSTOP)
    t0 = time.monotonic()
    out = execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=60.0))
    assert time.monotonic() - t0 < 60
    check_recovered(out, reference(path, 2), 2, lost=[1], survivors=[0])
    rec = out.recoveries[0]
    assert rec.fenced == [1] and rec.restored == rec.restorable >= 1, rec


@pytest.mark.slow  # three processes on a loaded 2-core machine
def test_a_killed_worker_of_three_leaves_a_two_process_group(saved, loop_kernel, kill_at):
    """3 processes, rank 1 killed: ranks 0 and 2 form a new group (2 renumbered to 1), the experts re-placed
    over them (all-to-alls in the new group), and finish the job."""
    _, path = saved
    kill_at(1, 30)
    out = execute_dist(job_for(3)[0], dist_settings(path, 3, timeout_s=60.0))
    check_recovered(out, reference(path, 3), 3, lost=[1], survivors=[0, 2])
    assert all(c > 0 for c in out.rank_comm_s)  # both survivors joined all-to-alls (the new group's, too)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_without_recovery_the_run_stops_saying_what_finished(saved, loop_kernel, kill_at, sig):
    """Also when the lost worker is stalled, not dead: rank 0 kills it (fence.py) so that the launcher does not
    wait for it."""
    _, path = saved
    kill_at(1, 30, sig)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as err:
        execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=120.0, recover=False))
    assert time.monotonic() - t0 < 30
    head = err.value.headline
    assert "rank 1" in head and "WorkerLost" in head and f"of {N} sequences had finished" in head, head
    partial = err.value.partial
    assert partial is not None and partial.total == N and partial.finished
    ref = reference(path, 2)
    for sid, toks in partial.finished.items():  # what finished before the loss is kept, and right
        assert toks == ref.tokens.generated[sid]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_a_lost_rank_0_stops_the_run_within_seconds_keeping_what_finished(saved, loop_kernel, kill_at, sig):
    """Rank 0 holds the engine and hosts the store: nothing to recover with. The worker must not wait for a
    recovery decision that never comes: it stops naming rank 0. What had finished reached the launcher as it
    finished (DistContext.report), so it survives rank 0. Stalled (alive, silent, its store unanswering), rank 0
    is found by its heartbeat's silence, not after the collective's timeout."""
    _, path = saved
    kill_at(0, 30, sig)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as err:
        execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=120.0))
    assert time.monotonic() - t0 < 30
    head = err.value.headline
    assert "rank 0" in head and f"of {N} sequences had finished" in head, str(err.value)
    partial = err.value.partial
    assert partial is not None and partial.finished
    ref = reference(path, 2)
    assert all(toks == ref.tokens.generated[sid] for sid, toks in partial.finished.items())


def test_survivors_that_cannot_hold_the_model_stop_with_one_line(saved, loop_kernel, kill_at, monkeypatch):
    """When the smaller group is refused (here forced: the check a real memory plan would fail), rank 0 publishes
    the refusal, every survivor stops with it, and the finished outputs are kept."""
    from batchgen.dist import run as run_module
    from batchgen.dist.errors import DistConfigError

    check = run_module.check_dist

    def refusing(job, settings, *, launched=True):
        if not launched:
            raise DistConfigError(f"the experts do not fit on {settings.procs} process(es) (forced by the test)")
        return check(job, settings, launched=launched)

    monkeypatch.setattr(run_module, "check_dist", refusing)
    _, path = saved
    kill_at(1, 30)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as err:
        execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=120.0))
    assert time.monotonic() - t0 < 30
    head = err.value.headline
    assert "RecoveryRefused" in head and "do not fit on 1 process" in head and "rank 1" in head, head
    assert f"of {N} sequences had finished" in head and err.value.partial.finished, head


@pytest.mark.slow  # about 10 s on the loaded 2-core machine
def test_host_resident_sequences_survive_a_lost_worker(saved, loop_kernel, kill_at):
    """More running sequences than a process's device KV holds, the rest host-resident; rank 1 killed at its
    12th forward, inside a host-resident step: rank 0 keeps its sequences (the step's pending token dropped and
    written again), rank 1's are recomputed; outputs equal transformers'."""
    from batchgen.dist.run import DistSettings
    from conftest import make_job
    from tests.exec.test_exec_parity import hf_greedy

    model, path = saved
    n, page = 12, 8
    rng = np.random.default_rng(7)
    inputs, outputs = rng.integers(24, 40, n), rng.integers(8, 32, n)
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=page,
                   cluster_overrides={"num_gpus": 2},
                   policy_overrides={"b_moe": 8, "b_attn": 2, "kv_residency": "mixed", "attention": "gpu"})
    longest = -(-int((inputs + outputs).max()) // page) * page
    kill_at(1, 12)
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), procs=2, timeout_s=60.0,
                                         kv_budget_mb=kv_mb_for(path, 80, staging_seqs=2, max_context=longest)))
    for sid in range(n):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    rec, = out.recoveries
    assert rec.kept > 0 and rec.requeued > 0 and rec.on_lost_rank > 0
    assert out.kv_traffic["host_resident_seq_steps"] > 0


@pytest.mark.slow  # three processes, about 12 s on the loaded 2-core machine
def test_a_partitioned_straggler_survives_losing_a_shard_holder(tmp_path_factory, loop_kernel, kill_at):
    """3 processes, the straggler PARTITIONed over 2 of them (head shards in two processes); rank 1 is killed
    while it is partitioned: no survivor keeps a shard (the straggler is recomputed), the rest finish; outputs
    equal transformers'."""
    from batchgen.dist.run import DistSettings
    from tests.distributed.test_partition_dist import saved as saved_partition, straggler_job
    from tests.exec.test_exec_parity import hf_greedy

    model, path = saved_partition("mixtral", tmp_path_factory)
    job, outputs = straggler_job(3, 1, 2)
    kill_at(1, 14)
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000),
                                         procs=3, timeout_s=60.0))
    for sid in range(len(outputs)):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    rec, = out.recoveries
    t = out.prepared.state.table
    assert rec.lost == [1] and rec.survivors == [0, 2] and rec.requeued >= 1
    assert t.partitions[0] >= 1 and t.recomputes[0] >= 1  # partitioned before the loss, recomputed after it


# ---- shared host copies and the restore-or-recompute choice (no processes) ----------------------------------
def _cache_with_copies(files, seqs: dict[int, int], page=4):
    """A cache whose host pool is `files`' shared file, holding `seqs` (id -> tokens) as host copies of random
    KV; the pool starts at one page so that it grows (a new file) on the way."""
    cache = PagedKVCache(2, 2, 4, page_size=page, num_pages=16, host_pages=1, host_alloc=files.alloc)
    for sid, n in seqs.items():
        cache.prepare([sid], [n], [0])
        cache._kv.copy_(torch.randn_like(cache._kv))
        cache.yield_to_host([sid])
    return cache


def test_host_pool_in_a_shared_file_outlives_the_cache_and_reads_back_exact(tmp_path):
    files = SharedHostFiles("unit", 3, root=str(tmp_path))
    cache = _cache_with_copies(files, {5: 10, 9: 3})
    want = {sid: cache.export(sid).tokens().clone() for sid in (5, 9)}
    # the pool grew: the new file is in use, the old one stays until an index names the new one
    assert files.current.endswith("-r3-2") and sorted(os.listdir(tmp_path)) == ["batchgen-unit-r3-0",
                                                                                 "batchgen-unit-r3-1",
                                                                                 "batchgen-unit-r3-2"]
    assert files.publish(cache) and not files.publish(cache)  # unchanged: nothing written
    assert sorted(os.listdir(tmp_path)) == ["batchgen-unit-r3-2", "batchgen-unit-r3.idx"]
    del cache  # the process's pool is gone; the file and its index are not
    index = PublishedIndex.load(files.index)
    assert index.readable() and {s: n for s, (n, _) in index.seqs.items()} == {5: 10, 9: 3}
    for sid, rows in want.items():
        got = index.read(sid)
        assert got.length == rows.shape[0] and torch.equal(got.tokens(), rows)
    other = PagedKVCache(2, 2, 4, page_size=4, num_pages=16)  # a survivor adopts it as a host copy
    other.import_(5, index.read(5))
    assert torch.equal(other.export(5).tokens(), want[5])
    assert sweep("unit", str(tmp_path)) == 2 and not os.listdir(tmp_path)


def test_the_index_never_names_a_released_sequence_whose_pages_may_be_reused(tmp_path):
    files = SharedHostFiles("unit", 1, root=str(tmp_path))
    cache = _cache_with_copies(files, {1: 8, 2: 8})
    files.publish(cache)
    assert not files.publish_before_release(cache, [7])  # not in the index: nothing to write
    assert files.publish_before_release(cache, [1])      # before the boundary releases 1
    assert set(PublishedIndex.load(files.index).seqs) == {2}
    cache.release([1])
    files.publish(cache)
    assert set(PublishedIndex.load(files.index).seqs) == {2}
    files.close()
    assert not os.listdir(tmp_path)


def test_a_released_process_hands_its_files_over_to_rank_0(tmp_path):
    """A process whose instance a recovery dropped leaves alive while rank 0 may be reading its host copies:
    its close must not remove them; rank 0's remove_rank does, once read."""
    files = SharedHostFiles("unit", 2, root=str(tmp_path))
    cache = _cache_with_copies(files, {4: 8})
    files.publish(cache)
    files.hand_over()
    files.close()
    index = PublishedIndex.load(index_path("unit", 2, str(tmp_path)))
    assert index.readable() and index.read(4).length == 8
    remove_rank("unit", 2, str(tmp_path))
    assert not os.listdir(tmp_path)


def test_restore_or_recompute_follows_the_latency_model():
    """The job's roofline prices a 100-token restore over the host link far below a prefill; with a host link a
    million times slower the prefill wins."""
    import copy

    from batchgen.job import prepare

    lat = prepare(job_for(2)[0]).latency
    fast = choose(lat, 100)
    assert fast.restore and fast.restore_s < fast.recompute_s
    slow_link = copy.copy(lat)
    slow_link.host_link_bw = lat.host_link_bw / 1e6
    slow = choose(slow_link, 100)
    assert not slow.restore and slow.recompute_s == pytest.approx(fast.recompute_s)
    assert slow.restore_s > 1e3 * fast.restore_s


def test_restore_lost_adopts_exact_copies_it_prices_cheaper_within_the_host_room(tmp_path):
    """Lost rank's copies: 1 (prompt 6 + 3 generated - 1 = 8 tokens: exact), 2 (8 tokens but 5 generated: stale),
    3 (exact, finished), 4 (exact, but a survivor kept it). Restored: 1 alone; with a slow host link, none; with
    host room for less than 9 tokens, none."""
    import copy
    from types import SimpleNamespace

    from batchgen.job import prepare

    files = SharedHostFiles("unit", 1, root=str(tmp_path))
    dead = _cache_with_copies(files, {1: 8, 2: 8, 3: 8, 4: 8})
    rows = dead.export(1).tokens().clone()
    files.publish(dead)
    index = PublishedIndex.load(files.index)
    table = SimpleNamespace(input_len=np.full(5, 6), prefilled=np.zeros(5, int), tp=np.ones(5, int))
    generated = [[], [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 3]]
    done = np.array([False, False, False, True, False])
    lat = prepare(job_for(2)[0]).latency
    slow = copy.copy(lat)
    slow.host_link_bw = lat.host_link_bw / 1e6
    for latency, room, want in ((lat, 100, [1]), (slow, 100, []), (lat, 8, [])):
        cache = PagedKVCache(2, 2, 4, page_size=4, num_pages=16)
        keep = [{4: (False, 8, 0, True)}]
        restored, restorable = restore_lost(cache, keep, [index], table, generated, done, latency, room)
        assert (restored, restorable) == (len(want), 1) and cache.seq_ids() == want
        assert sorted(keep[0]) == sorted([4, *want])
        if want:
            assert keep[0][1] == (False, 8, 0, True) and torch.equal(cache.export(1).tokens(), rows)
            cache.check()
    files.close()


def test_a_bad_shared_host_copies_setting_is_refused_before_any_process_starts(saved):
    from batchgen.dist.errors import DistConfigError
    from batchgen.dist.run import check_dist

    _, path = saved
    with pytest.raises(DistConfigError, match="shared_host_copies='yes': give true or false"):
        check_dist(job_for(2)[0], dist_settings(path, 2, shared_host_copies="yes"))


def test_a_full_tmpfs_falls_back_to_ordinary_memory_and_the_index_names_no_file(tmp_path, monkeypatch):
    import errno

    files = SharedHostFiles("unit", 2, root=str(tmp_path))
    cache = _cache_with_copies(files, {1: 4})  # one page: the first file holds it
    assert files.current and files.fallback is None

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    cache.prepare([2], [9], [0])
    cache.yield_to_host([2])  # the pool grows: no room for a new file
    assert files.current is None and "No space left" in files.fallback
    assert cache.export(2).length == 9 and cache.export(1).length == 4  # the cache goes on in ordinary memory
    files.publish(cache)
    index = PublishedIndex.load(files.index)
    assert index.file is None and not index.readable()  # a reader recomputes this rank's sequences
    files.close()
    assert not os.listdir(tmp_path)


def instances_job(procs: int, per_instance: int):
    from tests.distributed.test_instances import job_for as instance_job

    return instance_job(procs, per_instance, n=N)[0]


@pytest.mark.parametrize("procs,per_instance,lost,survivors,released",
                         [(2, 1, [1], [0], []), pytest.param(4, 2, [3], [0, 1], [2], marks=pytest.mark.slow)],
                         ids=["2x1", "2x2"])
def test_an_instance_that_lost_a_worker_is_dropped_and_the_others_finish(saved, loop_kernel, kill_at, procs,
                                                                         per_instance, lost, survivors, released):
    """Several instances: a worker of instance 1 dies; that instance is dropped whole (its other process leaves
    the run), instance 0 goes on with its group rebuilt and its KV kept, the dropped instance's sequences are
    requeued onto it, and every sequence finishes with the tokens of the single-process executor over the
    launched cluster. Records keep the launched instance numbering."""
    _, path = saved
    kill_at(lost[0], 12)
    out = execute_dist(instances_job(procs, per_instance), dist_settings(path, procs, timeout_s=60.0))
    ref = execute(instances_job(procs, per_instance), ExecSettings(device="cpu", model_path=str(path),
                                                                   kv_budget_mb=kv_mb_for(path, 80), threads=1))
    assert [out.tokens.generated[s] for s in range(N)] == [ref.tokens.generated[s] for s in range(N)]
    t = out.prepared.state.table
    assert out.prepared.state.all_finished() and np.array_equal(t.decoded, t.output_len)
    assert len(out.recoveries) == 1, out.recoveries
    rec = out.recoveries[0]
    assert rec.lost == lost and rec.survivors == survivors and rec.released == released
    # no survivor waits out a collective its step abandoned (it did, for the whole 60 s timeout: groups.retire)
    assert rec.regroup_s < 30, f"the survivors took {rec.regroup_s:.1f} s to regroup"
    assert rec.finished_before < N and rec.requeued > 0
    after = [r for r in out.records if r.start >= rec.at_s]
    assert after and all(r.instance == 0 for r in after)  # only instance 0 ran after the loss
    assert np.all(t.instance[t.finish_time > rec.at_s] == 0)
    assert len(out.rank_busy_s) == len(survivors) and all(b > 0 for b in out.rank_busy_s)
    json.dumps(summarize(out))


@pytest.mark.slow  # four processes on a loaded 2-core machine
def test_losing_a_worker_of_rank_0s_instance_stops_the_run_with_one_line(saved, loop_kernel, kill_at):
    _, path = saved
    kill_at(1, 12)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as err:
        execute_dist(instances_job(4, 2), dist_settings(path, 4, timeout_s=60.0))
    assert time.monotonic() - t0 < 60
    assert "rank 0's instance lost rank 1" in err.value.headline, err.value.headline
    assert err.value.partial is not None


def test_files_of_runs_whose_launcher_is_gone_are_swept(tmp_path):
    """A run killed whole leaves its pools; the next run removes them, and only them: not those of a live
    launcher, nor of a run whose index names another host (a container sharing /dev/shm)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"gone": f"batchgen-{dead.pid}-0123abcd-r0", "live": f"batchgen-{os.getpid()}-0123abcd-r0",
             "away": f"batchgen-{dead.pid}-89abcdef-r0"}
    for name in names.values():
        (tmp_path / f"{name}-0").write_bytes(b"\0" * 64)
    for key, host in (("gone", socket.gethostname()), ("away", "another-host")):
        (tmp_path / f"{names[key]}.idx").write_text(json.dumps({"host": host}) + "\n")
    other = tmp_path / "batchgen-torchrun-1234-r0-0"  # not a one-machine launcher's run id: never touched
    other.write_bytes(b"")
    assert sweep_orphans(str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{names['live']}-0", f"{names['away']}-0", f"{names['away']}.idx", other.name])
