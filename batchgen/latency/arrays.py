"""How the latency models take and give amounts of work: numbers or numpy arrays, broadcast alike."""

from __future__ import annotations

import numpy as np


def _arr(x, what: str) -> np.ndarray:
    """`x` as a float array; negative amounts of work are a caller bug, so they raise."""
    # the simulator passes float arrays: no conversion then (a call costs as much as the arithmetic on a grid)
    a = x if type(x) is np.ndarray and x.dtype == _FLOAT else np.asarray(x, dtype=float)
    if a.size and not a.min() >= 0:  # one pass: a NaN minimum fails the comparison too
        raise ValueError(f"{what} must be >= 0, got {x!r}")
    return a


def _out(a: np.ndarray):
    """0-d results come back as plain floats, arrays as arrays."""
    if type(a) is not np.ndarray or a.dtype != _FLOAT:
        a = np.asarray(a, dtype=float)
    return float(a) if a.ndim == 0 else a


_FLOAT = np.dtype(float)


def _fits(t: np.ndarray, *others: np.ndarray) -> bool:
    """Whether every array in `others` is 0-d or shaped like `t` (so that a result shaped like `t` is the
    broadcast of them all)."""
    return all(not o.ndim or o.shape == t.shape for o in others)


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
