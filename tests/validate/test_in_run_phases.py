"""The in-run stage's attention and FFN ratios apart for decode and prefill: each from the runs' records of that
phase, the FFN's with its phase's tokens per forward."""
from types import SimpleNamespace

from batchgen.compare import Side
from batchgen.profile.in_run import _total, tokens_per_forward


def record(phase, attention, ffn=1.0, expert_tokens=0.0, expert_calls=0):
    return SimpleNamespace(phase=phase, modules={"attention": attention, "ffn": ffn}, expert_tokens=expert_tokens,
                           expert_calls=expert_calls)


def test_attention_is_split_by_the_phase_of_its_records():
    records = [record("prefill", 0.3), record("decode", 0.5), record("decode", 0.25), record("mixed", 0.1)]
    side = Side(2.0, {"attention": 1.15, "ffn": 4.0, "rest": 0.2})
    assert _total(records, "attention_decode", side) == 0.75
    assert _total(records, "attention_prefill", side) == 0.4
    assert _total(records, "attention", side) == 1.15
    assert _total(records, "step", side) == 0.2  # the remainder validation calls rest


def test_the_ffn_is_split_by_phase_with_its_tokens_per_forward():
    records = [record("prefill", 0.3, 2.0, 3000, 1), record("decode", 0.5, 0.5, 240, 12),
               record("decode", 0.25, 0.25, 60, 6), record("mixed", 0.1, 1.0, 1000, 1)]
    side = Side(2.0, {"attention": 1.15, "ffn": 3.75, "rest": 0.2})
    assert _total(records, "ffn_decode", side) == 0.75
    assert _total(records, "ffn_prefill", side) == 3.0
    assert _total(records, "ffn", side) == 3.75
    assert tokens_per_forward([records[:2], records[2:]]) == {"ffn_decode": round(300 / 18, 2), "ffn_prefill": 2000.0}
