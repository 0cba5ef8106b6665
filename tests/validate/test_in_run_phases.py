"""The in-run stage's attention ratio apart for decode and prefill: each from the runs' records of that phase."""
from types import SimpleNamespace

from batchgen.validate.compare import Side
from batchgen.validate.in_run import _total


def record(phase, attention):
    return SimpleNamespace(phase=phase, modules={"attention": attention, "ffn": 1.0})


def test_attention_is_split_by_the_phase_of_its_records():
    records = [record("prefill", 0.3), record("decode", 0.5), record("decode", 0.25), record("mixed", 0.1)]
    side = Side(2.0, {"attention": 1.15, "ffn": 4.0, "rest": 0.2})
    assert _total(records, "attention_decode", side) == 0.75
    assert _total(records, "attention_prefill", side) == 0.4
    assert _total(records, "attention", side) == 1.15
    assert _total(records, "step", side) == 0.2  # the remainder validation calls rest
