"""Validation's own calibration: this machine profiled in the same run, its in-run stage in the cases' rounds.

Why. A calibration describes one machine at one time: the shipped CPU file was profiled on another CPU model, and
a shared cloud machine's speed moves by tens of percent within minutes, so a stored file can be off by a factor
that says nothing about the simulator. So validation profiles the grid first, then runs the in-run stage's jobs
(the calibration workload, which no validated workload resembles) in the same rounds as the cases it checks,
spread among them: the in-run ratios, measured inside those runs against the grid, then carry the machine's
speed over the same minutes as the cases' runs, and the calibration describes the machine at the moment of the
runs. Timing a few grid points again between rounds and scaling by them did not: those short calls follow the
machine's speed of their own second, not that of the minutes around them (benchmarks/results/validation.md).
The file is kept beside the results, so the same numbers can be predicted again with `latency.calibration=FILE`.
"""
from __future__ import annotations

import time
from pathlib import Path

from batchgen.compare import Case
from batchgen.validate.cases import CPU

GRID = "quick"
REPEATS = 5           # calls per grid point (over the grid's rounds)
STAGE_RUNS = 2        # runs of each in-run job per round


def fresh_path(root: Path | None = None) -> Path:
    """Where this run's calibration goes: outputs/validate/<UTC time>/calibration.json under the working directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return (root or Path.cwd()) / "outputs" / "validate" / stamp / "calibration.json"


def profile_grid(cfg, out: Path, log=None, repeats: int = REPEATS) -> tuple[dict, list[Case]]:
    """Profile the model of `cfg` (a composed validation case) on this CPU with one thread over the quick grid and
    write it to `out`; returns it with the in-run stage's cases (one run each per round), which validation runs
    in the same rounds as the cases it checks (`interleave`)."""
    import torch

    from batchgen.latency.calibration_file import write
    from batchgen.profile.grid import grid_named
    from batchgen.profile.in_run import calibration_cases
    from batchgen.profile.run import ProfileSettings, profile
    from batchgen.setup import model_spec

    spec = model_spec(cfg)
    settings = ProfileSettings(device=torch.device("cpu"), dtype=torch.float32, threads=1, grid=grid_named(GRID),
                               repeats=repeats, page_size=int(cfg.page_tokens), hardware=CPU)
    calibration = profile(spec, settings, log=log)
    write(calibration, out)
    return calibration, calibration_cases(spec.name, "cpu", 1, CPU, out, repeats=1)


def interleave(stage: list, cases: list) -> list[int]:
    """The order of one round: the in-run stage's jobs spread evenly among the cases (indices into cases + stage),
    so that both sample the machine over the same minutes."""
    slots = [((i + 0.5) * len(cases) / len(stage), len(cases) + i) for i in range(len(stage))]
    return [i for _, i in sorted(slots + [(k, k) for k in range(len(cases))])]


def stage_copies_runs(runs: list[list], cases: int, stage: int) -> list[list]:
    """Each stage job's runs, from the runs of `cases` cases followed by STAGE_RUNS copies of the `stage` jobs."""
    return [sum(runs[cases + i::stage], []) for i in range(stage)]


def add_in_run(calibration: dict, out: Path, stage: list, rounds: list[list], log=None) -> None:
    """The in-run ratios from the stage's runs (taken in the validation's rounds), written into the file."""
    from batchgen.latency.calibration_file import write
    from batchgen.profile.in_run import in_run_scales

    calibration["in_run"] = in_run_scales(stage, rounds, log=log)
    write(calibration, out)
    if log:
        log(f"calibrated this machine in {calibration['settings']['wall_s']} s (grid) + the in-run stage, run "
            f"in the same rounds as the cases: {out}")
