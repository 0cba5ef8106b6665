"""The executor's clock: the wall clock, or the CPU time of the one thread that does the work.

Why. On a CPU device with one intra-op thread every tensor op runs on the calling thread, so that thread's CPU
time (`time.thread_time`: user + system, advancing only while the thread runs) is the work's time, and a
neighbour that takes the core away adds wall time but none of it. That is what it buys at the scale of a run on
a loaded machine, where the process waits for a core (benchmarks/results/code_figures.md); per call it is no
steadier than the wall clock, since the host's own speed moves both (benchmarks/results/validation.md,
`benchmarks/timing_under_load.py`). On an idle machine the two agree, so a
run timed in CPU time is the run an idle machine would time on its wall clock: what validation compares with
the simulator. A user's real run still reports the wall clock (the default): that is the time it took.

`backend.clock=cpu` needs a CPU device and one thread (with more, the other threads' work is not on this clock);
on CUDA the module timers use events either way and the run's time is the wall clock.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from batchgen.memory import ConfigError

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
_now: Callable[[], float] = time.perf_counter


def now() -> float:
    """Seconds on the clock in force (an arbitrary origin: take differences)."""
    return _now()


def check_clock(kind: str, device_types: set[str], threads: int) -> None:
    if kind not in CLOCKS:
        raise ConfigError(f"backend.clock={kind!r}: choose wall or cpu (the CPU time of the working thread)")
    if kind == "cpu" and (device_types != {"cpu"} or threads != 1):
        raise ConfigError(f"backend.clock=cpu times the one thread that does the work: it needs backend.device=cpu "
                          f"and backend.threads=1 (here: {', '.join(sorted(device_types))}, {threads} threads)")


@contextmanager
def using(kind: str) -> Iterator[None]:
    """Make `kind` the clock of `now()` for the block (the executor runs in one thread)."""
    global _now
    before, _now = _now, CLOCKS[kind]
    try:
        yield
    finally:
        _now = before
