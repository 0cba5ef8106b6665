"""Timing one module call many times: warm-up, repeats in rounds, the median and the spread.

Points are measured in rounds (every point a few times per round, the whole grid round after round), so that a
slow minute of a shared machine spreads over all points instead of biasing a few. CPU: the executor's clock
around each call (batchgen.exec.clock: with one thread, the thread's CPU time, which a neighbour taking the core
cannot inflate), the wall clock beside it, and, untimed before each call, a read of a buffer as large as the
model's weights, so that the call finds the caches as a run leaves them (the rest of the model has passed
through since the module last ran). A point's seconds are the median of its calls: on the CPU clock what is
left of the calls' spread is the machine's own (caches, the host's other guests), which a run's thousands of calls
pay on average too; the minimum was 6-15% below the median per module and predicted whole runs 5-30% low per
module (benchmarks/results/validation.md). CUDA: events recorded around each call and read once per point and
round (one synchronise per point, never one per call), as the executor's own timer does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from batchgen.exec import clock


@dataclass
class Samples:
    """Seconds of every timed call of one grid point (all rounds)."""

    seconds: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # the wall clock around the same calls (CPU only)

    @property
    def minimum(self) -> float:
        return float(np.min(self.seconds))

    @property
    def median(self) -> float:
        return float(np.median(self.seconds))

    @property
    def p10(self) -> float:
        """The fast end of the calls: what the module costs when the shared machine leaves it alone."""
        return float(np.percentile(self.seconds, 10))

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the point was (0.05 = a 5% band holds 80% of the calls)."""
        p10, p50, p90 = np.percentile(self.seconds, [10, 50, 90])
        return float((p90 - p10) / p50) if p50 > 0 else 0.0


class Clock:
    """Times calls of a callable on one device without adding synchronisation between them (on CPU with the
    executor's clock, batchgen.exec.clock)."""

    def __init__(self, device: torch.device, evict_bytes: int = 0):
        """`evict_bytes` (CPU): before each timed call, untimed, read a buffer this large, so that the call finds
        the caches as a run leaves them (the rest of the model passed through since the module last ran)."""
        self.cuda = device.type == "cuda"
        self.last_wall: list[float] = []
        self._evict = (torch.ones(evict_bytes // 4, dtype=torch.float32)
                       if evict_bytes and not self.cuda else None)

    def time_calls(self, fn: Callable[[], object], calls: int, before: Callable[[], object] | None = None
                   ) -> list[float]:
        """Seconds of each of `calls` back-to-back calls of fn (`last_wall`: their wall seconds, on CPU);
        `before`, if given, runs untimed before each call (after the eviction)."""
        if self.cuda:
            marks = []
            for _ in range(calls):
                if before is not None:
                    before()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                marks.append((start, end))
            marks[-1][1].synchronize()
            return [s.elapsed_time(e) / 1e3 for s, e in marks]
        out, self.last_wall = [], []
        for _ in range(calls):
            self.evict()
            if before is not None:
                before()
            w0, t0 = time.perf_counter(), clock.now()
            fn()
            out.append(clock.now() - t0)
            self.last_wall.append(time.perf_counter() - w0)
        return out

    def evict(self) -> None:
        if self._evict is not None:
            self._evict.sum()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def split_repeats(repeats: int, rounds: int) -> list[int]:
    """repeats spread over at most `rounds` rounds, e.g. 7 over 3 -> [3, 2, 2]."""
    rounds = max(1, min(rounds, repeats))
    return [repeats // rounds + (1 if r < repeats % rounds else 0) for r in range(rounds)]
