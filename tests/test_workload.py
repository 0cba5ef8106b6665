"""Workloads: distributions, config builder, traces. All fast (well under a few seconds in total)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from batchgen.workload import (
    Fixed,
    LongTailed,
    Uniform,
    Workload,
    build_workload,
    load_trace,
    make_distribution,
    shipped_traces,
)

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf" / "workload"
SHARED_TRACES = ROOT.parent / "shared" / "data" / "traces"

SYNTHETIC = {
    "name": "t",
    "num_sequences": 500,
    "input": {"kind": "uniform", "low": 16, "high": 4096},
    "output": {"kind": "longtail", "mean": 512},
}


# --- Workload -------------------------------------------------------------------------------------------


def test_workload_validates_and_freezes():
    src = np.array([3, 4, 5])
    w = Workload("w", src, [1, 2, 3])
    assert len(w) == 3 and w.input_lens.dtype == np.int64 and w.output_lens.dtype == np.int64
    with pytest.raises(ValueError):
        w.input_lens[0] = 7  # read-only
    src[0] = 99  # the workload holds a copy
    assert w.input_lens[0] == 3

    with pytest.raises(ValueError, match="same length"):
        Workload("w", [1, 2], [1])
    with pytest.raises(ValueError, match="1-D"):
        Workload("w", [[1, 2]], [[1, 2]])
    with pytest.raises(ValueError, match=r"output_lens must be >= 1.*index 1"):
        Workload("w", [1, 2], [1, 0])
    with pytest.raises(ValueError, match="integers"):
        Workload("w", [1.5], [1])


def test_summary():
    w = Workload("w", np.arange(1, 101), np.arange(1, 101) * 2)
    s = w.summary()
    assert s["count"] == 100 and s["name"] == "w"
    assert s["input_mean"] == 50.5 and s["input_max"] == 100 and s["output_max"] == 200
    assert s["output_median"] == pytest.approx(101.0)
    assert s["output_p99_over_p95"] == pytest.approx(s["output_p99"] / s["output_p95"])
    assert Workload("e", [], []).summary()["input_mean"] is None


# --- Distributions --------------------------------------------------------------------------------------


def test_longtail_mean_ratio_and_clip():
    dist = LongTailed(mean=4096, p99_over_p95=3.78, max_over_p95=9.2)
    x = dist.sample(100_000, np.random.default_rng(1))
    assert x.dtype == np.int64 and x.min() >= 1
    assert x.mean() == pytest.approx(4096, rel=0.01)
    p95, p99 = np.percentile(x, [95, 99])
    assert p99 / p95 == pytest.approx(3.78, rel=0.10)
    assert x.max() <= 9.2 * p95 + 10  # rounding slack only
    assert x.max() >= 0.9 * 9.2 * p95  # the clip is reached: the tail really extends that far


def test_longtail_without_clip_and_other_ratio():
    x = LongTailed(mean=300, p99_over_p95=2.0, max_over_p95=math.inf).sample(100_000, np.random.default_rng(2))
    p95, p99 = np.percentile(x, [95, 99])
    assert x.mean() == pytest.approx(300, rel=0.01)
    assert p99 / p95 == pytest.approx(2.0, rel=0.10)


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (Fixed, {"value": 0}, "value must be >= 1"),
        (Fixed, {"value": 2.5}, "value must be an integer"),
        (Uniform, {"low": 10, "high": 5}, "high must be >= low"),
        (Uniform, {"low": -1, "high": 5}, "low must be >= 1"),
        (LongTailed, {"mean": 0.5}, "mean must be"),
        (LongTailed, {"mean": 100, "p99_over_p95": 1.0}, "p99_over_p95 must be"),
        (LongTailed, {"mean": 100, "p99_over_p95": 4, "max_over_p95": 3}, "max_over_p95 must be >= p99_over_p95"),
    ],
)
def test_distribution_validation(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_make_distribution():
    assert make_distribution({"kind": "fixed", "value": 2048}) == Fixed(2048)
    assert make_distribution({"kind": "uniform", "low": 1, "high": 9}) == Uniform(1, 9)
    assert make_distribution({"kind": "longtail", "mean": 4096}) == LongTailed(4096)
    with pytest.raises(ValueError, match=r"unknown distribution kind 'zipf'.*fixed, uniform, longtail"):
        make_distribution({"kind": "zipf", "a": 2})
    with pytest.raises(ValueError, match=r"unknown parameter.*'val'.*valid: value"):
        make_distribution({"kind": "fixed", "val": 3})
    with pytest.raises(ValueError, match=r"missing parameter.*'mean'"):
        make_distribution({"kind": "longtail"})


distribution_configs = st.one_of(
    st.builds(lambda v: {"kind": "fixed", "value": v}, st.integers(1, 1_000_000)),
    st.integers(1, 100_000).flatmap(
        lambda low: st.integers(low, low + 100_000).map(lambda high: {"kind": "uniform", "low": low, "high": high})
    ),
    st.builds(
        lambda mean, ratio, extra: {"kind": "longtail", "mean": mean, "p99_over_p95": ratio, "max_over_p95": ratio * extra},
        st.floats(1, 1e6),
        st.floats(1.001, 20),
        st.floats(1, 10),
    ),
)


@settings(max_examples=60, deadline=None)
@given(dist=distribution_configs, n=st.integers(1, 3000), seed=st.integers(0, 2**32))
def test_any_valid_config_gives_valid_lengths(dist, n, seed):
    x = make_distribution(dist).sample(n, np.random.default_rng(seed))
    assert x.shape == (n,) and x.dtype == np.int64 and x.min() >= 1


# --- Builder --------------------------------------------------------------------------------------------


def test_same_seed_same_arrays_different_seed_differs():
    a, b, c = build_workload(SYNTHETIC, 7), build_workload(SYNTHETIC, 7), build_workload(SYNTHETIC, 8)
    assert np.array_equal(a.input_lens, b.input_lens) and np.array_equal(a.output_lens, b.output_lens)
    assert not np.array_equal(a.input_lens, c.input_lens)
    assert not np.array_equal(a.output_lens, c.output_lens)


def test_input_and_output_streams_are_independent():
    other_input = {**SYNTHETIC, "input": {"kind": "uniform", "low": 1, "high": 9}}
    a, b = build_workload(SYNTHETIC, 3), build_workload(other_input, 3)
    assert np.array_equal(a.output_lens, b.output_lens)


def test_clips_and_dictconfig():
    cfg = OmegaConf.create({**SYNTHETIC, "max_input": 100, "max_output": 50})
    w = build_workload(cfg, 0)
    assert w.input_lens.max() <= 100 and w.output_lens.max() <= 50 and len(w) == 500


@pytest.mark.parametrize("value", [-5, 0, 2.5, "abc", True, None])
def test_bad_num_sequences(value):
    with pytest.raises(ValueError, match=f"workload.num_sequences must be a positive integer, got {value!r}"):
        build_workload({**SYNTHETIC, "num_sequences": value}, 0)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"unknown workload key\(s\) \['num_seqs'\]; valid keys: name, num_sequences"):
        build_workload({**SYNTHETIC, "num_seqs": 3}, 0)
    with pytest.raises(ValueError, match="workload.output: value must be >= 1, got -3"):
        build_workload({**SYNTHETIC, "output": {"kind": "fixed", "value": -3}}, 0)
    with pytest.raises(ValueError, match="workload.input: unknown distribution kind 'normal'"):
        build_workload({**SYNTHETIC, "input": {"kind": "normal"}}, 0)
    with pytest.raises(ValueError, match="not both"):
        build_workload({**SYNTHETIC, "trace": "azure_conv_2023.csv"}, 0)
    with pytest.raises(ValueError, match="needs 'trace' or both"):
        build_workload({"name": "x", "num_sequences": 3, "input": {"kind": "fixed", "value": 1}}, 0)
    with pytest.raises(ValueError, match="seed"):
        build_workload(SYNTHETIC, -1)


@pytest.mark.parametrize("path", sorted(CONF_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_named_config_builds(path):
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert cfg["name"] == path.stem
    full = cfg["num_sequences"]
    w = build_workload({**cfg, "num_sequences": 64}, seed=0)
    assert len(w) == 64 and w.name == path.stem
    if "trace" not in cfg:  # the stated size is valid too, without paying for drawing it
        assert isinstance(full, int) and full > 0


def test_named_configs_exist():
    expected = {
        "small", "longbench_8k_2k", "longbench_2k_8k", "longbench_12k_4k", "longbench_6_5k_2_8k",
        "gsm8k_512_256", "chatbotarena_256_512", "fixed_1k_1k", "azure_conv", "azure_code",
    }  # fmt: skip
    assert expected <= {p.stem for p in CONF_DIR.glob("*.yaml")}


def test_hydra_composes_the_workload_group():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR.parent), version_base="1.3"):
        cfg = compose(config_name=None, overrides=["+workload=small", "workload.num_sequences=10"])
    w = build_workload(cfg.workload, seed=0)
    assert len(w) == 10 and w.name == "small"


# --- Traces ---------------------------------------------------------------------------------------------


def test_shipped_traces_load_fast_and_match_the_shared_copies():
    assert {"azure_conv_2023.csv", "azure_code_2023.csv"} <= set(shipped_traces())
    start = time.perf_counter()
    w = build_workload({"name": "azure_conv", "trace": "azure_conv_2023.csv", "num_sequences": None}, 0)
    assert time.perf_counter() - start < 1.0
    assert len(w) == 19366
    assert np.median(w.input_lens) == 1020 and w.output_lens.max() == 1000
    if SHARED_TRACES.is_dir():
        inputs, outputs = load_trace(SHARED_TRACES / "azure_conv_2023.csv")
        assert np.array_equal(inputs, w.input_lens) and np.array_equal(outputs, w.output_lens)
    assert len(build_workload({"trace": "azure_code_2023.csv"}, 0)) == 8819


def test_trace_first_rows_and_oversampling():
    full = build_workload({"trace": "azure_code_2023.csv"}, 0)
    head = build_workload({"trace": "azure_code_2023.csv", "num_sequences": 100}, 0)
    assert np.array_equal(head.input_lens, full.input_lens[:100])
    with pytest.warns(UserWarning, match="exceeds the 8819 rows.*with replacement"):
        big = build_workload({"trace": "azure_code_2023.csv", "num_sequences": 20000}, 5)
    assert len(big) == 20000 and set(big.output_lens) <= set(full.output_lens)
    with pytest.warns(UserWarning):
        again = build_workload({"trace": "azure_code_2023.csv", "num_sequences": 20000}, 5)
    assert np.array_equal(big.output_lens, again.output_lens)


def test_trace_input_len_format_and_path_resolution(tmp_path, monkeypatch):
    (tmp_path / "mine.csv").write_text("input_len,output_len\n10,20\n\n30,40\n")
    assert build_workload({"trace": str(tmp_path / "mine.csv")}, 0).output_lens.tolist() == [20, 40]
    assert build_workload({"trace": "mine.csv"}, 0, base_dir=tmp_path).input_lens.tolist() == [10, 30]
    monkeypatch.chdir(tmp_path)
    assert len(build_workload({"trace": "mine.csv"}, 0)) == 2


def test_missing_trace_lists_paths_tried(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        build_workload({"trace": "nope.csv"}, 0, base_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path / "nope.csv") in message
    assert str(Path("batchgen", "data", "traces", "nope.csv")) in message
    assert "azure_conv_2023.csv" in message  # the shipped alternatives


def test_bad_trace_rows_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.1,12,-3\n")
    with pytest.raises(ValueError, match=r"bad\.csv, line 3: lengths must be >= 1"):
        load_trace(bad)
    bad.write_text("input_len,output_len\n5,abc\n")
    with pytest.raises(ValueError, match=r"bad\.csv, line 2: cannot read"):
        load_trace(bad)
    bad.write_text("prompt,completion\n5,6\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        load_trace(bad)
    bad.write_text("input_len,output_len\n")
    with pytest.raises(ValueError, match="no data rows"):
        load_trace(bad)
