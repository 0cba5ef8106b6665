"""The engine core takes today's decisions and ends at today's times on a fixed set of jobs (tests/golden/).

A failure names the job, the instance and the first boundary where the decision differs, or the first sequence
whose finish time moved. A change that means to change them rewrites the files (`python tests/golden/record.py
CASE`) and its commit says which jobs changed and why.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))
from cases import CASES  # noqa: E402
from record import outcome  # noqa: E402


def first_row_difference(want: np.lib.npyio.NpzFile, got: dict) -> str | None:
    """The first boundary, per instance, whose decision row differs (instances interleave freely in time): both
    rows where the golden file keeps them, else where they part."""
    for inst in sorted(set(want["instance"].tolist()) | set(got["instance"].tolist())):
        a, b = want["digest"][want["instance"] == inst], got["digest"][got["instance"] == inst]
        for k in range(max(a.size, b.size)):
            if (a[k] if k < a.size else None) != (b[k] if k < b.size else None):
                if "rows" not in want.files:
                    return f"instance {inst}, boundary {k} (the golden file keeps digests of its rows)"
                x = want["rows"][want["instance"] == inst]
                y = got["rows"][got["instance"] == inst]
                return (f"instance {inst}, boundary {k}:\n  golden {x[k] if k < x.size else '<none>'}\n"
                        f"  now    {y[k] if k < y.size else '<none>'}")
    return None


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_trace_and_times(case):
    want = np.load(GOLDEN / f"{case}.npz")
    got = outcome(case)
    diff = first_row_difference(want, got)
    assert diff is None, f"{case}: decisions differ at {diff}"
    for key in ("finish", "first"):
        same = np.array_equal(want[key], got[key], equal_nan=True)
        if not same:
            moved = np.flatnonzero(~np.isclose(want[key], got[key], rtol=0, atol=0, equal_nan=True))
            i = int(moved[0])
            rel = np.nanmax(np.abs(got[key] - want[key]) / np.maximum(np.abs(want[key]), 1e-300))
            pytest.fail(f"{case}: {key} times moved for {moved.size} sequences (first: {i}, "
                        f"{want[key][i]!r} -> {got[key][i]!r}; largest relative change {rel:.3g})")


def test_the_comparison_catches_a_changed_decision(monkeypatch):
    """A policy that decodes one step fewer per run is caught: the test above can fail."""
    from batchgen.policy.static import StaticPolicy

    honest = StaticPolicy.decide

    def shorter(self, snap):
        d = honest(self, snap)
        d.steps = max(int(d.steps) - 1, 1)
        return d

    monkeypatch.setattr(StaticPolicy, "decide", shorter)
    want = np.load(GOLDEN / "static-tiny-8.npz")
    assert first_row_difference(want, outcome("static-tiny-8")) is not None
