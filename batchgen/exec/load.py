"""What else the machine was doing while something was timed: load average, steal and busy shares (Linux).

A timing is only as good as what it can be compared with, so every profile and validation records, beside its
numbers, how loaded the machine was (/proc/loadavg) and how much of the CPUs' time the hypervisor gave to other
guests (steal, /proc/stat) or the other processes of this guest used (busy beyond this process's own CPU time).
Where /proc is missing (not Linux) the readings are None and nothing else changes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

STAT = Path("/proc/stat")
LOADAVG = Path("/proc/loadavg")


def _cpu_ticks() -> list[int] | None:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    try:
        return [int(x) for x in STAT.read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None


def load_average() -> float | None:
    try:
        return float(LOADAVG.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Load:
    """The machine over one interval: `steal` and `busy` are shares of all CPUs' time (0..1); `others` is the
    share of all CPUs' time that processes other than this one kept busy; `loadavg` is the 1-minute load at the
    end; `cpus` the CPUs counted."""

    seconds: float
    steal: float | None
    busy: float | None
    others: float | None
    loadavg: float | None
    cpus: int

    def describe(self) -> str:
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
        load = "-" if self.loadavg is None else f"{self.loadavg:.2f}"
        return (f"load {load} on {self.cpus} CPUs, steal {pct(self.steal)}, other processes {pct(self.others)} "
                f"of the CPUs over {self.seconds:.0f} s")

    def to_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 4)
        return {"seconds": round(self.seconds, 1), "steal": r(self.steal), "busy": r(self.busy),
                "others": r(self.others), "loadavg": self.loadavg, "cpus": self.cpus}


class LoadMeter:
    """Started at construction; `read()` gives the `Load` since then (it may be read several times)."""

    def __init__(self) -> None:
        self.t0, self.cpu0, self.ticks0 = time.perf_counter(), time.process_time(), _cpu_ticks()

    def read(self) -> Load:
        seconds, ticks = time.perf_counter() - self.t0, _cpu_ticks()
        own = time.process_time() - self.cpu0
        cpus = os.cpu_count() or 1
        if self.ticks0 is None or ticks is None:
            return Load(seconds, None, None, None, load_average(), cpus)
        d = [b - a for a, b in zip(self.ticks0, ticks)]
        total = sum(d[:8]) or 1  # guest time is already counted in user
        steal = d[7] / total if len(d) > 7 else 0.0
        busy = (total - d[3] - d[4]) / total
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        others = max(0.0, busy - steal - own * hz / total)
        return Load(seconds, steal, busy, others, load_average(), cpus)
