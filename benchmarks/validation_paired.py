"""Two ways of turning the same executor runs into validation's errors, side by side (issue 29).

    python benchmarks/validation_paired.py [--variant by_size|statistic] [--rounds 3]
                                           [--policies static,continuous,coroutine,sglang_opt|all] [--grid FILE]

Profiles this machine's quick grid (as `python -m batchgen.validate` does; `--grid FILE` reuses a grid-only
calibration of tiny_moe instead), then runs validation's three workloads under `--policies` on the executor (CPU,
one thread, CPU clock) with the in-run stage's jobs spread among them, `--rounds` times. From these runs it predicts
every case twice; the decisions are the same both times, only the numbers differ:

- `by_size` (the default): the in-run ratios with one ratio per module kind (the in-run file without `by_size`)
  against the ratios by call size, each case measured by the mean of its runs;
- `statistic`: every case and the in-run stage's jobs measured by the mean of their runs against the median.

Per case: measured seconds (the first variant's), both errors and the per-module errors. The last line reads
`<variant A> median=<pct>% worst=<pct>% <variant B> median=<pct>% worst=<pct>%` (absolute BCT errors over the
cases). `python benchmarks/in_run_by_size.py` of earlier results is `--variant by_size`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

WORKLOADS = ("small", "azure_conv", "azure_code")
# per variant: its two arms as (tag, the statistic of a case's runs, whether the in-run file keeps its ratios by size)
VARIANTS = {"by_size": (("one_ratio", "mean", False), ("by_size", "mean", True)),
            "statistic": (("mean", "mean", True), ("median", "median", True))}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="by_size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="static,continuous,coroutine,sglang_opt", help="all: every policy")
    parser.add_argument("--grid", default=None, help="a grid-only calibration of tiny_moe (default: profile now)")
    args = parser.parse_args(argv)
    if args.policies == "all":
        from batchgen.policy import policy_names
        args.policies = ",".join(policy_names())

    from batchgen.compare import compare, compose_case, measure_rounds
    from batchgen.latency.calibration_file import read, write
    from batchgen.profile.in_run import calibration_cases, in_run_scales
    from batchgen.validate.cases import CPU, cases_from_args
    from batchgen.validate.fresh import STAGE_RUNS, interleave, profile_grid, stage_copies_runs

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    grid = Path(tempfile.mkdtemp(prefix="validation_paired-")) / "calibration.json"
    cases = [c for w in WORKLOADS for c in cases_from_args([f"workload={w}", f"policy={args.policies}",
                                                           f"latency.calibration={grid}", "backend.repeats=1"])]
    if args.grid:
        data = read(args.grid)
        data.pop("in_run", None)
        write(data, grid)
    else:
        profile_grid(compose_case(cases[0]), grid, log=log)
    stage = calibration_cases("tiny_moe", "cpu", 1, CPU, grid, repeats=1)
    copies = stage * STAGE_RUNS  # as validation runs them: each stage job STAGE_RUNS times per round
    order = interleave(copies, cases)
    every = cases + copies
    runs: list[list] = [[] for _ in every]
    for k in range(args.rounds):
        for i, got in zip(order, measure_rounds([every[i] for i in order])):
            runs[i] += got
        log(f"round {k + 1} of {args.rounds} done")
    stage_runs = stage_copies_runs(runs, len(cases), len(stage))
    base = read(grid)  # the grid alone: the file has no in-run ratios yet
    results, by_size = {}, {}
    for tag, stat, sized in VARIANTS[args.variant]:
        write(base, grid)  # the stage's runs against the grid alone, whatever the arm before wrote there
        in_run = in_run_scales(stage, stage_runs, log=log, statistic=stat)
        by_size[tag] = in_run["by_size"]
        write(dict(base, in_run=in_run if sized else {k: v for k, v in in_run.items() if k != "by_size"}), grid)
        results[tag] = [compare(case, case_runs, statistic=stat) for case, case_runs in zip(cases, runs)]
    a, b = results
    print(f"{'case':24s} {'measured s':>10s} {a:>9s} {b:>9s}   attention / ffn / head / rest, {a} -> {b}")
    for one, two in zip(results[a], results[b]):
        modules = "  ".join(f"{m} {100 * (one.module_error(m) or 0):+.0f} -> {100 * (two.module_error(m) or 0):+.0f}"
                            for m in ("attention", "ffn", "head", "rest"))
        print(f"{one.case.name:24s} {one.measured.bct_s:10.3f} {100 * one.error:+8.1f}% {100 * two.error:+8.1f}%   "
              f"{modules}")
    print("by size: " + json.dumps(by_size))
    summary = " ".join(f"{tag} median={100 * statistics.median(abs(r.error) for r in rs):.1f}% "
                       f"worst={100 * max(abs(r.error) for r in rs):.1f}%" for tag, rs in results.items())
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
