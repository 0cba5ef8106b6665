"""How the latency models take and give amounts of work: numbers or numpy arrays, priced by the same code.

The simulator prices a (ranks x iterations) grid as arrays, and a one-rank run one iteration at a time as Python
floats (numpy's per-call cost on a one-element array is many times the arithmetic). The formulas are written once
and take either: arithmetic operators act alike on both; what does not (the larger of two amounts, a mask, a
rounding) goes through the helpers below, which keep numpy's results to the bit on floats (IEEE arithmetic is
the same in both, and numpy rounds half to even as Python does).
"""

from __future__ import annotations

import math

import numpy as np

_FLOAT = np.dtype(float)


def _arr(x, what: str):
    """`x` as a float array, or as it is when it is a float (one cell); negative amounts of work are a caller
    bug, so they raise."""
    if type(x) is float:
        if not x >= 0:  # a NaN fails the comparison too
            raise ValueError(f"{what} must be >= 0, got {x!r}")
        return x
    # the simulator passes float arrays: no conversion then (a call costs as much as the arithmetic on a grid)
    a = x if type(x) is np.ndarray and x.dtype == _FLOAT else np.asarray(x, dtype=float)
    if a.size and not a.min() >= 0:  # one pass: a NaN minimum fails the comparison too
        raise ValueError(f"{what} must be >= 0, got {x!r}")
    return a


def _out(a):
    """Floats and 0-d results come back as plain floats, arrays as arrays."""
    if type(a) is float:
        return a
    if type(a) is not np.ndarray or a.dtype != _FLOAT:
        a = np.asarray(a, dtype=float)
    return float(a) if a.ndim == 0 else a


def maximum_for(a, b=0.0, c=0.0):
    """The elementwise larger-of-two that fits the operands: Python's `max` when every one is a number, else
    numpy's."""
    return max if type(a) is float and type(b) is float and type(c) is float else np.maximum


def positive(t, seconds):
    """`seconds` where `t` > 0, else 0: a module that gets no work costs nothing."""
    if type(t) is float:
        return seconds if t > 0 else 0.0
    return np.where(t > 0, seconds, 0.0)


def ceil(x):
    return float(math.ceil(x)) if type(x) is float else np.ceil(x)


def rint(x):
    """Rounded to a whole number, half to even (numpy's round, Python's round)."""
    return float(round(x)) if type(x) is float else np.round(x)


def _fits(t: np.ndarray, *others: np.ndarray) -> bool:
    """Whether every array in `others` is 0-d or shaped like `t` (so that a result shaped like `t` is the
    broadcast of them all)."""
    return all(type(o) is float or not o.ndim or o.shape == t.shape for o in others)


def _uniform(calls, tokens) -> float | None:
    """The one launch count of `calls` when every cell has the same and the result takes the shape of
    `tokens` (a number, a 0-d array, or an array shaped like tokens); None otherwise."""
    if type(calls) in (int, float):
        return float(calls)
    if type(calls) is not np.ndarray or not calls.size:
        return None
    if calls.ndim and calls.shape != np.shape(tokens):
        return None
    first = calls.flat[0]
    if calls.size > 1 and not (calls == first).all():
        return None
    return float(first)
