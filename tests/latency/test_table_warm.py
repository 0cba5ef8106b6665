"""A layer's decode calls of one forward: the first priced as measured cold, the others as measured right after
another call of that layer (`warm` points), where the calibration has them."""
import pytest

from batchgen.latency.roofline import Roofline
from batchgen.latency.table import TablePredictor
from tests.latency.test_table_phases import HW, MODEL, calibration


def with_warm(factor: float) -> dict:
    cal = calibration({})
    dec = cal["modules"]["attention_decode"]
    dec += [{**p, "warm": True, "seconds": factor * p["seconds"]} for p in list(dec)]
    return cal


def test_later_calls_of_a_layer_are_priced_warm():
    cold = TablePredictor(calibration({}), Roofline(MODEL, HW))
    warm = TablePredictor(with_warm(0.5), Roofline(MODEL, HW))
    one = cold.attention_decode(4, 4 * 64, 1, 64)
    assert warm.attention_decode(4, 4 * 64, 1, 64) == pytest.approx(one)  # one call: the first of its layer
    assert warm.attention_decode(12, 12 * 64, 3, 64) == pytest.approx(one + 2 * 0.5 * one)
    assert cold.attention_decode(12, 12 * 64, 3, 64) == pytest.approx(3 * one)  # no warm points: all alike
    # beyond the warm points' largest call the later calls are priced as first calls
    big = cold.attention_decode(32, 32 * 64, 1, 64)
    assert warm.attention_decode(64, 64 * 64, 2, 64) == pytest.approx(2 * big)
