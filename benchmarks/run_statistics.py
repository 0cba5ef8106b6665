"""Which statistic of a case's executor runs is steady from one validation to the next (issue 29).

    python benchmarks/run_statistics.py [--rounds 9] [--group 3] [latency.calibration=FILE]

Four of validation's cases (small/continuous, small/sglang_opt, azure_conv/coroutine, azure_code/static) run on
the executor `--rounds` times, in rounds over the cases as validation takes them (CPU, one thread, CPU clock).
The runs are then cut into consecutive groups of `--group` (what one validation takes of each case), and each
group summarised by its fastest run and by its mean. Printed per case: every run's seconds, and how far apart the
groups' minima and the groups' means are ((largest - smallest) / smallest). The statistic whose groups agree
better describes the case the same way in validations minutes apart. The last line reads
`group_spread min=<pct>% mean=<pct>%` (the median over the cases).

The calibration only decides the plan of "auto" knobs here (any file of tiny_moe does; default: the shipped one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

CASES = ("small/continuous", "small/sglang_opt", "azure_conv/coroutine", "azure_code/static")


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--group", type=int, default=3)
    args, overrides = parser.parse_known_args(argv)
    if args.group < 1 or args.rounds < 2 * args.group:
        parser.error("--rounds must hold at least two groups of --group runs")

    from batchgen.exec.load import LoadMeter
    from batchgen.results.metrics import bct
    from batchgen.validate.cases import CALIBRATION, cases_from_args
    from batchgen.compare import measure_rounds

    if not any(o.startswith("latency") for o in overrides):
        overrides.append(f"latency.calibration={CALIBRATION.format(model='tiny_moe')}")
    cases = [c for c in cases_from_args([*overrides, f"backend.repeats={args.rounds}"]) if c.name in CASES]
    meter, start = LoadMeter(), time.perf_counter()
    rounds = measure_rounds(cases, lambda k: print(f"round {k} of {args.rounds} ({time.perf_counter() - start:.0f} s)",
                                                   file=sys.stderr, flush=True))
    mins, means = [], []
    for case, runs in zip(cases, rounds):
        seconds = [bct(r) for r in runs]
        groups = [seconds[i:i + args.group] for i in range(0, len(seconds) - args.group + 1, args.group)]
        mins.append(spread([min(g) for g in groups]))
        means.append(spread([statistics.mean(g) for g in groups]))
        print(f"{case.name:22s} runs {' '.join(f'{s:.3f}' for s in seconds)}  groups of {args.group}: "
              f"minima {100 * mins[-1]:.1f}% apart, means {100 * means[-1]:.1f}% apart")
    print(f"machine: {meter.read().describe()}")
    print(f"group_spread min={100 * statistics.median(mins):.1f}% mean={100 * statistics.median(means):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
