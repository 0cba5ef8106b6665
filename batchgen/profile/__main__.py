"""python -m batchgen.profile model=<name> backend.device=<cpu|cuda> [key=value ...]: see batchgen.profile.

Own keys: grid (quick, full, test), out (the JSON path), warmup, repeats, hardware (the conf/hardware name of
this device: recorded, and needed by the in-run stage), backend.threads (default 1 on CPU: what the validation
pins), in_run (true: after the grid, run the executor on the calibration workload and store the in-run ratios,
batchgen.profile.in_run), in_run_repeats (5). Every other key=value is a Hydra
override of the repo's config composed with backend=exec (model=..., backend.dtype=..., page_tokens=...), so
the profile sees the executor's own settings (e.g. its KV page size).
"""
from __future__ import annotations

import sys
from pathlib import Path

OWN = ("grid", "out", "warmup", "repeats", "hardware", "backend.threads", "seed", "in_run", "in_run_repeats")


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    own, overrides = {}, []
    for arg in argv:
        if "=" not in arg:
            raise ValueError(f"argument {arg!r} is not key=value: e.g. python -m batchgen.profile model=tiny_moe "
                             "backend.device=cpu")
        key, value = arg.split("=", 1)
        if key.lstrip("+") in OWN:
            own[key.lstrip("+")] = value
        else:
            overrides.append(arg)
    return own, overrides


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from batchgen.cli import command_line_problem
    from batchgen.confdir import conf_dir
    from batchgen.specs.catalog import model_names

    problem = command_line_problem(["backend=exec", *overrides], "batchgen.experiment")  # one line, as the others
    if problem:
        raise ValueError(f"bad argument: {problem}")
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=["backend=exec", *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        first = str(e).strip().splitlines()[0]
        if "model" in first:
            first += f" (models: {', '.join(model_names())})"
        raise ValueError(f"bad argument: {first}") from None


def main(argv: list[str]) -> int:

    from batchgen.exec.run import ExecSettings
    from batchgen.memory import ConfigError
    from batchgen.profile.grid import grid_named
    from batchgen.profile.run import ProfileSettings, log_stderr, profile, summary
    from batchgen.setup import model_spec
    from batchgen.latency.calibration_file import write

    try:
        own, overrides = parse(argv)
        if not any(o.split("=", 1)[0] == "model" for o in overrides):
            raise ValueError("which model? add model=<name>, e.g. model=tiny_moe")
        cfg = compose(overrides)
        spec = model_spec(cfg)  # the group's spec, or a model.path's config.json
        exec_settings = ExecSettings(device=cfg.backend.device, dtype=cfg.backend.dtype)
        device = exec_settings.instance_devices(1)[0]
        dtype = exec_settings.torch_dtype([device])
        threads = own.get("backend.threads", cfg.backend.get("threads", None))
        if threads in (None, "auto"):
            threads = 1 if device.type == "cpu" else None
        settings = ProfileSettings(device=device, dtype=dtype, threads=None if threads is None else int(threads),
                                   grid=grid_named(own.get("grid", "quick")), warmup=int(own.get("warmup", 2)),
                                   repeats=int(own.get("repeats", 7)), page_size=int(cfg.page_tokens),
                                   hardware=own.get("hardware"), seed=int(own.get("seed", 0)))
        if settings.repeats < 1 or settings.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(own.get("out", f"calibration-{device.type}-{spec.name}.json"))
    calibration = profile(spec, settings, log=log_stderr)
    write(calibration, out)
    if own.get("in_run", "true").lower() not in ("false", "0", "no") and settings.hardware:
        from batchgen.profile.in_run import calibration_cases, in_run_scales

        cases = calibration_cases(spec.name, cfg.backend.device, settings.threads, settings.hardware, out,
                                  repeats=int(own.get("in_run_repeats", 5)))
        calibration["in_run"] = in_run_scales(cases, log=log_stderr)
        write(calibration, out)
    elif not settings.hardware:
        log_stderr("no in-run stage: give hardware=<conf/hardware name of this device> to run it")
    print(summary(calibration))
    print(f"wrote {out} ({calibration['settings']['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
