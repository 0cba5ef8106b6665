"""A sweep on Hydra's joblib launcher (the cores of one machine) gives the same sweep.csv, table and figure as the
sequential one: each run's seed and outputs depend on its overrides only, never on which worker ran it. The
SLURM launcher's config (conf/hydra/launcher/slurm.yaml) composes onto submitit's when that plugin is installed."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys

import pytest

# columns that time the simulator itself (wall clock), which differ between any two runs
WALL_CLOCK = {"wall_s", "seqs_per_wall_s"}
SWEEP = ["+policy=coroutine,static", "model=tiny_moe", "workload.num_sequences=40,80", "output.sequences_csv=false",
         "output.decisions_csv=false"]


def sweep(tmp_path, name: str, *launcher: str) -> tuple[list[dict], str]:
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", "-m", *launcher, *SWEEP,
                           f"hydra.sweep.dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "sweep.png").is_file() and (out / "sweep.pdf").is_file()
    with (out / "sweep.csv").open(newline="") as f:
        rows = [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in csv.DictReader(f)]
    summary = proc.stdout[proc.stdout.index("== sweep summary =="):]
    return rows, "\n".join(line for line in summary.splitlines() if not line.startswith("written:"))


def test_joblib_sweep_equals_the_sequential_sweep(tmp_path):
    rows, table = sweep(tmp_path, "sequential")
    parallel_rows, parallel_table = sweep(tmp_path, "joblib", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert len(rows) == 4
    assert parallel_rows == rows
    assert parallel_table == table


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="hydra-submitit-launcher (the slurm extra) is not installed")
def test_the_slurm_launcher_config_composes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", "hydra/launcher=slurm", "+policy=coroutine",
                           "hydra.launcher.partition=gpu", "--cfg", "hydra", "-p", "hydra.launcher"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "SlurmLauncher" in proc.stdout and "partition: gpu" in proc.stdout and "timeout_min: 120" in proc.stdout
