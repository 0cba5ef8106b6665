"""Which of a job's repeated runs the executor reports (backend.repeats): every number reported comes from one
real run, which carries the others' BCTs beside its own."""

from __future__ import annotations

import statistics
from typing import TypeVar

from batchgen.decisions import trace_of
from batchgen.results.metrics import bct

Run = TypeVar("Run")  # an ExecOutput


def representative_run(runs: list[Run]) -> Run:
    """The fastest run when timed in CPU time (a neighbour can only add to it: the minimum is the work's own time),
    else the median one; `median_run` says the rest."""
    if runs and runs[0].clock == "cpu":
        return median_run(runs, pick=min)
    return median_run(runs)


def median_run(runs: list[Run], pick=statistics.median_low) -> Run:
    """The run of median BCT (the lower median for an even count: every number reported comes from one real
    run), or the one `pick` picks, carrying every run's BCT, wall BCT and CPU share, and whether they all
    decided alike."""
    bcts = [bct(r) for r in runs]
    out = runs[bcts.index(pick(bcts))]
    out.repeat_bcts = bcts
    out.repeat_wall_bcts = [r.wall_bct_s for r in runs]
    out.repeat_cpu_shares = [r.cpu_share for r in runs]
    out.repeats_same_decisions = all(trace_of(r.records) == trace_of(runs[0].records) for r in runs[1:])
    return out
