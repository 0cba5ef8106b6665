"""One case: the executor's measurement, the simulator's prediction for the same decisions, and their gap.

Validation (batchgen.validate) compares its cases this way, and the profiler's in-run stage
(batchgen.profile.in_run) its calibration jobs."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.memory import ConfigError
from batchgen.decisions import Difference, first_difference, trace_of
from batchgen.results.metrics import bct

MODULES = ("attention", "ffn", "head")  # the rest: whatever the BCT holds beyond them (overheads, copies)


@dataclass(frozen=True)
class Case:
    """One run to compare: a workload and a policy, as Hydra overrides."""

    workload: str
    policy: str
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.workload}/{self.policy}"


@dataclass
class Side:
    """One backend's run: BCT and seconds per module (the rest included)."""

    bct_s: float
    modules: dict[str, float] = field(default_factory=dict)


@dataclass
class CaseResult:
    case: Case
    measured: Side                # a statistic of the case's runs (rounds interleaved with every other case)
    predicted: Side
    runs_s: list[float]           # every executor run's BCT (on the CPU clock, the working thread's CPU time)
    cpu_share: float              # the runs' mean CPU seconds / (wall x threads): < 1 when the cores were taken
    difference: Difference | None  # where the decision traces part (the first run that parts); None: equal
    boundaries: int
    drift: float | None = None    # this machine's seconds per calibrated second during the run (profile.probe)
    clock: str = "wall"           # what the executor timed with (batchgen.exec.clock)
    wall_s: float = 0.0           # the runs' mean wall-clock BCT (beside a CPU-clock one)
    predicted_records: list = field(default_factory=list, repr=False)  # the simulator's step records

    @property
    def error(self) -> float:
        """Signed relative BCT error of the prediction."""
        return self.predicted.bct_s / self.measured.bct_s - 1.0

    @property
    def cpu_error(self) -> float:
        """The error against the measured BCT scaled by the CPU share: an estimate of what an idle machine
        would have measured (one thread descheduled part of the time), to tell noise from model error. On the
        CPU clock the measurement is already that: the error itself."""
        if self.clock == "cpu":
            return self.error
        return self.predicted.bct_s / (self.measured.bct_s * self.cpu_share) - 1.0 if self.cpu_share else self.error

    @property
    def drift_error(self) -> float:
        """The error of the prediction rescaled by the calibration check's factor: an estimate of the error left
        once the machine's change of speed since it was profiled is taken out (the model of time's own)."""
        return self.predicted.bct_s * self.drift / self.measured.bct_s - 1.0 if self.drift else self.error

    @property
    def spread(self) -> float:
        return (max(self.runs_s) - min(self.runs_s)) / statistics.median(self.runs_s)

    def module_error(self, name: str) -> float | None:
        meas, pred = self.measured.modules.get(name), self.predicted.modules.get(name)
        return None if meas is None or pred is None or meas <= 0 else pred / meas - 1.0


def compose_case(case: Case):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(case.overrides))


def calibrations(configs: list) -> dict[Path, object]:
    """The calibration files the cases' predictions read (latency=table), each with its model's spec; from the
    cases' composed configs (`compose_case`)."""
    from batchgen.latency import LatencySettings
    from batchgen.setup import model_spec, plain

    out = {}
    for cfg in configs:
        latency = LatencySettings(**plain(cfg.get("latency")))
        if latency.name == "table":
            out.setdefault(latency.calibration_path(), model_spec(cfg))
    return out


def module_totals(records, total: float) -> dict[str, float]:
    """Seconds per module over a run, and `rest` = the BCT minus them (None-free: a module not timed is 0)."""
    out = {m: float(sum(r.modules.get(m, 0.0) for r in records)) for m in MODULES}
    out["rest"] = total - sum(out.values())
    return out


def side_of(run) -> Side:
    """One run's BCT and seconds per module."""
    total = bct(run)
    return Side(total, module_totals(run.records, total))


# how a case's runs are summarised. Validation uses the mean; the median, which would keep out one run that a slow
# spell hit, did no better on the same runs (benchmarks/validation_paired.py --variant statistic)
STATISTICS = {"mean": statistics.mean, "median": statistics.median}


def summary_side(runs: list, statistic: str = "mean") -> Side:
    """`statistic` (a name in STATISTICS) over runs of their BCT and of each module's seconds."""
    of, sides = STATISTICS[statistic], [side_of(r) for r in runs]
    return Side(of([s.bct_s for s in sides]), {m: of([s.modules[m] for s in sides]) for m in sides[0].modules})


def measure_rounds(cases: list[Case], progress=None, configs: list | None = None) -> list[list]:
    """Each case's executor repeats, taken in rounds over all cases (case 1 run 1, case 2 run 1, ..., case 1
    run 2, ...): a slow spell of a shared machine, which lasts seconds to minutes, then costs one run of several
    cases instead of every run of one. Returns each case's runs, one per round.
    `configs`: the cases' configs as `compose_case` made them (composed here where not given)."""
    from batchgen.exec.run import ExecSettings, execute

    jobs = []
    for case, cfg in zip(cases, configs if configs is not None else [compose_case(case) for case in cases],
                         strict=True):
        settings = {k: v for k, v in OmegaConf.to_container(cfg.backend, resolve=True).items() if k != "name"}
        try:
            jobs.append((build_job(cfg, base_dir=Path.cwd()), ExecSettings(**settings)))
        except TypeError as e:
            raise ConfigError(f"bad backend setting: {e}") from e
    runs: list[list] = [[] for _ in cases]
    for k in range(max(s.repeats for _, s in jobs)):
        for i, (job, s) in enumerate(jobs):
            if k < s.repeats:
                runs[i].append(execute(job, dataclasses.replace(s, repeats=1)))
        if progress:
            progress(k + 1)
    return runs


def compare(case: Case, runs: list, drift: float | None = None, statistic: str = "mean") -> CaseResult:
    """The simulator's prediction for the job the executor ran, against `statistic` of its `runs` (one or more
    executor runs of the case). The simulator gets the executor's capabilities, the KV pool it allocated and the
    policy as the executor's planner resolved it (the calibration may have gained its in-run ratios since the
    runs, and the decisions must not move with it): the same snapshots, hence the same decisions."""
    from batchgen.sim.run import simulate

    first = runs[0]
    job = dataclasses.replace(first.job, policy=first.prepared.policy or first.job.policy)
    predicted = simulate(job, capabilities=first.capabilities, kv_pages_per_gpu=first.prepared.budget.kv_pages_per_gpu)
    p_bct = bct(predicted)
    p_trace = trace_of(predicted.records)
    difference = next((d for d in (first_difference(trace_of(r.records), p_trace) for r in runs) if d is not None),
                      None)
    return CaseResult(case, summary_side(runs, statistic), Side(p_bct, module_totals(predicted.records, p_bct)),
                      [bct(r) for r in runs], statistics.mean(r.cpu_share for r in runs), difference, len(p_trace),
                      drift, first.clock, statistics.mean(r.wall_bct_s for r in runs), predicted.records)
