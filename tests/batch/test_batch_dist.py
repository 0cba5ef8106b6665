"""Batch jobs on backend=dist (`python -m batchgen.run backend=dist backend.procs=N`): the records of a
2-process job equal the single-process job's; a job killed whole with SIGKILL (its launcher alone, then its
whole process group) and rerun ends with every custom_id exactly once and the same records; a job whose
processes' host KV pools together exceed the machine's memory is refused before any work, naming the setting."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.batch.test_batch_job import SMALL_EXEC, chat, comparable, completion, read_records, run_in_process, \
    write_lines

# torchrun beside this interpreter too: a virtual environment's python run without activating it
TORCHRUN = shutil.which("torchrun") or shutil.which("torchrun", path=os.path.dirname(sys.executable))
DIST = ["backend=dist", "backend.procs=2", "backend.kv_budget_mb=8", "backend.lost_after_s=30"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from batchgen.batch.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo"), requests=False)


def mixed_requests(n: int, longest: int = 40) -> list:
    """Completions and chats, greedy and sampled (with and without a seed), some with stop strings, some with
    three choices, and one bad line."""
    lines = []
    for k in range(n):
        body = {"temperature": 0.8, "seed": k} if k % 3 == 0 else {"temperature": 0.7} if k % 7 == 0 else {}
        if k % 5 == 0:
            body["stop"] = ["."]
        if k % 6 == 3:
            body["n"] = 3
        make = chat if k % 4 == 1 else completion
        lines.append(make(f"r{k}", f"Request {k}: summarize the following text", max_tokens=10 + k % longest,
                          **body))
    lines.insert(5, "{torn")
    return lines


def test_a_two_process_job_writes_the_single_process_jobs_records(demo, tmp_path, capsys):
    requests = write_lines(tmp_path / "requests.jsonl", mixed_requests(36))
    run_in_process(demo, requests, tmp_path / "exec.jsonl")
    run_in_process(demo, requests, tmp_path / "dist.jsonl", *DIST)
    printed = capsys.readouterr().out
    assert "37 requests: 36 completed now, 0 already in the output, 1 failed (error records)" in printed
    exec_records, dist_records = read_records(tmp_path / "exec.jsonl"), read_records(tmp_path / "dist.jsonl")
    assert len(dist_records) == 37 and comparable(dist_records) == comparable(exec_records)
    assert not Path(f"{tmp_path / 'dist.jsonl'}.partial").exists()


def _records(path: Path) -> int:
    """Whole lines: a kill may leave a torn last one, which the rerun cuts."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for p in pids:
            try:
                os.kill(p, 0)
                alive.append(p)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _kill_mid_way(command: list[str], output: Path, log: Path, whole_group: bool) -> tuple[int, int]:
    """Start the job, SIGKILL it once it has written 15 more records and a checkpoint (the launcher alone, or
    its whole process group), check that its workers died with it; (the launcher's pid, records after)."""
    before = _records(output)
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "BATCHGEN_PROGRESS": "0"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if _records(output) > before + 15 and Path(f"{output}.partial").exists():
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the job ended before the kill:\n{log.read_text()}"
    workers = _children(proc.pid)
    assert len(workers) == 2
    if whole_group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(workers, 5), "a worker outlived its killed launcher"
    return proc.pid, _records(output)


def _rerun_and_compare(command: list[str], output: Path, baseline: Path, left_before: int, launchers: list[int]):
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BATCHGEN_PROGRESS": "0"})
    assert done.returncode == 0, done.stderr
    assert f"{left_before - 1} already in the output" in done.stdout  # (the bad line's record is not counted)
    assert "requests continued from the" in done.stdout
    records = read_records(output)
    assert len(records) == 121  # every custom_id once, and the bad line's error record once (comparable checks)
    assert comparable(records) == comparable(read_records(baseline))
    assert not Path(f"{output}.partial").exists() and not Path(f"{output}.partial.tmp").exists()
    if os.path.isdir("/dev/shm"):  # the killed runs' host pools were swept by the rerun
        left = [f for f in os.listdir("/dev/shm") if any(f.startswith(f"batchgen-{pid}-") for pid in launchers)]
        assert not left, left


@pytest.fixture(scope="module")
def long_job(demo, tmp_path_factory):
    """120 requests and one bad line, and the single-process job's records."""
    tmp = tmp_path_factory.mktemp("long")
    requests = write_lines(tmp / "requests.jsonl", mixed_requests(120, longest=60))
    run_in_process(demo, requests, tmp / "baseline.jsonl")
    return requests, tmp / "baseline.jsonl"


