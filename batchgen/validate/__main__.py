"""`python -m batchgen.validate [overrides]`: see batchgen.validate.cases.USAGE."""

from __future__ import annotations

import statistics
import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from batchgen.memory import ConfigError
from batchgen.validate.cases import USAGE, cases_from_args, profiles_first
from batchgen.validate.compare import calibrations, compare, compose_case, measure_rounds, pick_run
from batchgen.validate.fresh import fresh_path, profile_here
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

    meter = LoadMeter()
    if fresh is not None:
        print("profiling this machine first (the quick grid, then the in-run stage; latency.calibration=FILE "
              "validates a stored calibration instead)", file=sys.stderr, flush=True)
        profile_here(configs[0], fresh, log=lambda m: print(m, file=sys.stderr, flush=True))
    tables = calibrations(configs)
    checks = [check(tables, "before the executor's runs")]

    def round_done(k: int) -> None:
        print(f"executor: round {k} of every case done", file=sys.stderr, flush=True)
        checks.append(check(tables, f"after round {k}"))  # a shared machine's speed moves within minutes
    try:
        rounds = measure_rounds(cases, round_done, configs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    checked = [path for path in tables if all(path in c for c in checks)]
    one = checked[0] if len(tables) == len(checked) == 1 else None  # one table in the usual run (one model)
    drift = speeds = None
    if fresh is not None and one is not None:
        # this run's own calibration: each round's runs are predicted for the machine as the checks before and
        # after that round found it, relative to the first check, taken just after the in-run stage whose ratios
        # already fit the calibration to the machine of that moment (so the calibration describes the machine at
        # the moment of the runs, and a change between the grid and the in-run stage is not counted twice)
        first = checks[0][one].factor
        speeds = [statistics.mean((checks[k][one].factor, checks[k + 1][one].factor)) / first
                  for k in range(len(checks) - 1)]
    elif one is not None:
        # a stored file: where its checks find that it no longer describes this machine, their mean factor
        # rescales every prediction on a line of its own (within the tolerance it is not told from noise)
        drift = statistics.mean(c[one].factor for c in checks)
        drift = drift if stale(drift) else None
    print(header(), flush=True)
    results = []
    for case, runs in zip(cases, rounds):
        if speeds is not None:
            run, speed = pick_run(runs, speeds[:len(runs)])
            results.append(compare(case, run, drift, speed))
        else:
            from batchgen.exec.repeats import representative_run

            results.append(compare(case, representative_run(runs), drift))
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
    if speeds is not None:
        # the last line stays the prediction as profiled: the probes' small calls follow a neighbour's load more
        # than whole runs do, and scaled by them the median error of runs in a row spread wider than unscaled
        # (benchmarks/results/code_figures.md)
        print("each round's speed (seconds now per second of the first check, the checks before and after it): "
              + ", ".join(f"{f:.2f}x" for f in speeds)
              + f"; the predictions scaled by it (the speed column): {summary_line(results)}")
    if drift is not None:
        print(f"rescaled by the calibration check's factor {drift:.2f} (the machine's change of speed since it was "
              f"profiled taken out, an estimate): {summary_line(results, drift=True)}")
    print(summary_line(results, unscaled=True))
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
