"""Progress bars (batchgen.progress): when they show, and that showing them changes no result."""

from __future__ import annotations

import io

import numpy as np
import pytest

from batchgen import progress
from batchgen.experiment import sweep_size
from batchgen.results.metrics import bct
from batchgen.sim.run import simulate
from batchgen.workload import build_workload, distributions


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)


@pytest.fixture
def shown_at_once(monkeypatch):
    """Bars appear at once (a test's job is tiny; by default a bar waits DELAY_S before showing)."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "MININTERVAL_S", 0.0)


def test_auto_follows_the_terminal(no_env):
    assert progress.enabled("auto", Stream(tty=True))
    assert not progress.enabled("auto", Stream(tty=False))
    assert progress.enabled(None, Stream(tty=True))


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("off", False)])
def test_the_environment_decides_auto(monkeypatch, value, expected):
    monkeypatch.setenv(progress.ENV, value)
    assert progress.enabled("auto", Stream(tty=not expected)) is expected


def test_a_setting_wins_over_the_environment_and_the_terminal(monkeypatch):
    monkeypatch.setenv(progress.ENV, "1")
    assert not progress.enabled(False, Stream(tty=True))
    monkeypatch.setenv(progress.ENV, "0")
    assert progress.enabled(True, Stream(tty=False))


def test_bad_values_are_named(monkeypatch):
    with pytest.raises(ValueError, match="output.progress"):
        progress.enabled("sometimes")
    monkeypatch.setenv(progress.ENV, "maybe")
    with pytest.raises(ValueError, match="BATCHGEN_PROGRESS"):
        progress.enabled("auto")


def test_a_disabled_bar_writes_nothing(no_env):
    stream = Stream(tty=False)
    with progress.bar(10, "x", stream=stream, delay=0) as b:
        b.update(10)
    assert b.disable and stream.getvalue() == ""


def test_a_tiny_job_shows_nothing():
    stream = Stream(tty=True)
    with progress.bar(10, "x", setting=True, stream=stream) as b:  # the default delay: a second or more
        b.update(10)
    assert stream.getvalue() == ""


def test_throttle():
    t = progress.Throttle(interval=60)
    assert t.due() and not t.due()


def test_simulation_with_a_bar_gives_the_same_result(job_factory, capsys, shown_at_once):
    off = simulate(job_factory(n=300), progress=False)
    assert capsys.readouterr().err == ""
    seen = []
    on = simulate(job_factory(n=300), progress=True, on_step=lambda plan, result: seen.append(plan.phase))
    err = capsys.readouterr().err
    assert "simulate coroutine" in err and "/300" in err and "simulated" in err, err
    assert seen, "the caller's own on_step still runs beside the bar"
    assert bct(on) == bct(off)
    assert [(r.instance, r.start, r.duration, r.phase, r.tokens) for r in on.records] == \
        [(r.instance, r.start, r.duration, r.phase, r.tokens) for r in off.records]


def test_watching_a_run_does_the_work_of_a_quiet_one(monkeypatch, capsys, shown_at_once):
    """A bar reads the state after each run (Engine.watch) and changes nothing else: a watched run prices the same
    runs and makes the same events as a quiet one."""
    from batchgen.sim.backend import SimBackend
    from conftest import make_job

    honest, calls = SimBackend.execute, []

    def counted(self, plan):
        calls.append(plan.phase)
        return honest(self, plan)

    monkeypatch.setattr(SimBackend, "execute", counted)
    rng = np.random.default_rng(1)
    job = make_job("continuous", "llama2_7b", "a100_8", rng.integers(8, 3000, 60), rng.integers(1, 600, 60),
                   cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})
    quiet = simulate(job, progress=False)
    quiet_calls, calls[:] = list(calls), []
    shown = simulate(job, progress=True)
    assert quiet_calls and calls == quiet_calls and shown.events == quiet.events
    assert "/60" in capsys.readouterr().err
    assert bct(shown) == bct(quiet)


class Counter:
    """A bar's interface as the distributions use it."""

    def __init__(self, total: int):
        self.total, self.n = total, 0

    def update(self, k: int) -> None:
        self.n += k


@pytest.mark.parametrize("dist", [
    {"kind": "uniform", "low": 16, "high": 4096},
    {"kind": "fixed", "value": 7},
    {"kind": "longtail", "mean": 512, "max": 2048},                # the cap binds: the bisection runs
    {"kind": "longtail", "mean": 512, "max_over_p95": float("inf")},  # no cap: no bisection
])
def test_sampling_in_chunks_draws_the_same_lengths(monkeypatch, dist):
    monkeypatch.setattr(distributions, "CHUNK", 997)  # many chunks, the last one partial
    d = distributions.make_distribution(dist)
    n = 10_000
    whole = d.sample(n, np.random.default_rng(3))
    counter = Counter(n)
    chunked = d.sample(n, np.random.default_rng(3), progress=counter)
    np.testing.assert_array_equal(whole, chunked)
    assert counter.n == counter.total >= n


@pytest.mark.parametrize("workload", ["small", "gsm8k_512_256"])
def test_workload_arrays_identical_with_and_without_progress(monkeypatch, capsys, shown_at_once, workload):
    from hydra import compose, initialize_config_dir

    from batchgen.confdir import conf_dir

    monkeypatch.setattr(distributions, "CHUNK", 4096)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"workload={workload}", "workload.num_sequences=20000"])
    off = build_workload(cfg.workload, seed=5, progress=False)
    assert capsys.readouterr().err == ""
    on = build_workload(cfg.workload, seed=5, progress=True)
    assert f"workload {workload}" in capsys.readouterr().err
    np.testing.assert_array_equal(off.input_lens, on.input_lens)
    np.testing.assert_array_equal(off.output_lens, on.output_lens)


def test_executor_progress_counts_requests_and_tokens(capsys, shown_at_once):
    class Tokens:
        generated = [[1] * 5, [1] * 7, [1] * 9]

    shown = progress.FinishProgress(3, "execute coroutine", setting=True)
    shown(np.array([0]), Tokens())
    shown(np.array([1, 2]), Tokens())
    assert shown.bar.n == 3 and shown.tokens == 16
    shown.bar.refresh()
    shown.close()
    err = capsys.readouterr().err
    assert "execute coroutine" in err
    assert "tok/s" in err and "req/s" not in err and "3/3 req" in err  # tokens/s, not tqdm's requests/s


def test_batch_job_bar_shows_tokens_per_second_not_requests(shown_at_once):
    """The batch job's bar (batchgen.run) has no rate of its own: its writer's tokens/s postfix is the rate."""
    stream = Stream(tty=True)
    shown = progress.bar(4, "requests", unit="req", setting=True, stream=stream, rate=False)
    shown.update(2)
    shown.set_postfix_str("123.4 tok/s")
    shown.close()
    text = stream.getvalue()
    assert "2/4 req" in text and "123.4 tok/s" in text and "req/s" not in text and "it/s" not in text


def test_sweep_size():
    assert sweep_size(["+policy=coroutine,continuous,static", "cluster.num_gpus=8,64", "seed=1"]) == 6
    assert sweep_size(["seed=range(0,4)"]) == 4
    assert sweep_size([]) == 1


def test_bad_progress_setting_is_a_config_error():
    from hydra import compose, initialize_config_dir

    from batchgen.confdir import conf_dir
    from batchgen.config import build_job
    from batchgen.memory import ConfigError

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+policy=coroutine", "output.progress=sometimes"])
    with pytest.raises(ConfigError, match="output.progress"):
        build_job(cfg)
