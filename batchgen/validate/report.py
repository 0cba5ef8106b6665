"""The validation table, and the one summary line scripts read (always the last line printed)."""

from __future__ import annotations

import statistics

from batchgen.compare import MODULES, CaseResult

PARTS = (*MODULES, "rest")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def header() -> str:
    """measured s: the mean of the executor's runs of the case (on the CPU clock, the working thread's CPU time;
    wall s: their mean wall time); spread: (slowest - fastest) / median run; cpu: their CPU share (CPU seconds /
    wall seconds)."""
    cols = ["case".ljust(24), "measured s".rjust(10), "spread".rjust(7), "wall s".rjust(7), "cpu".rjust(5),
            "predicted s".rjust(11), "error".rjust(7), "err@cpu".rjust(7)]
    cols += [f"{p} meas/pred s (err)".rjust(26) for p in PARTS]
    return "  ".join(cols + ["decisions"])


def row(r: CaseResult) -> str:
    cols = [r.case.name.ljust(24), f"{r.measured.bct_s:10.3f}", f"{100 * r.spread:6.1f}%",
            f"{r.wall_s:7.3f}" if r.clock == "cpu" else "-".rjust(7), f"{100 * r.cpu_share:4.0f}%",
            f"{r.predicted.bct_s:11.3f}", f"{_pct(r.error):>7}",
            f"{_pct(r.cpu_error):>7}"]
    for p in PARTS:
        meas, pred = r.measured.modules.get(p, 0.0), r.predicted.modules.get(p, 0.0)
        err = r.module_error(p) if p != "rest" else (None if abs(meas) < 1e-9 else pred / meas - 1.0)
        cols.append(f"{meas:.3f}/{pred:.3f} ({_pct(err)})".rjust(26))
    same = "equal" if r.difference is None else "DIFFER"
    return "  ".join(cols + [f"{same} ({r.boundaries} boundaries)"])


def differences(results: list[CaseResult]) -> list[str]:
    return [f"{r.case.name}: decisions differ first at {r.difference.describe()}" for r in results
            if r.difference is not None]


def summary_line(results: list[CaseResult], cpu: bool = False, drift: bool = False) -> str:
    """`cpu`: against the CPU-share-scaled measurement (err@cpu); `drift`: the prediction rescaled by the calibration
    check (`CaseResult.drift_error`); both for the lines before the last."""
    errors = [abs(r.cpu_error if cpu else r.drift_error if drift else r.error)
              for r in results]
    return f"median_abs_error={100 * statistics.median(errors):.1f}% worst_abs_error={100 * max(errors):.1f}%"
