"""`python -m batchgen.validate [overrides]`: see batchgen.validate.cases.USAGE."""

from __future__ import annotations

import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from batchgen.memory import ConfigError
from batchgen.validate.cases import USAGE, cases_from_args
from batchgen.validate.compare import compare, compose_case, measure
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
    try:
        measured = measure(cases, lambda k: print(f"executor: round {k} of every case done", file=sys.stderr,
                                                  flush=True))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(header(), flush=True)
    results = []
    for case, run in zip(cases, measured):
        results.append(compare(case, run))
        print(row(results[-1]), flush=True)
    for line in differences(results):
        print(line)
    print(f"scaled by CPU share (contention removed, an estimate): {summary_line(results, cpu=True)}")
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
