"""backend=dist recovers from a lost worker: a rank other than 0 is SIGKILLed mid-run; the survivors build a
new process group, re-place the experts over themselves and finish every sequence, with greedy outputs equal
to an undisturbed run's token for token (the unfinished sequences are recomputed from prompt + generated
tokens: recovery.py). With recover=false, or when rank 0 dies, the run stops within 30 s with a one-line error.

The reference is the single-process executor, which test_dist_backend shows equal to an undisturbed
backend=dist run over 1, 2 and 4 processes (loop expert kernel, bit-identical logits)."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from batchgen.dist import worker as worker_module
from batchgen.dist.run import DistRunFailed, execute_dist
from batchgen.exec.run import ExecSettings, execute
from batchgen.results import summarize
from tests.distributed.test_dist_backend import N, dist_settings, job_for, loop_kernel, saved  # noqa: F401
from tests.exec.test_exec_parity import kv_mb_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def kill_at(monkeypatch):
    """kill_at(rank, n): the process of launch rank `rank` SIGKILLs itself at its n-th forward (the forked
    workers inherit the patch; the launcher's RANK is the launch rank, whatever a recovery renumbers)."""
    forward = worker_module.RankWorker._forward
    calls = {"n": 0}
    victim = {}

    def dying(self, part, cmd):
        calls["n"] += 1
        if int(os.environ.get("RANK", -1)) == victim["rank"] and calls["n"] == victim["n"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, part, cmd)

    def arm(rank: int, n: int) -> None:
        victim.update(rank=rank, n=n)
        monkeypatch.setattr(worker_module.RankWorker, "_forward", dying)

    return arm


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


@pytest.mark.parametrize("keep", [True, False], ids=["survivor-keeps-its-kv", "everything-recomputed"])
def test_a_killed_worker_is_recovered_from_on_the_survivor(saved, loop_kernel, kill_at, monkeypatch, keep):
    """2 processes, rank 1 killed at its 30th forward (3 sequences done, one running on rank 1 and one whose host
    copy it holds, one of rank 0's mid-forward): rank 0 alone (the plain MoE layer) finishes the job, keeping
    the KV its cache holds (its interrupted forward's slot dropped); or, with nothing kept (the path of a
    survivors' memory plan that gives another pool), recomputing every unfinished sequence."""
    from batchgen.dist import run as run_module

    if not keep:
        monkeypatch.setattr(run_module, "keep_plan", lambda table, generated, done, inventories, split=None:
                            [{} for _ in inventories])
    _, path = saved
    kill_at(1, 30)
    t0 = time.monotonic()
    out = execute_dist(job_for(2)[0], dist_settings(path, 2, timeout_s=60.0))
    took = time.monotonic() - t0
    check_recovered(out, reference(path, 2), 2, lost=[1], survivors=[0], kept=keep)
    assert took < 60
    summary = summarize(out)  # what results.json gets: the recovery, and whose the per-rank numbers are
    assert summary["recoveries"][0]["lost"] == [1] and summary["rank_ids"] == [0]
    json.dumps(summary)


@pytest.mark.slow  # three processes on a loaded 2-core machine
def test_a_killed_worker_of_three_leaves_a_two_process_group(saved, loop_kernel, kill_at):
    """3 processes, rank 1 killed: ranks 0 and 2 form a new group (2 renumbered to 1), the experts re-placed
    over them (all-to-alls in the new group), and finish the job."""
    _, path = saved
    kill_at(1, 30)
    out = execute_dist(job_for(3)[0], dist_settings(path, 3, timeout_s=60.0))
    check_recovered(out, reference(path, 3), 3, lost=[1], survivors=[0, 2])
    assert all(c > 0 for c in out.rank_comm_s)  # both survivors joined all-to-alls (the new group's, too)


def test_without_recovery_the_run_stops_saying_what_finished(saved, loop_kernel, kill_at):
    _, path = saved
    kill_at(1, 30)
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


def test_a_killed_rank_0_stops_the_run_within_seconds_keeping_what_finished(saved, loop_kernel, kill_at):
    """Rank 0 holds the engine and hosts the store: nothing to recover with. The worker must not wait for a
    recovery decision that never comes: it stops naming rank 0. What had finished reached the launcher as it
    finished (DistContext.report), so it survives rank 0."""
    _, path = saved
    kill_at(0, 30)
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
