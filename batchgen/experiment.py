"""Entry point: `python -m batchgen.experiment +policy=coroutine [model=... cluster=... workload=...]`.

Writes results.json, CSVs and a timeline plot into the Hydra run directory and prints a summary; with `-m`
(a sweep) it also prints one table comparing every run of the sweep, with the numbers that explain it.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.memory import ConfigError

log = logging.getLogger("batchgen")


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Build, validate, simulate and write one job; returns its summary."""
    from batchgen.results import format_table, plot_timeline, summarize, write_results
    from batchgen.sim.run import simulate

    job = build_job(cfg, base_dir=Path.cwd())
    out = simulate(job)
    summary = summarize(out)
    write_results(out, run_dir, summary, config=OmegaConf.to_container(cfg, resolve=True),
                  sequences_csv=bool(cfg.output.get("sequences_csv", True)))
    if cfg.output.get("plot", True):
        plot_timeline(out, run_dir / "timeline.png")
    print(format_table([summary]))
    print(f"results: {run_dir / 'results.json'}")
    return summary


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run(cfg, run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class SweepSummary(Callback):
    """After a sweep (-m), one table of every run and what explains the differences."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from batchgen.results import explain, format_table

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/results.json"))]
        for row in rows:
            row.pop("config", None)
        if rows:
            print("\n== sweep summary ==")
            print(format_table(rows))
            print(explain(rows))


if __name__ == "__main__":
    main()
