"""End-to-end runs of the command line: `python -m batchgen.experiment ...` in a subprocess.

Each run is kept small (a few hundred sequences) so the whole file takes seconds; the default job, which the
README promises finishes in well under 30 s, is checked once and marked slow.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = "workload.num_sequences=200"


def run_cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the entry point with cwd=tmp_path; output goes wherever the hydra.*.dir overrides say."""
    return subprocess.run([sys.executable, "-m", "batchgen.experiment", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def data_rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    return rows[1:]  # after the header


def check_run_dir(run_dir: Path, *, policy: str, num_sequences: int, **expected) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    for key in ("policy", "backend", "num_sequences", "bct_s"):
        assert key in results, f"results.json lacks {key!r}: {sorted(results)}"
    assert results["policy"] == policy
    assert results["backend"] == "sim"
    assert results["num_sequences"] == num_sequences
    assert isinstance(results["bct_s"], (int, float)) and results["bct_s"] > 0
    for key, value in expected.items():
        assert results[key] == value, f"results.json {key}={results[key]!r}, expected {value!r}"
    assert len(data_rows(run_dir / "sequences.csv")) == num_sequences
    for name in ("steps.csv", "devices.csv"):
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
        assert data_rows(run_dir / name), f"{name} has no data rows"
    png = run_dir / "timeline.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "timeline.png missing or not a PNG"
    return results


@pytest.mark.parametrize("policy", ["coroutine", "continuous", "static"])
def test_main_job_writes_results(tmp_path, policy):
    run_dir = tmp_path / "run"
    proc = ok(run_cli(tmp_path, f"+policy={policy}", SMALL, f"hydra.run.dir={run_dir}"))
    results = check_run_dir(run_dir, policy=policy, num_sequences=200, model="qwen3_30b_a3b", cluster="h100_8",
                            num_gpus=8, workload="small")
    assert policy in proc.stdout  # the printed summary table names the policy
    assert str(run_dir / "results.json") in proc.stdout
    # The full resolved config travels with the results, so a run can be reproduced from its results.json.
    assert results["config"]["policy"]["name"] == policy
    assert results["config"]["workload"]["num_sequences"] == 200


def test_overrides_reach_the_results(tmp_path):
    run_dir = tmp_path / "run"
    ok(run_cli(tmp_path, "+policy=coroutine", "model=mixtral_8x7b", "cluster=h100_8", "cluster.num_gpus=16",
               "workload=fixed_1k_1k", "workload.num_sequences=150", "seed=3", f"hydra.run.dir={run_dir}"))
    results = check_run_dir(run_dir, policy="coroutine", num_sequences=150, model="mixtral_8x7b", num_gpus=16,
                            workload="fixed_1k_1k")
    assert results["config"]["seed"] == 3
    rows = data_rows(run_dir / "sequences.csv")
    with (run_dir / "sequences.csv").open(newline="") as f:
        header = next(csv.reader(f))
    i_in, i_out = header.index("input_len"), header.index("output_len")
    assert {int(r[i_in]) for r in rows} == {1024} and {int(r[i_out]) for r in rows} == {1024}


def test_same_seed_same_results(tmp_path):
    bcts = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        ok(run_cli(tmp_path, "+policy=coroutine", SMALL, "seed=7", f"hydra.run.dir={run_dir}"))
        bcts.append(json.loads((run_dir / "results.json").read_text())["bct_s"])
    assert bcts[0] == bcts[1]


def test_output_switches(tmp_path):
    from batchgen.config import OUTPUT_FILES

    run_dir = tmp_path / "run"
    ok(run_cli(tmp_path, "+policy=coroutine", SMALL, *(f"output.{key}=false" for key in OUTPUT_FILES),
               f"hydra.run.dir={run_dir}"))
    assert (run_dir / "results.json").is_file()
    for name in OUTPUT_FILES.values():
        assert not (run_dir / name).exists(), name
    bad = run_cli(tmp_path, "+policy=coroutine", SMALL, "output.steps_csv=no", f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.returncode == 2 and "output.steps_csv must be true or false" in bad.stderr, bad.stderr


def test_sweep_two_policies_two_gpu_counts(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = ok(run_cli(tmp_path, "-m", "+policy=coroutine,continuous", "cluster.num_gpus=8,16", SMALL,
                      f"hydra.sweep.dir={sweep_dir}"))
    found = sorted(sweep_dir.glob("*/results.json"))
    assert len(found) == 4, found
    combos = set()
    for path in found:
        r = json.loads(path.read_text())
        assert r["backend"] == "sim" and r["num_sequences"] == 200 and r["bct_s"] > 0
        combos.add((r["policy"], r["num_gpus"]))
        assert (path.parent / "sequences.csv").is_file() and (path.parent / "timeline.png").is_file()
    assert combos == {("coroutine", 8), ("coroutine", 16), ("continuous", 8), ("continuous", 16)}
    out = proc.stdout
    assert "sweep summary" in out.lower()
    summary = out[out.lower().index("sweep summary"):]
    for policy in ("coroutine", "continuous"):
        assert policy in summary
    # One table row per run after the header: each run's policy and GPU count appear on a line together.
    lines = summary.splitlines()
    for policy, gpus in combos:
        assert any(line.split()[:2] == [policy, str(gpus)] for line in lines if line.strip()), \
            f"no summary row for {policy} on {gpus} GPUs:\n{summary}"


@pytest.mark.slow
def test_default_main_job_is_quick(tmp_path):
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    proc = ok(run_cli(tmp_path, "+policy=coroutine", f"hydra.run.dir={run_dir}"))
    wall = time.perf_counter() - start
    assert wall < 60, f"the default job took {wall:.1f} s (promised: well under 30 s)"
    check_run_dir(run_dir, policy="coroutine", num_sequences=2000, workload="small")
    assert "coroutine" in proc.stdout


def test_sweep_with_an_impossible_point_runs_the_rest_and_fails_at_the_end(tmp_path):
    """DeepSeek-R1 does not fit 8 H100s for continuous (it keeps all weights on the GPUs) but does for
    coroutine (it streams experts): the sweep runs coroutine, reports continuous, and exits 2."""
    sweep = tmp_path / "sweep"
    proc = run_cli(tmp_path, "-m", "+policy=coroutine,continuous", "model=deepseek_r1", "workload.num_sequences=50",
                   "output.plot=false", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (sweep / "0" / "results.json").is_file()
    assert not (sweep / "1" / "results.json").exists()
    assert "sweep summary" in proc.stdout and "coroutine" in proc.stdout
    assert "run 1 failed" in proc.stderr and "+policy=coroutine" in proc.stderr


def test_the_usual_command_line_is_checked_without_composing(monkeypatch):
    """Keys found in the files the command composes pass without a second composition; a key not found
    there still gets the composed check's line."""
    import batchgen.cli as cli

    composed = []
    real = cli._composed
    monkeypatch.setattr(cli, "_composed", lambda *a: composed.append(a) or real(*a))
    assert cli.command_line_problem(["+policy=coroutine", "workload.num_sequences=20", "cluster.num_gpus=4",
                                     "seed=3", "memory.gpu_memory_fraction=0.5"], "batchgen.experiment") is None
    assert composed == []
    problem = cli.command_line_problem(["+policy=coroutine", "workload.num_sequence=20"], "batchgen.experiment")
    assert "did you mean workload.num_sequences" in problem and len(composed) == 1


def test_no_config_of_ours_sets_hydra_mode_so_its_probe_can_be_skipped():
    """`cli._skip_mode_probe` answers Hydra's `get_mode` with None without composing: true only while no config
    file of batchgen's sets `hydra.mode` (each primary config, and each experiment, composed for real here), and
    only for command lines that cannot set it."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    from batchgen.cli import sets_hydra_mode
    from batchgen.confdir import conf_dir

    from batchgen import cli

    probe = cli.HYDRA_GET_MODE or Hydra.get_mode  # Hydra's own, also where a command run here replaced it
    experiments = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
    hydra = Hydra.create_main_hydra2(task_name="probe", config_search_path=create_config_search_path(str(conf_dir())))
    try:
        for config, overrides in [("config", ["+policy=coroutine"]), ("run", ["+policy=coroutine"])] + [
                ("config", [f"+experiment={name}"]) for name in experiments]:
            assert probe(hydra, config, overrides) is None, (config, overrides)
        assert probe(hydra, "config", ["+policy=coroutine", "hydra.mode=MULTIRUN"]) is not None  # it can tell
    finally:
        GlobalHydra.instance().clear()  # as Hydra's own entry points leave it
    assert not sets_hydra_mode(["+policy=continuous", "workload.num_sequences=20000", "hydra.run.dir=out"])
    assert not sets_hydra_mode(["-m", "+policy=continuous,coroutine"])
    for args in (["hydra.mode=MULTIRUN"], ["--config-dir", "mine"], ["-cd=mine"], ["hydra/launcher=joblib"]):
        assert sets_hydra_mode(args), args
