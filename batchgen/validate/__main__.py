"""`python -m batchgen.validate [overrides]`: see batchgen.validate.cases.USAGE."""

from __future__ import annotations

import dataclasses
import statistics
import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from batchgen.compare import calibrations, compare, compose_case, measure_rounds
from batchgen.memory import ConfigError
from batchgen.validate.cases import USAGE, cases_from_args, profiles_first
from batchgen.validate.fresh import STAGE_RUNS, add_in_run, fresh_path, interleave, profile_grid, stage_copies_runs
from batchgen.validate.report import differences, header, row, summary_line


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    fresh = fresh_path() if profiles_first(argv) else None
    try:
        cases = cases_from_args(argv, fresh)
        # every config composes before any case runs: a typo fails in a second
        configs = [compose_case(case) for case in cases]
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from batchgen.exec.load import LoadMeter  # torch: imported once the configs are known to be good
    from batchgen.profile.probe import describe, stale

    meter, log = LoadMeter(), lambda m: print(m, file=sys.stderr, flush=True)
    stage: list = []
    if fresh is not None:
        log("profiling this machine first (the quick grid; the in-run stage then runs in the same rounds as the "
            "cases; latency.calibration=FILE validates a stored calibration instead)")
        calibration, stage = profile_grid(configs[0], fresh, log=log)
    tables = calibrations(configs)
    checks = [] if fresh is not None else [check(tables, "before the executor's runs")]

    def round_done(k: int) -> None:
        log(f"executor: round {k} of every case done")
        if fresh is None:
            checks.append(check(tables, f"after round {k}"))  # a shared machine's speed moves within minutes
    # the in-run stage's jobs STAGE_RUNS times per round, in the same rounds as the cases: its ratios scale every
    # prediction, so they get more runs than any one case
    repeats = max(int(cfg.backend.repeats) for cfg in configs)
    stage = [dataclasses.replace(c, overrides=(*c.overrides, f"backend.repeats={repeats}")) for c in stage]
    copies = stage * STAGE_RUNS
    every, every_config = cases + copies, configs + [compose_case(c) for c in stage] * STAGE_RUNS
    order = interleave(copies, cases)
    try:
        runs = measure_rounds([every[i] for i in order], round_done, [every_config[i] for i in order])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rounds: list[list] = [[] for _ in every]
    for i, case_runs in zip(order, runs):
        rounds[i] = case_runs
    if fresh is not None:
        stage_rounds = stage_copies_runs(rounds, len(cases), len(stage))
        add_in_run(calibration, fresh, stage, stage_rounds, log=log)
    checked = [path for path in tables if checks and all(path in c for c in checks)]
    one = checked[0] if len(tables) == len(checked) == 1 else None  # one table in the usual run (one model)
    drift = None
    if one is not None:
        # a stored file: where its checks find that it no longer describes this machine, their mean factor
        # rescales every prediction on a line of its own (within the tolerance it is not told from noise)
        drift = statistics.mean(c[one].factor for c in checks)
        drift = drift if stale(drift) else None
    print(header(), flush=True)
    results = []
    for case, case_runs in zip(cases, rounds):
        results.append(compare(case, case_runs, drift))
        print(row(results[-1]), flush=True)
    for line in differences(results):
        print(line)
    for path in checked:
        print(describe([c[path] for c in checks]))
    if any(r.clock == "wall" for r in results):
        print(f"scaled by CPU share (contention removed, an estimate): {summary_line(results, cpu=True)}")
    print(f"machine during the run: {meter.read().describe()}"
          + (f"; this run's calibration: {fresh} (latency.calibration={fresh} predicts from it again)"
             if fresh is not None else ""))
    if drift is not None:
        print(f"rescaled by the calibration check's factor {drift:.2f} (the machine's change of speed since it was "
              f"profiled taken out, an estimate): {summary_line(results, drift=True)}")
    print(summary_line(results))
    return 0


def check(tables: dict, when: str) -> dict:
    """The calibration check (batchgen.profile.probe) of every table the predictions read that can be checked here,
    announced as it runs: {file: Drift}."""
    from batchgen.profile.probe import probe

    out = {}
    for path, spec in tables.items():
        try:
            out[path] = probe(path, spec)
        except ValueError as e:  # a file without module points (Vidur's GEMMs), a device this machine lacks
            print(f"{when}: no calibration check of {path.name}: {e}", file=sys.stderr, flush=True)
            continue
        print(f"{when}: {out[path].describe()}", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
