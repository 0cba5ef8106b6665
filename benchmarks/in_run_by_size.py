"""The in-run stage's ratios by call size against one ratio per module, on the same executor runs (issue 29).

    python benchmarks/in_run_by_size.py [--rounds 3] [--policies static,continuous,coroutine,sglang_opt]
                                        [--grid FILE]

Profiles this machine's quick grid (as `python -m batchgen.validate` does; `--grid FILE` reuses a grid-only
calibration of tiny_moe instead), then runs validation's three workloads under `--policies` on the executor (CPU,
one thread, CPU clock) with the in-run stage's jobs spread among them, `--rounds` times. From the stage's runs it
computes the in-run ratios once, and predicts every case twice from the same runs: with one ratio per module kind
(the in-run file without `by_size`) and with the ratios by call size. The decisions are the same both times; only
the prices differ. Per case: measured seconds, both errors and the per-module errors. The last line reads
`one_ratio median=<pct>% worst=<pct>% by_size median=<pct>% worst=<pct>%` (absolute BCT errors over the cases).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

WORKLOADS = ("small", "azure_conv", "azure_code")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="static,continuous,coroutine,sglang_opt")
    parser.add_argument("--grid", default=None, help="a grid-only calibration of tiny_moe (default: profile now)")
    args = parser.parse_args(argv)

    from batchgen.compare import compare, compose_case, measure_rounds
    from batchgen.latency.calibration_file import read, write
    from batchgen.profile.in_run import calibration_cases, in_run_scales
    from batchgen.validate.cases import CPU, cases_from_args
    from batchgen.validate.fresh import interleave, profile_grid

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    grid = Path(tempfile.mkdtemp(prefix="in_run_by_size-")) / "calibration.json"
    cases = [c for w in WORKLOADS for c in cases_from_args([f"workload={w}", f"policy={args.policies}",
                                                           f"latency.calibration={grid}", "backend.repeats=1"])]
    if args.grid:
        data = read(args.grid)
        data.pop("in_run", None)
        write(data, grid)
    else:
        profile_grid(compose_case(cases[0]), grid, log=log)
    stage = calibration_cases("tiny_moe", "cpu", 1, CPU, grid, repeats=1)
    order = interleave(stage, cases)
    every = cases + stage
    runs: list[list] = [[] for _ in every]
    for k in range(args.rounds):
        for i, got in zip(order, measure_rounds([every[i] for i in order])):
            runs[i] += got
        log(f"round {k + 1} of {args.rounds} done")
    in_run = in_run_scales(stage, runs[len(cases):], log=log)  # predicted from the grid alone: the file has none
    base = read(grid)
    files = {"one_ratio": dict(base, in_run={k: v for k, v in in_run.items() if k != "by_size"}),
             "by_size": dict(base, in_run=in_run)}
    results = {}
    for tag, data in files.items():
        write(data, grid)  # the runs' jobs read their calibration from this path
        results[tag] = [compare(case, case_runs) for case, case_runs in zip(cases, runs)]
    print(f"{'case':24s} {'measured s':>10s} {'one ratio':>9s} {'by size':>8s}   attention / ffn / head, one -> by size")
    for one, by in zip(results["one_ratio"], results["by_size"]):
        modules = "  ".join(f"{m} {100 * (one.module_error(m) or 0):+.0f} -> {100 * (by.module_error(m) or 0):+.0f}"
                            for m in ("attention", "ffn", "head"))
        print(f"{one.case.name:24s} {one.measured.bct_s:10.3f} {100 * one.error:+8.1f}% {100 * by.error:+7.1f}%   "
              f"{modules}")
    print("by size: " + json.dumps(in_run["by_size"]))
    summary = " ".join(f"{tag} median={100 * statistics.median(abs(r.error) for r in rs):.1f}% "
                       f"worst={100 * max(abs(r.error) for r in rs):.1f}%" for tag, rs in results.items())
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
