"""Which runs validation compares, as Hydra overrides: the defaults, and what the command line changes."""

from __future__ import annotations

from pathlib import Path

from batchgen.compare import Case
from batchgen.memory import ConfigError
from batchgen.policy import policy_names

# Small enough for a few minutes on 2 cores (3 repeats of every policy on each), varied enough to move every module:
# a synthetic long tail, and two real traces whose lengths no fit has seen (clipped: CPU time).
WORKLOADS: dict[str, tuple[str, ...]] = {
    "small": ("workload=small", "workload.num_sequences=24", "workload.input.low=32", "workload.input.high=256",
              "workload.output.mean=24", "workload.output.max=96"),
    "azure_conv": ("workload=azure_conv", "workload.num_sequences=24", "workload.max_input=256",
                   "workload.max_output=64"),
    "azure_code": ("workload=azure_code", "workload.num_sequences=24", "workload.max_input=384",
                   "workload.max_output=32"),
}

CPU = "cpu_epyc_milan_2c"
CALIBRATION = CPU + "-{model}.json"  # one per model, shipped under batchgen/data/calibration/
# The executor on this CPU, and the simulator of this CPU: one config for both backends (the same plan for
# "auto" knobs, the same latency model for the plan and the prediction).
BASE: tuple[str, ...] = ("model=tiny_moe", "backend=exec", "backend.device=cpu", "backend.repeats=3",
                         "backend.threads=1", "backend.clock=cpu", f"cluster.gpu={CPU}", "output.plot=false")
# the simulator's model of time, unless the command line picks another (latency=roofline, efficiency=...): a
# calibration of this machine profiled first in the same run (batchgen.validate.fresh)
# auto: conf/efficiency/cpu_epyc_milan_2c.yaml (the fitted factors) when it ships, else the data sheet's
EFFICIENCY: tuple[str, ...] = ("efficiency=auto",)

# what a policy needs beyond the executor's one-GPU default (the command line still wins)
NEEDS: dict[str, tuple[str, ...]] = {"pd_disagg": ("cluster.num_gpus=2",)}  # a prefill and a decode unit

USAGE = """usage: python -m batchgen.validate [HYDRA OVERRIDE ...]
  Profiles this machine's grid first (about a minute; the file is kept under outputs/validate/), then runs each
  workload x policy on the executor (CPU, one thread, timed on the thread's CPU time, the mean of 3 runs taken in
  rounds over all cases) with the in-run stage's jobs spread among them, twice in every round, adds the in-run ratios to
  the calibration, and compares each case with the simulator priced by it.
  workload=NAME [workload.trace=FILE ...]   one workload instead of the default three (one of those three
                                            runs as in the default run: the same sizes)
  policy=NAME[,NAME...]                     only these policies (default: all)
  backend.repeats=N  backend.threads=N      executor runs per case (default 3) and threads (default 1)
  latency.calibration=FILE                  validate a stored calibration instead of profiling (or latency=roofline)
  any other override (model=..., workload.num_sequences=..., efficiency=..., ...) applies to every case
  With a stored file, a few of its own points are timed again before the runs and after each round (a couple of
  seconds): they say whether the file still describes this machine, and where it does not, a line before the
  last gives the errors with the predictions rescaled by their factor."""


def profiles_first(args: list[str]) -> bool:
    """Whether validation profiles this machine first: unless the command line names a model of time."""
    return not any(a.lstrip("+").split("=", 1)[0] in ("latency", "latency.calibration", "latency.name")
                   for a in args)


def cases_from_args(args: list[str], calibration: Path | None = None) -> list[Case]:
    """Cases for the command line `args` (Hydra overrides); raises ConfigError for what validation cannot run.
    `calibration`: the file the run's own profile will write (`profiles_first`), which every case's prediction
    reads; the command line's latency=... / latency.calibration=FILE wins."""
    policies, workload, rest = list(policy_names()), None, []
    model_of_time = {"latency": ("latency=table", f"latency.calibration={calibration}") if calibration else (),
                     "efficiency": EFFICIENCY}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith("-"):
            raise ConfigError(f"{arg!r} is not an override (key=value)\n{USAGE}")
        key = key.lstrip("+")
        if key == "policy":
            policies = [p for p in value.split(",") if p]
            unknown = sorted(set(policies) - set(policy_names()))
            if unknown or not policies:
                raise ConfigError(f"policy={value}: choose among {', '.join(policy_names())} (comma-separated)")
        elif key == "workload":
            workload = value
        elif key in ("latency", "latency.name", "efficiency"):
            model_of_time["efficiency" if key == "efficiency" else "latency"] = (arg,)
        elif key == "latency.calibration":
            model_of_time["latency"] = ("latency=table", arg)
        elif key in ("backend", "backend.name"):
            raise ConfigError(f"{arg}: validation runs both backends itself; leave the backend out")
        else:
            rest.append(arg)
    if workload is None:
        groups = {name: list(o) for name, o in WORKLOADS.items()}
    elif workload in WORKLOADS:  # one of the three alone: the same case as in the default run
        groups = {workload: list(WORKLOADS[workload])}
    else:
        # the executor's defaults clip any workload (exec.yaml); fewer sequences keep a CPU run short
        groups = {workload: [f"workload={workload}", "workload.num_sequences=24"]}
    base = (*BASE, *model_of_time["efficiency"], *model_of_time["latency"])
    return [Case(name, p, (*base, *overrides, f"+policy={p}", *NEEDS.get(p, ()), *rest))
            for name, overrides in groups.items() for p in policies]
