"""Workloads: every request of a batch job, as arrays of prompt and output lengths."""

from .distributions import Fixed, LongTailed, Uniform, make_distribution
from .spec import Workload, WorkloadSpec, build_workload, resolve_trace
from .traces import load_trace, shipped_traces

__all__ = [
    "Fixed",
    "LongTailed",
    "Uniform",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "load_trace",
    "make_distribution",
    "resolve_trace",
    "shipped_traces",
]
