"""Validation's own calibration: this machine profiled in the same run, just before the executor's runs.

Why. A calibration describes one machine at one time: the shipped CPU file was profiled on another CPU model, and
a shared cloud machine's speed moves by tens of percent within minutes, so a stored file can be off by a factor
that says nothing about the simulator. Profiling first (the quick grid, then the in-run ratios on the calibration
workload, which no validated workload resembles) makes the calibration describe the machine at the moment of the
runs; the calibration checks between the executor's rounds then say whether it still does. The file is kept
beside the results, so the same numbers can be predicted again with `latency.calibration=FILE`.
"""
from __future__ import annotations

import time
from pathlib import Path

from batchgen.validate.cases import CPU

GRID = "quick"
REPEATS = 5           # calls per grid point (over the grid's rounds)
IN_RUN_REPEATS = 2    # executor repeats per policy of the in-run stage (the fastest on the CPU clock)


def fresh_path(root: Path | None = None) -> Path:
    """Where this run's calibration goes: outputs/validate/<UTC time>/calibration.json under the working directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return (root or Path.cwd()) / "outputs" / "validate" / stamp / "calibration.json"


def profile_here(cfg, out: Path, log=None, repeats: int = REPEATS, in_run_repeats: int = IN_RUN_REPEATS) -> dict:
    """Profile the model of `cfg` (a composed validation case) on this CPU with one thread, the quick grid and the
    in-run stage, and write the calibration to `out`; returns it."""
    import torch

    from batchgen.latency.calibration_file import write
    from batchgen.profile.grid import grid_named
    from batchgen.profile.run import ProfileSettings, profile
    from batchgen.setup import model_spec
    from batchgen.validate.in_run import calibration_cases, in_run_scales

    spec = model_spec(cfg)
    settings = ProfileSettings(device=torch.device("cpu"), dtype=torch.float32, threads=1, grid=grid_named(GRID),
                               repeats=repeats, page_size=int(cfg.page_tokens), hardware=CPU)
    calibration = profile(spec, settings, log=log)
    write(calibration, out)
    cases = calibration_cases(spec.name, "cpu", 1, CPU, out, repeats=in_run_repeats)
    calibration["in_run"] = in_run_scales(cases, log=log)
    write(calibration, out)
    if log:
        log(f"calibrated this machine in {calibration['settings']['wall_s']} s (grid) + the in-run stage: {out}")
    return calibration
