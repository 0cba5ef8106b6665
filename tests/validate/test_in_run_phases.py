"""The in-run stage's attention and FFN ratios apart for decode and prefill: each from the runs' records of that
phase, the FFN's with its phase's tokens per forward."""
from types import SimpleNamespace

import numpy as np

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


def sized(phase, iterations, tokens, attention, ffn, head, expert_tokens=None, expert_calls=None):
    return SimpleNamespace(phase=phase, iterations=iterations, tokens=tokens,
                           modules={"attention": attention, "ffn": ffn, "head": head},
                           expert_tokens=tokens if expert_tokens is None else expert_tokens,
                           expert_calls=iterations if expert_calls is None else expert_calls)


def test_ratios_by_size_bin_each_kind_by_its_call_size_and_average_the_runs():
    """Decode records of 2 and 3 sequences fall in one bin, 40 in another; the FFN's bins also take the prefill
    record (by tokens per call), attention and the head do not; each ratio is the runs' mean over the predicted."""
    from batchgen.profile.in_run import ratios_by_size

    predicted = [sized("decode", 10, 20, 1.0, 1.0, 0.1), sized("decode", 10, 30, 1.0, 1.0, 0.1),
                 sized("decode", 5, 200, 2.0, 2.0, 0.2), sized("prefill", 1, 2000, 5.0, 4.0, 0.01, 2000, 1)]
    run = lambda f: SimpleNamespace(records=[sized(r.phase, r.iterations, r.tokens,  # noqa: E731
                                                   *(f(r) * r.modules[m] for m in ("attention", "ffn", "head")))
                                             for r in predicted])
    # two runs of the same job: 0.6x and 1.0x on small calls, 1.2x and 1.4x on large ones
    runs = [run(lambda r: 0.6 if r.tokens < 100 else 1.2), run(lambda r: 1.0 if r.tokens < 100 else 1.4)]
    out = ratios_by_size([runs], [predicted])
    assert set(out) == {"attention_decode", "ffn", "head"}
    assert out["attention_decode"] == [[2.5, 0.8], [40.0, 1.3]]  # sizes weighted by predicted seconds
    assert out["head"] == [[2.5, 0.8], [40.0, 1.3]]
    assert out["ffn"] == [[2.5, 0.8], [40.0, 1.3], [2000.0, 1.3]]


def test_ratios_by_size_leave_out_a_kind_with_fewer_than_two_bins_that_matter():
    from batchgen.profile.in_run import MIN_SHARE, ratios_by_size

    predicted = [sized("decode", 10, 20, 1.0, 1.0, 0.1), sized("decode", 5, 200, 0.5 * MIN_SHARE, 1.0, 0.1)]
    runs = [SimpleNamespace(records=predicted)]
    out = ratios_by_size([runs], [predicted])
    assert "attention_decode" not in out  # the large bin holds too small a share of attention's seconds
    assert out["ffn"] == [[2.0, 1.0], [40.0, 1.0]]


def test_a_statistic_other_than_the_mean_summarises_the_runs_alike_in_cases_and_ratios():
    """Three runs of one job, the last slowed 2x by a spell: the median keeps it out of the case's seconds and of
    the ratios by size alike, the mean takes a third of it."""
    import statistics

    from batchgen.compare import summary_side
    from batchgen.profile.in_run import ratios_by_size

    predicted = [sized("decode", 10, 20, 1.0, 1.0, 0.1), sized("decode", 5, 200, 2.0, 2.0, 0.2)]

    def run(f):
        recs = [sized(r.phase, r.iterations, r.tokens, *(f * r.modules[m] for m in ("attention", "ffn", "head")))
                for r in predicted]
        finish = np.array([sum(sum(r.modules.values()) for r in recs)])
        return SimpleNamespace(records=recs, prepared=SimpleNamespace(state=SimpleNamespace(
            table=SimpleNamespace(finish_time=finish))))

    runs = [run(1.0), run(1.1), run(2.0)]
    assert ratios_by_size([runs], [predicted], statistics.median)["ffn"] == [[2.0, 1.1], [40.0, 1.1]]
    assert ratios_by_size([runs], [predicted])["ffn"] == [[2.0, 1.3667], [40.0, 1.3667]]
    for name, ratio in (("median", 1.1), ("mean", 4.1 / 3)):
        side = summary_side(runs, name)
        assert abs(side.modules["ffn"] - 3.0 * ratio) < 1e-9
        assert abs(side.bct_s - 6.3 * ratio) < 1e-9
