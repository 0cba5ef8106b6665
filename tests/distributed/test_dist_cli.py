"""`python -m batchgen.experiment backend=dist backend.procs=N`: the same entry point and result files, with
one process per GPU, and metrics over the processes that exist."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(tmp_path, *overrides, policy="coroutine"):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", f"+policy={policy}", "backend=dist",
                           "model=tiny_moe", "workload.num_sequences=12", "workload.max_input=48",
                           "workload.max_output=16", "output.plot=false", f"hydra.run.dir={run}", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return proc, run


def test_dist_backend_writes_results_over_its_processes(tmp_path):
    proc, run = run_cli(tmp_path, "backend.procs=2")
    assert proc.returncode == 0, proc.stderr
    r = json.loads((run / "results.json").read_text())
    assert r["backend"] == "dist" and r["num_gpus"] == 2 and r["procs"] == 2 and r["num_instances"] == 1
    assert r["cluster"] == "executor: 2 processes on cpu"
    # per process, measured by that process; tokens/s per GPU divides by the 2 processes that ran
    assert len(r["rank_busy_s"]) == len(r["rank_comm_s"]) == len(r["rank_idle_s"]) == 2
    assert min(r["rank_busy_s"]) > 0 and min(r["rank_comm_s"]) > 0
    lines = [json.loads(x) for x in (run / "outputs.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == list(range(12))
    tokens = sum(len(x["output_token_ids"]) for x in lines)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(tokens / (r["bct_s"] * 2), rel=1e-3)
    assert "rank 1: busy" in proc.stdout


@pytest.mark.slow  # a CLI run of two processes: about 50 s on the loaded 2-core machine
def test_dist_runs_two_concurrent_instances(tmp_path):
    """cluster.gpus_per_instance=1 over 2 processes: two instances, each its own process (tests/distributed/
    test_instances.py shows they overlap and match the single-process executor)."""
    proc, run = run_cli(tmp_path, "backend.procs=2", "cluster.gpus_per_instance=1")
    assert proc.returncode == 0, proc.stderr
    r = json.loads((run / "results.json").read_text())
    assert r["backend"] == "dist" and r["procs"] == 2 and r["num_instances"] == 2
    assert len(r["rank_busy_s"]) == 2 and min(r["rank_busy_s"]) > 0
    lines = [json.loads(x) for x in (run / "outputs.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == list(range(12))


@pytest.mark.parametrize("policy,overrides,message", [
    ("coroutine", ("backend.procs=16",), "use at most 8 processes"),
    ("sglang_opt", ("backend.procs=2", "policy.two_batch_overlap=true"), "not supported under backend=dist"),
])
def test_dist_refuses_what_it_does_not_run(tmp_path, policy, overrides, message):
    """Refused with a one-line error before any process starts."""
    proc, run = run_cli(tmp_path, *overrides, policy=policy)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (run / "results.json").exists()
