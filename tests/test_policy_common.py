"""The shared decision helpers of batchgen.policy.common against their definitions, computed the slow way."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.policy.common import level_slots


def _level_by_definition(count: np.ndarray, slots: np.ndarray, n: int) -> np.ndarray:
    """The smallest level in [min(count), max(count) + n] whose room holds n (the top if none does), tried one
    level at a time."""
    lo, hi = int(count.min(initial=0)), int(count.max(initial=0)) + n
    for level in range(lo, hi + 1):
        if np.minimum(slots, np.maximum(level - count, 0)).sum() >= n:
            return np.minimum(slots, np.maximum(level - count, 0))
    return np.minimum(slots, np.maximum(hi - count, 0))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), min_size=0, max_size=24),
       st.integers(0, 400))
def test_level_slots_is_the_lowest_level_that_holds_the_newcomers(ranks, n):
    count = np.array([c for c, _ in ranks], np.int64)
    slots = np.array([s for _, s in ranks], np.int64)
    got = level_slots(count, slots, n)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, _level_by_definition(count, slots, n))


def test_every_slot_taken_when_the_newcomers_fill_them():
    count, slots = np.array([500, 3, 120], np.int64), np.array([2, 0, 5], np.int64)
    np.testing.assert_array_equal(level_slots(count, slots, 7), slots)
    np.testing.assert_array_equal(level_slots(count, slots, 50), slots)
