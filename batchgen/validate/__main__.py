"""`python -m batchgen.validate [overrides]`: see batchgen.validate.cases.USAGE."""

from __future__ import annotations

import statistics
import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from batchgen.memory import ConfigError
from batchgen.validate.cases import USAGE, cases_from_args
from batchgen.validate.compare import calibrations, compare, compose_case, measure
from batchgen.validate.report import differences, header, row, summary_line


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        cases = cases_from_args(argv)
        for case in cases:  # every config composes before any case runs: a typo fails in a second
            compose_case(case)
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tables = calibrations(cases)
    checks = [check(tables, "before the executor's runs")]

    def round_done(k: int) -> None:
        print(f"executor: round {k} of every case done", file=sys.stderr, flush=True)
        checks.append(check(tables, f"after round {k}"))  # a shared machine's speed moves within minutes
    try:
        measured = measure(cases, round_done)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # one table in the usual run (one model): the mean of its checks over the runs rescales every prediction
    drift = statistics.mean(c[0].factor for c in checks) if len(tables) == 1 else None
    print(header(), flush=True)
    results = []
    for case, run in zip(cases, measured):
        results.append(compare(case, run, drift))
        print(row(results[-1]), flush=True)
    for line in differences(results):
        print(line)
    from batchgen.profile.probe import describe
    for i, _ in enumerate(tables):
        print(describe([c[i] for c in checks]))
    print(f"scaled by CPU share (contention removed, an estimate): {summary_line(results, cpu=True)}")
    if drift is not None:
        print(f"rescaled by the calibration check's factor {drift:.2f} (the machine's change of speed since it was "
              f"profiled taken out, an estimate): {summary_line(results, drift=True)}")
    print(summary_line(results))
    return 0


def check(tables: dict, when: str) -> list:
    """The calibration check (batchgen.profile.probe) of every table the predictions read, announced as it runs."""
    from batchgen.profile.probe import probe

    out = []
    for path, spec in tables.items():
        out.append(probe(path, spec))
        print(f"{when}: {out[-1].describe()}", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