@pytest.mark.slow
def test_sigkill_of_the_whole_job_then_rerun(demo, long_job, tmp_path):
    requests, baseline = long_job
    output = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "batchgen.run", *SMALL_EXEC, *DIST, f"model.path={demo}",
               f"job.input={requests}", f"job.output={output}", "job.checkpoint_s=0.2"]
    launchers, counts = [], []
    for attempt, whole_group in enumerate((False, True)):  # the launcher alone (the OOM killer), then its group
        pid, n = _kill_mid_way(command, output, tmp_path / f"attempt{attempt}.out", whole_group)
        launchers.append(pid)
        counts.append(n)
    assert counts[0] < counts[1] < 121  # each attempt added records, and the job was not done
    _rerun_and_compare(command, output, baseline, counts[1], launchers)


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")
def test_sigkill_of_a_torchrun_job_then_rerun(demo, long_job, tmp_path):
    """torchrun starts each worker in a session of its own: they still die with a killed agent."""
    requests, baseline = long_job
    output = tmp_path / "results.jsonl"
    command = [TORCHRUN, "--nproc-per-node=2", "-m", "batchgen.run", *SMALL_EXEC, *DIST, f"model.path={demo}",
               f"job.input={requests}", f"job.output={output}", "job.checkpoint_s=0.2"]
    agent, n = _kill_mid_way(command, output, tmp_path / "attempt.out", whole_group=False)
    assert n < 121
    _rerun_and_compare(command, output, baseline, n, [agent])


def test_host_kv_pools_of_all_processes_must_fit_the_machine(demo, tmp_path, monkeypatch):
    """backend.host_kv_gb is each process's pool bound: two processes count it twice against the free memory."""
    from batchgen.dist import run as dist_run
    from batchgen.exec.fits import free_bytes
    from batchgen.memory import ConfigError

    import torch

    requests = write_lines(tmp_path / "requests.jsonl", [completion("a", "hello", max_tokens=4)])
    gb = round(0.6 * free_bytes(torch.device("cpu")) / 1e9, 2)  # one pool fits (0.9 of it is usable), two do not
    output = tmp_path / "out.jsonl"
    with pytest.raises(ConfigError) as refused:
        run_in_process(demo, requests, output, *DIST, f"backend.host_kv_gb={gb}")
    message = str(refused.value)
    assert "\n" not in message and f"backend.host_kv_gb={gb} GB per node, a host KV pool in each of 2 processes" \
        in message and "lower backend.host_kv_gb" in message
    assert not output.read_text()  # no record: nothing ran

    class Launched(Exception):
        pass

    def launch(*a, **k):
        raise Launched
    monkeypatch.setattr(dist_run, "launch", launch)
    with pytest.raises(Launched):  # the same budget for one process passes the check and reaches the launcher
        run_in_process(demo, requests, output, *DIST, "backend.procs=1", f"backend.host_kv_gb={gb}")


def test_a_stopped_run_keeps_what_finished_and_a_rerun_resumes(demo, tmp_path, monkeypatch):
    """backend.recover=false: a worker killed at its 30th forward stops the run; the error says the results file
    keeps what finished, and the same command then completes the job with the single-process job's records."""
    from batchgen.batch.job import JobStopped
    from batchgen.dist import worker as worker_module

    requests = write_lines(tmp_path / "requests.jsonl", mixed_requests(36))
    run_in_process(demo, requests, tmp_path / "exec.jsonl")
    forward, calls = worker_module.RankWorker._forward, {"n": 0}

    def dying(self, part, cmd):  # the forked workers inherit it; only rank 1 dies
        calls["n"] += 1
        if os.environ.get("RANK") == "1" and calls["n"] == 30:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, part, cmd)
    monkeypatch.setattr(worker_module.RankWorker, "_forward", dying)
    output = tmp_path / "dist.jsonl"
    with pytest.raises(JobStopped) as stopped:
        run_in_process(demo, requests, output, *DIST, "backend.recover=false", "job.checkpoint_s=0.1")
    headline = str(stopped.value).splitlines()[:2]
    assert headline[0].startswith("backend=dist stopped: rank 0: WorkerLost: worker lost: rank 1")
    assert headline[1] == "the results file keeps every request that finished: run the same command again to resume"
    kept = _records(output)
    assert 1 < kept < 37
    monkeypatch.setattr(worker_module.RankWorker, "_forward", forward)
    run_in_process(demo, requests, output, *DIST)
    assert comparable(read_records(output)) == comparable(read_records(tmp_path / "exec.jsonl"))
