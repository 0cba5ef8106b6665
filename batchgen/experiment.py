"""Entry point: `python -m batchgen.experiment +policy=coroutine [model=... cluster=... workload=...]`.

Writes results.json, CSVs and a timeline plot into the Hydra run directory and prints a summary; with `-m`
(a sweep) it also writes sweep.csv, sweep.png and sweep.pdf into the sweep directory and prints one table of
every run, grouped by the swept keys, with the numbers that explain each group's differences.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from batchgen.cli import checked_main, exit_at_once
from batchgen.confdir import conf_dir
from batchgen.config import build_job, progress_setting, skipped_outputs
from batchgen.setup import model_path
from batchgen.memory import ConfigError

log = logging.getLogger("batchgen")
ERROR_FILE = "error.txt"


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Build, validate, simulate and write one job; returns its summary."""
    from batchgen.results import TimelinePlot

    job = build_job(cfg, base_dir=Path.cwd())
    skipped = skipped_outputs(cfg)
    # forked now, before the run: it imports matplotlib while the run goes on
    plot = TimelinePlot(run_dir / "timeline.png") if "timeline.png" not in skipped else None
    try:
        return _run(cfg, job, run_dir, skipped, plot)
    finally:
        if plot is not None:
            plot.cancel()


def _run(cfg: DictConfig, job, run_dir: Path, skipped: set[str], plot) -> dict:
    from batchgen.results import format_table, summarize, write_results
    from batchgen.sim.run import simulate

    progress = progress_setting(cfg)
    if cfg.backend.name == "exec":
        from batchgen.exec.run import ExecSettings, execute
        from batchgen.progress import FinishProgress
        settings = {k: v for k, v in OmegaConf.to_container(cfg.backend, resolve=True).items() if k != "name"}
        settings["model_path"] = model_path(cfg)  # model.path, or backend.model_path
        repeats = settings.get("repeats", 1)
        repeats = repeats if isinstance(repeats, int) and repeats > 0 else 1
        shown = FinishProgress(len(job.workload) * repeats, f"execute {job.policy.name}", progress)
        try:
            out = execute(job, ExecSettings(**settings), on_finish=shown if shown.active else None)
        except TypeError as e:
            raise ConfigError(f"bad backend setting: {e}") from e
        finally:
            shown.close()
    elif cfg.backend.name == "dist":
        from batchgen.dist.run import DistRunFailed, DistSettings, execute_dist
        settings = {k: v for k, v in OmegaConf.to_container(cfg.backend, resolve=True).items() if k != "name"}
        settings["model_path"] = model_path(cfg)
        try:
            out = execute_dist(job, DistSettings(**settings))
        except TypeError as e:
            raise ConfigError(f"bad backend setting: {e}") from e
        except DistRunFailed as e:  # a process died or failed: one line here, every rank's error in the file
            (run_dir / ERROR_FILE).write_text(f"{e}\n")
            print(f"error: {e.headline} (details: {run_dir / ERROR_FILE})", file=sys.stderr)
            sys.exit(1)
        if out is None:  # a worker rank under torchrun: rank 0 writes the results
            return {}
    else:
        overlap = cfg.backend.get("overlap_copies", True)
        if not isinstance(overlap, bool):
            raise ConfigError(f"backend.overlap_copies must be true or false, got {overlap!r}")
        out = simulate(job, progress=progress, overlap_copies=overlap)
    plan = getattr(out.prepared, "plan", None)
    if plan is not None:
        print(plan_line(plan.describe(), out))
    tp = getattr(out.prepared.policy, "attention_tp", None)
    if tp is not None:
        asked = getattr(job.policy, "attention_tp", tp)
        print(f"attention: {'tensor-parallel over groups of ' + str(tp) + ' GPUs' if tp > 1 else 'data-parallel'}"
              + (" (attention_tp=auto chose it)" if asked == "auto" else "") + "; "
              + out.prepared.budget.describe(job.model))
    summary = summarize(out)
    if plot is not None:
        plot.draw(out)  # drawn there while the files are written here
    write_results(out, run_dir, summary, config=OmegaConf.to_container(cfg, resolve=True),
                  skip=skipped - {"timeline.png"})
    if plot is not None:
        plot.wait()
    print(format_table([summary]))
    if out.backend == "dist":
        for rec in out.recoveries:
            stalled = f" (stalled, not dead: killed rank {', '.join(map(str, rec.fenced))})" if rec.fenced else ""
            print(f"recovered: lost rank {', '.join(map(str, rec.lost))} at {rec.at_s:.2f} s{stalled}; "
                  f"{rec.finished_before} "
                  f"sequences had finished, {rec.kept} kept their KV on the survivors, {rec.restored} restored "
                  f"from its shared host copies, {rec.requeued} recomputed "
                  f"from prompt + generated tokens ({rec.on_lost_rank} held by the lost rank); went on over ranks "
                  f"{rec.survivors} after {rec.regroup_s:.2f} s")
        print("processes (own clocks): " + "; ".join(
            f"rank {r}: busy {b:.2f} s, comm {c:.2f} s, idle {i:.2f} s"
            for r, b, c, i in zip(summary["rank_ids"], out.rank_busy_s, out.rank_comm_s, out.rank_idle_s)))
    if out.backend in ("exec", "dist"):
        print(f"executor: {summary['device']} {summary['dtype']}, threads={summary['threads']}, torch "
              f"{summary['torch']}; BCT median of {summary['repeats']} run(s) {summary['bct_s']:.2f} s, range "
              f"{summary['bct_min_s']:.2f}-{summary['bct_max_s']:.2f} s; CPU share {100 * summary['cpu_share']:.0f}%"
              + (" (other processes took the cores: timings are inflated)"
                 if summary['device'] == "cpu" and summary['cpu_share'] < 0.8 and out.backend == "exec" else "")
              + (" (rank 0's process; its waits in collectives take no CPU)" if out.backend == "dist" else ""))
    print(f"results: {run_dir / 'results.json'}")
    return summary


