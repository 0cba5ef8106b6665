"""Timing one module call many times: warm-up, repeats in rounds, median and spread.

Points are measured in rounds (every point a few times per round, the whole grid round after round), so that a
slow minute of a shared machine spreads over all points instead of biasing a few. CPU: the wall clock around
each call. CUDA: events recorded around each call and read once per point and round (one synchronise per
point, never one per call), as the executor's own timer does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


@dataclass
class Samples:
    """Seconds of every timed call of one grid point (all rounds)."""

    seconds: list[float] = field(default_factory=list)

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
    """Times calls of a callable on one device without adding synchronisation between them."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time_calls(self, fn: Callable[[], object], calls: int) -> list[float]:
        """Seconds of each of `calls` back-to-back calls of fn."""
        if self.cuda:
            marks = []
            for _ in range(calls):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                marks.append((start, end))
            marks[-1][1].synchronize()
            return [s.elapsed_time(e) / 1e3 for s, e in marks]
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def split_repeats(repeats: int, rounds: int) -> list[int]:
    """repeats spread over at most `rounds` rounds, e.g. 7 over 3 -> [3, 2, 2]."""
    rounds = max(1, min(rounds, repeats))
    return [repeats // rounds + (1 if r < repeats % rounds else 0) for r in range(rounds)]
