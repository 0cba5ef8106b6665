"""How this machine's speed moves while nothing else of ours runs: one fixed call, timed back to back (issue 29).

    python benchmarks/host_speed.py [--seconds 60] [--window 5]

A fixed call (four 192x192 float32 matrix products on one thread, about 0.6 ms) is timed back to back on the wall
clock and on the thread's CPU clock for `--seconds`. Printed per window of `--window` seconds: the calls' 1st,
10th and 50th percentiles and their mean over the 1st percentile. Then the correlation of a call's time with the
next call's and with the call 100 later, and, for runs of 100 calls (about what a validated case's run is made
of), how much their sums spread (coefficient of variation). The last line reads
`p1_window_spread=<pct>% p50_window_spread=<pct>% run_cv=<pct>%` ((largest - smallest) / smallest over the
windows, for the 1st percentile and the median).

What it tells: whether the machine's speed moves call by call (then the fastest of a few repeats finds its own
speed) or in spells (then a run, a sum of thousands of calls, pays the spell it ran in, and only the mean of
runs spread over the same minutes as the calibration compares with it).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=5.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    start, rows = time.perf_counter(), []
    while time.perf_counter() - start < args.seconds:
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(4):
            torch.mm(a, b)
        rows.append((w0 - start, time.perf_counter() - w0, time.thread_time() - c0))
    at, wall, cpu = (np.array(x) for x in zip(*rows))
    p1s, p50s = [], []
    for lo in np.arange(0.0, args.seconds, args.window):
        us = wall[(at >= lo) & (at < lo + args.window)] * 1e6
        if us.size < 10:
            continue
        p1, p10, p50 = np.percentile(us, [1, 10, 50])
        p1s.append(p1)
        p50s.append(p50)
        print(f"{lo:5.0f} s  calls {us.size:6d}  us: p1 {p1:7.0f}  p10 {p10:7.0f}  p50 {p50:7.0f}  "
              f"mean/p1 {us.mean() / p1:5.2f}")
    lag = lambda k: float(np.corrcoef(wall[:-k], wall[k:])[0, 1])
    runs = wall[: wall.size // 100 * 100].reshape(-1, 100).sum(1)
    print(f"calls {wall.size}; CPU clock / wall clock over all calls {cpu.sum() / wall.sum():.3f}; correlation of a "
          f"call's time with the next {lag(1):.2f}, with the 100th after {lag(100):.2f}")
    spread = lambda x: 100 * (max(x) / min(x) - 1)
    print(f"p1_window_spread={spread(p1s):.1f}% p50_window_spread={spread(p50s):.1f}% "
          f"run_cv={100 * runs.std() / runs.mean():.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