def plan_line(text: str, out) -> str:
    """The plan's line; on the executor it names the hardware its predictions price (the config's cluster.gpu),
    and when that is not the kind of device the run measures on (cluster=h100_8 on a CPU) it says so and how to
    price this machine instead, so that nobody reads H100 figures as a CPU's."""
    if out.backend not in ("exec", "dist"):
        return text
    gpu, device = out.job.cluster.gpu, str(out.device)
    kind = "cpu" if device.startswith("cpu") else "gpu"
    if gpu.kind == kind:
        return text.replace("plan:", f"plan (priced as {gpu.name}, cluster.gpu):", 1)
    from omegaconf import OmegaConf

    folder = conf_dir() / "hardware"
    same_kind = sorted(p.stem for p in folder.glob("*.yaml") if (OmegaConf.load(p).get("kind") or "gpu") == kind)
    return (text.replace("plan:", f"plan (priced as {gpu.name}, cluster.gpu):", 1)
            + f"; these predictions are for {gpu.name}, not this run's {device}: price a {kind} with "
              f"cluster.gpu={same_kind[0] if same_kind else 'NAME'} (a file of {folder})")


@checked_main("batchgen.experiment")
@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        run(cfg, run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        if hc.mode != RunMode.MULTIRUN:
            sys.exit(2)
        # In a sweep, one impossible point must not throw away the others: note it, and the sweep
        # summary reports it and makes the whole command fail at the end.
        (run_dir / ERROR_FILE).write_text(f"{e}\n")


def sweep_size(task_overrides: list[str]) -> int | None:
    """How many jobs a sweep's command-line overrides make (the product of each sweep's values); None if unknown."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides(list(task_overrides))
        size = 1
        for o in overrides:
            if o.is_sweep_override():
                size *= len(list(o.sweep_string_iterator()))
        return size
    except Exception:  # noqa: BLE001 - a count is only shown, never relied on
        return None


class SweepSummary(Callback):
    """During a sweep (-m), `run i/N done in X s` after each run; after it, sweep.csv/.png/.pdf and one table
    of every run grouped by the swept keys, with what explains the differences within each group."""

    def __init__(self) -> None:
        self.size: int | None = None
        self.started = time.perf_counter()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.size = sweep_size(list(config.hydra.overrides.task))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        hc = config.get("hydra")
        if hc is None or hc.mode != RunMode.MULTIRUN:
            return
        num = int(hc.job.get("num", 0)) + 1
        of = f"/{self.size}" if self.size else ""
        failed = (Path(hc.runtime.output_dir) / ERROR_FILE).exists()
        print(f"run {num}{of} {'failed' if failed else 'done'} in {time.perf_counter() - self.started:.1f} s "
              f"({hc.job.override_dirname or 'no overrides'})", file=sys.stderr, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from batchgen.results import summarize_sweep

        sweep_dir = Path(config.hydra.sweep.dir)
        # sweep.csv, sweep.png, sweep.pdf in the sweep directory; the table grouped by every swept key but the
        # policy, each run compared only with the best policy of its group
        text, runs = summarize_sweep(sweep_dir)
        if text:
            print("\n== sweep summary ==")
            print(text)
        failed = [run for run in runs if run.error is not None]
        for run in failed:
            print(f"run {run.name} failed: {run.error}", file=sys.stderr)
        if failed:
            sys.exit(2)


if __name__ == "__main__":
    main()
    exit_at_once()
