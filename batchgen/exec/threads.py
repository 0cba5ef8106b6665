"""How many CPU threads the executor computes with, decided before the model is built and written down.

Left to itself, torch starts one OpenMP thread per logical CPU of the machine, not of the process: on a shared
or containerised machine those threads fight other processes for a few cores, and the same job's time varies
by an order of magnitude (benchmarks/results/code_figures.md). Pinning the count (default: the physical cores this
process may use) makes a measurement mean the same thing twice.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from batchgen.memory import ConfigError

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores() -> int:
    """Physical cores among the CPUs this process may run on, capped by a cgroup CPU quota (containers)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:  # hyperthreads of one core share (package, core id)
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    n = len(cores)
    quota = _cgroup_quota()
    return max(1, min(n, quota) if quota else n)


def _cgroup_quota() -> int | None:
    """CPUs a cgroup v2 quota allows ("200000 100000" = 2), None without a quota."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def _omp_threads() -> int | None:
    """OMP_NUM_THREADS as a whole number >= 1; None when it is unset or not one."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n >= 1 else None


def resolve_threads(setting: int | str | None) -> int | None:
    """`auto`: the available physical cores, or fewer where OMP_NUM_THREADS asks for fewer (a scheduler or a test
    runner that splits the machine between processes); an int: that many; None: keep the process's setting."""
    if setting is None:
        return None
    if setting == "auto":
        cores, omp = available_cores(), _omp_threads()
        return min(cores, omp) if omp else cores
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError(f"backend.threads={setting!r}: give a whole number >= 1, or auto (the physical cores "
                          f"this process may use: {available_cores()} here)")
    return setting


@contextmanager
def pinned_threads(threads: int | None) -> Iterator[int]:
    """Run with `threads` intra-op threads (None: as they are); yields the count in force, restores it after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        try:  # allowed only before any inter-op work has started in this process; harmless to skip after
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            pass
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
