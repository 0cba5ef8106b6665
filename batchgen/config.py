"""From a Hydra config to a validated `Job`: every bad input is reported here, before any work starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from batchgen.instances import plan_instances
from batchgen.job import Job
from batchgen.memory import ConfigError
from batchgen.overrides import check_known_keys
from batchgen.setup import build_setup, checked_calibration, model_path, model_spec, typed
from batchgen.workload import build_workload

BACKENDS = ("sim", "exec", "dist")
# output.<switch>: false turns that file of a run off (conf/config.yaml); results.json is always written
OUTPUT_FILES = {"sequences_csv": "sequences.csv", "decisions_csv": "decisions.csv", "steps_csv": "steps.csv",
                "devices_csv": "devices.csv", "device_timeline_csv": "device_timeline.csv",
                "plot": "timeline.png"}


def build_job(cfg: DictConfig, base_dir: Path | None = None, *, command: str | None = "batchgen.experiment") -> Job:
    """Validate the config and build the job; raises ConfigError with a message that says how to fix it.

    `command`: whose keys the config may hold (`check_known_keys`; conf/config.yaml's for batchgen.experiment),
    None to skip that check (a caller that checked its own config already). With a model directory (model.path,
    or backend.model_path for the executor) the model's name and shape come from its config.json."""
    if command is not None:
        check_known_keys(cfg, command)
    setup = build_setup(cfg, command=command or "batchgen.experiment")
    backend = cfg.get("backend", {}).get("name")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    model = model_spec(cfg, executor_element_bytes(cfg) if backend in ("exec", "dist") else None)
    checked_calibration(setup, model)
    try:
        workload = build_workload(cfg.workload, seed=typed(cfg, "seed", int, 0), base_dir=base_dir,
                                  progress=progress_setting(cfg))
        check_context(model, workload)
        job = Job(model=model, cluster=setup.cluster, workload=workload, policy=setup.policy,
                  memory=setup.memory, efficiency=setup.efficiency, latency=setup.latency,
                  page_tokens=setup.page_tokens, routing_skew=setup.routing_skew,
                  check_invariants=setup.check_invariants)
        if setup.instances_planned:
            job = plan_instances(job)
        return job
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def check_context(model, workload) -> None:
    """Prompt + output must fit the model's context; the workload's lengths are never clipped silently, so the
    error names the cap that fixes it (rl_rollout's 64K outputs vs Qwen3-30B-A3B's 40,960 positions)."""
    if not len(workload):
        return
    longest_in, longest_out = int(workload.input_lens.max()), int(workload.output_lens.max())
    total = workload.input_lens + workload.output_lens
    worst = int(np.argmax(total))
    longest = int(total[worst])
    context = model.max_context
    if longest <= context:
        return
    room = context - longest_in
    fix = (f"set workload.max_output={room} (the context less the longest prompt)" if room > 0 else
           "set workload.max_input below the context (and workload.max_output to fit prompt + output in it)")
    raise ConfigError(f"workload {workload.name} has outputs of up to {longest_out:,} tokens and prompts of up to "
                      f"{longest_in:,} (sequence {worst} needs {longest:,}), but {model.name}'s context is {context:,} "
                      f"tokens (prompt + output): {fix}, or pick a model with a longer context")


def executor_element_bytes(cfg: DictConfig) -> float | None:
    """Bytes per weight the executor will hold a model directory in (its dtype), for the model's spec."""
    if not model_path(cfg):
        return None
    from batchgen.exec.run import ExecSettings

    b = cfg.backend
    return ExecSettings(device=b.get("device", "auto"), dtype=b.get("dtype", "auto")).resolved_dtype().itemsize


def progress_setting(cfg: DictConfig) -> Any:
    """output.progress (auto, true, false; see batchgen.progress), checked; auto when the config has none."""
    output = cfg.get("output")
    value = output.get("progress", "auto") if output is not None else "auto"
    if not (isinstance(value, bool) or value is None or value == "auto"):
        raise ConfigError(f"output.progress must be auto, true or false, got {value!r}")
    return value


def skipped_outputs(cfg: DictConfig) -> set[str]:
    """The files of a run that the config turns off (`OUTPUT_FILES`), checked: each switch is true or false (a
    missing one is true), so that a typo such as output.steps_csv=flase is an error, not a file written anyway."""
    output = cfg.get("output") or {}
    skipped = set()
    for key, name in OUTPUT_FILES.items():
        value = output.get(key, True)
        if not isinstance(value, bool):
            raise ConfigError(f"output.{key} must be true or false (write {name} or not), got {value!r}")
        if not value:
            skipped.add(name)
    return skipped
