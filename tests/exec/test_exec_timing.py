"""Executor timings a researcher can trust: pinned threads, repeats with a median and a spread, what ran
recorded in results.json, and the executor's page size taking effect."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.decisions import trace_of
from batchgen.exec.run import ExecSettings, execute
from batchgen.exec.threads import available_cores, pinned_threads, resolve_threads
from batchgen.memory import ConfigError
from batchgen.results.metrics import bct, summarize
from tests.conftest import make_job

ONE_GPU = dict(num_gpus=1, gpus_per_node=1)


def tiny_job(policy="continuous"):
    rng = np.random.default_rng(3)
    return make_job(policy, cluster_overrides=ONE_GPU, inputs=rng.integers(8, 40, 6), outputs=rng.integers(2, 12, 6),
                    page_tokens=16)


@pytest.fixture(scope="module")
def repeated():
    return execute(tiny_job(), ExecSettings(device="cpu", threads=1, repeats=3, kv_budget_mb=1.0))


def test_repeats_report_the_median_run_and_the_spread(repeated):
    out = repeated
    assert len(out.repeat_bcts) == 3 and all(b > 0 for b in out.repeat_bcts)
    assert bct(out) == statistics.median_low(out.repeat_bcts)  # the reported run is a real one, the median
    s = summarize(out)
    assert s["repeats"] == 3 and s["bct_s"] == pytest.approx(statistics.median(out.repeat_bcts), rel=1e-5)
    assert s["bct_min_s"] == pytest.approx(min(out.repeat_bcts), rel=1e-5)
    assert s["bct_max_s"] == pytest.approx(max(out.repeat_bcts), rel=1e-5)
    assert s["bct_spread"] == pytest.approx((max(out.repeat_bcts) - min(out.repeat_bcts)) / bct(out), rel=1e-4)
    assert len(s["bct_runs_s"]) == 3
    # same seed, same weights, same lengths: every repeat decided alike (only time differs)
    assert s["repeats_same_decisions"] is True and trace_of(out.records)


def test_results_record_what_ran(repeated):
    s = summarize(repeated)
    assert (s["device"], s["dtype"], s["threads"]) == ("cpu", "float32", 1)
    assert s["torch"] == torch.__version__ and s["interop_threads"] >= 1
    assert 0 < s["cpu_share"] <= 1.5 and len(repeated.repeat_cpu_shares) == 3


def test_threads_are_pinned_during_the_run_and_restored_after(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    with pinned_threads(1) as n:
        seen.append((n, torch.get_num_threads()))
    assert seen == [(1, 1)] and torch.get_num_threads() == before
    out = execute(tiny_job("static"), ExecSettings(device="cpu", threads="auto", kv_budget_mb=1.0))
    assert out.threads == available_cores() and torch.get_num_threads() == before
    assert summarize(out)["threads"] == available_cores()  # resolved, never "auto"


def test_threads_none_keeps_the_process_setting():
    with pinned_threads(1):
        out = execute(tiny_job("static"), ExecSettings(device="cpu", kv_budget_mb=1.0))
    assert out.threads == 1


@pytest.mark.parametrize("bad", [0, -2, "many", 1.5, True])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ConfigError, match="backend.threads"):
        resolve_threads(bad)


@pytest.mark.parametrize("bad", [0, "3", True])
def test_bad_repeats_are_refused(bad):
    with pytest.raises(ConfigError, match="backend.repeats"):
        execute(tiny_job(), ExecSettings(device="cpu", repeats=bad))


@pytest.mark.parametrize("omp,expected", [("1", 1), ("4096", None), ("", None), ("zero", None), ("0", None)])
def test_auto_takes_fewer_threads_where_omp_num_threads_asks_for_fewer(monkeypatch, omp, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert resolve_threads("auto") == (expected or available_cores())
    assert resolve_threads(3) == 3  # a pinned count is what it says


def test_available_cores_is_within_the_affinity():
    import os
    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))


def _page_tokens(*overrides: str) -> int:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=["+policy=coroutine", *overrides]).page_tokens


def test_exec_page_tokens_take_effect_and_the_command_line_still_wins():
    """backend=exec sets page_tokens: 16 (its group file); the top-level default (64) must not win over it."""
    assert _page_tokens() == 64
    assert _page_tokens("backend=exec") == 16
    assert _page_tokens("backend=exec", "page_tokens=32") == 32
    assert _page_tokens("page_tokens=32", "backend=exec") == 32


def test_a_sweep_says_when_repeat_ranges_overlap():
    """Medians are compared; when the repeats' ranges overlap the sweep says the order is within noise."""
    from batchgen.results.summary import explain, format_table
    base = dict(num_gpus=1, num_instances=1, repeats=3)
    fast = dict(base, policy="coroutine", bct_s=10.0, bct_min_s=9.0, bct_max_s=11.5, bct_spread=0.25)
    slow = dict(base, policy="static", bct_s=11.0, bct_min_s=10.8, bct_max_s=11.2, bct_spread=0.04)
    apart = dict(slow, bct_s=14.0, bct_min_s=13.5, bct_max_s=14.5)
    assert "within noise" in explain([fast, slow]) and "within noise" not in explain([fast, apart])
    assert "spread %" in format_table([fast]) and "25.0" in format_table([fast])


def test_the_cpu_clock_reports_the_fastest_run_with_its_wall_time_beside():
    """backend.clock=cpu: the run is timed in the working thread's CPU time (a neighbour cannot add to it), so the
    fastest repeat is the one reported; every repeat's wall BCT and the machine's load are kept beside it."""
    out = execute(tiny_job(), ExecSettings(device="cpu", threads=1, repeats=3, kv_budget_mb=1.0, clock="cpu"))
    assert out.clock == "cpu" and bct(out) == min(out.repeat_bcts)
    assert len(out.repeat_wall_bcts) == 3 and all(w > 0 for w in out.repeat_wall_bcts)
    assert out.load is not None and set(out.load) >= {"steal", "loadavg"}
    s = summarize(out)
    assert s["clock"] == "cpu" and len(s["bct_wall_runs_s"]) == 3
    modules = sum(sum(r.modules.values()) for r in out.records)
    assert 0 < modules <= bct(out) * 1.001  # module timers read the same clock as the run


def test_the_cpu_clock_needs_one_thread_on_a_cpu():
    with pytest.raises(ConfigError, match="backend.threads=1"):
        execute(tiny_job(), ExecSettings(device="cpu", threads=2, clock="cpu", kv_budget_mb=1.0))
    with pytest.raises(ConfigError, match="wall or cpu"):
        execute(tiny_job(), ExecSettings(device="cpu", threads=1, clock="tsc", kv_budget_mb=1.0))
