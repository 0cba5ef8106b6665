"""One case: the executor's measurement, the simulator's prediction for the same decisions, and their gap."""

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
from batchgen.validate.cases import Case

MODULES = ("attention", "ffn", "head")  # the rest: whatever the BCT holds beyond them (overheads, copies)


@dataclass
class Side:
    """One backend's run: BCT and seconds per module (the rest included)."""

    bct_s: float
    modules: dict[str, float] = field(default_factory=dict)


@dataclass
class CaseResult:
    case: Case
    measured: Side
    predicted: Side
    runs_s: list[float]           # every executor repeat's BCT (measured.bct_s: their median; the CPU clock's minimum)
    cpu_share: float              # the median run's CPU seconds / (wall x threads): < 1 when the cores were taken
    difference: Difference | None  # where the decision traces part; None: equal
    boundaries: int
    drift: float | None = None    # this machine's seconds per calibrated second during the run (profile.probe)
    clock: str = "wall"           # what the executor timed with (batchgen.exec.clock)
    wall_s: float = 0.0           # the reported run's wall-clock BCT (beside a CPU-clock one)
    speed: float | None = None    # the calibration checks' factor around the reported run's round, which
                                  # `predicted` is scaled by (None: not scaled)
    unscaled_s: float = 0.0       # the prediction before that scaling
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
    def unscaled_error(self) -> float:
        """The error of the prediction from the calibration as profiled, before the checks' factor."""
        return self.unscaled_s / self.measured.bct_s - 1.0 if self.speed else self.error

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


def measure(cases: list[Case], progress=None, configs: list | None = None) -> list:
    """Each case's reported run (exec.repeats.representative_run) of `measure_rounds`."""
    from batchgen.exec.repeats import representative_run

    return [representative_run(r) for r in measure_rounds(cases, progress, configs)]


def pick_run(runs: list, speeds: list[float]):
    """Of a case's runs, one per round, the fastest once each is divided by its round's speed factor (this
    machine's seconds per calibrated second then, from the calibration checks around the round): the run least
    disturbed for the machine it ran on. Returns (that run, carrying every run's BCT, and its factor)."""
    from batchgen.exec.repeats import median_run

    normal = [bct(r) / f for r, f in zip(runs, speeds, strict=True)]
    best = normal.index(min(normal))
    return median_run(runs, pick=lambda bcts: bcts[best]), speeds[best]


def measure_rounds(cases: list[Case], progress=None, configs: list | None = None) -> list[list]:
    """Each case's executor repeats, taken in rounds over all cases (case 1 run 1, case 2 run 1, ..., case 1
    run 2, ...): a slow spell of a shared machine, which lasts minutes, then costs one repeat of several cases
    instead of every repeat of one, and the medians hold. Returns each case's runs, one per round.
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


def compare(case: Case, measured, drift: float | None = None, speed: float | None = None) -> CaseResult:
    """The simulator's prediction for the job the executor measured, with the executor's capabilities and the
    KV pool it allocated (the same snapshots, hence the same decisions); `speed`: the factor the prediction (and
    its modules) is scaled by, this machine's seconds per calibrated second during the measured run's round."""
    from batchgen.sim.run import simulate

    predicted = simulate(measured.job, capabilities=measured.capabilities,
                         kv_pages_per_gpu=measured.prepared.budget.kv_pages_per_gpu)
    m_bct, p_bct = bct(measured), bct(predicted)
    m_trace, p_trace = trace_of(measured.records), trace_of(predicted.records)
    f = speed or 1.0
    modules = {k: v * f for k, v in module_totals(predicted.records, p_bct).items()}
    return CaseResult(case, Side(m_bct, module_totals(measured.records, m_bct)), Side(p_bct * f, modules),
                      list(measured.repeat_bcts), measured.cpu_share, first_difference(m_trace, p_trace),
                      len(m_trace), drift, measured.clock, measured.wall_bct_s, speed, p_bct, predicted.records)
