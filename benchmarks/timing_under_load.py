"""Which clock and which statistic tell a module's cost apart from a neighbour's load (issue 29).

    python benchmarks/timing_under_load.py [--calls 40] [--hog]

A few of the profiler's own points (tiny_moe, CPU, one thread: experts, LM head with sampling, decode attention)
are timed call by call with two clocks read around the same call: the wall clock (`time.perf_counter`) and the
CPU time of the calling thread (`time.thread_time`, which the executor's single working thread accrues only
while it runs). Points are interleaved (one call of each, round after round). Printed per point: median and
minimum of each clock, and, with --hog, the same again with a one-core CPU hog started beside it
(`python -c 'while True: pass'`), and hog / quiet ratios. /proc/loadavg and the steal ticks over each phase are
printed too. A second quiet phase after the hog shows what moves with no hog at all. The last line reads `worst_shift wall_median=.. cpu_min=..` (the largest |hog/quiet - 1|).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np
import torch

from batchgen.profile.cases import Bench, _attention_case, ffn_cases, lm_head_cases
from batchgen.profile.grid import contexts_of, grid_named
from batchgen.exec.load import LoadMeter
from batchgen.profile.run import build_profile_model
from batchgen.specs.catalog import load_model


def points(bench: Bench):
    grid = grid_named("quick")
    ffn = [c for c in ffn_cases(bench, grid) if c.module == "experts" and c.point["total_tokens"] in (16, 256)]
    head = [c for c in lm_head_cases(bench, grid) if c.point["tokens"] in (4, 64)]
    attn = [_attention_case(bench, "attention_decode", contexts_of(32, 512, "equal"), True)]
    return ffn + head + attn


def phase(cases, calls: int) -> dict:
    set_up = [(c, *c.setup()) for c in cases]
    wall = {i: [] for i in range(len(cases))}
    cpu = {i: [] for i in range(len(cases))}
    meter = LoadMeter()
    for _, fn, _ in set_up:
        fn(), fn()  # warm-up
    for _ in range(calls):
        for i, (_, fn, _) in enumerate(set_up):
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            c1, w1 = time.thread_time(), time.perf_counter()
            wall[i].append(w1 - w0)
            cpu[i].append(c1 - c0)
    for _, _, cleanup in set_up:
        cleanup()
    return {"wall": wall, "cpu": cpu, "load": meter.read()}


def stats(samples: list[float]) -> tuple[float, float]:
    return float(np.median(samples)), float(np.min(samples))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--hog", action="store_true", help="also time beside a one-core CPU hog")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = load_model("tiny_moe")
    bench = Bench(build_profile_model(spec, torch.device("cpu"), torch.float32), page_size=16)
    cases = points(bench)
    names = [f"{c.module} {c.point.get('tokens', c.point.get('total_tokens'))}" for c in cases]
    quiet = phase(cases, args.calls)
    print(f"quiet: {quiet['load'].describe()}")
    runs = {"quiet": quiet}
    if args.hog:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.0)
            runs["hog"] = phase(cases, args.calls)
        finally:
            hog.kill()
            hog.wait()
        print(f"hog: {runs['hog']['load'].describe()}")
        runs["quiet2"] = phase(cases, args.calls)  # quiet again: what changes by itself between two phases
        print(f"quiet2: {runs['quiet2']['load'].describe()}")
    print(f"{'point':24s} " + "  ".join(f"{p:>5s} {k}/{s} ms" for p in runs for k in ("wall", "cpu")
                                         for s in ("med", "min")))
    shift = {("wall", 0): 0.0, ("cpu", 1): 0.0}
    for i, name in enumerate(names):
        cols = []
        for r in runs.values():
            for k in ("wall", "cpu"):
                med, mn = stats(r[k][i])
                cols.append(f"{med * 1e3:8.3f} {mn * 1e3:8.3f}")
        line = f"{name:24s} " + "  ".join(cols)
        if "hog" in runs:
            ratios = []
            for k, j in (("wall", 0), ("cpu", 1)):
                ratio = stats(runs["hog"][k][i])[j] / stats(quiet[k][i])[j]
                shift[k, j] = max(shift[k, j], abs(ratio - 1))
                ratios.append(f"{k}/{'med' if j == 0 else 'min'} x{ratio:.3f}")
            line += "   hog/quiet: " + ", ".join(ratios)
        print(line)
    if "hog" in runs:
        again = max(abs(stats(runs["quiet2"][k][i])[j] / stats(quiet[k][i])[j] - 1)
                    for i in range(len(names)) for k, j in (("wall", 0), ("cpu", 1)))
        print(f"quiet2/quiet: worst |ratio - 1| {100 * again:.1f}% (both clocks)")
        print(f"worst_shift wall_median={100 * shift['wall', 0]:.1f}% cpu_min={100 * shift['cpu', 1]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
