"""Validation of the simulator against the executor: the same decisions in both backends, the module split
of the simulator's time, and `python -m batchgen.validate`'s cases, errors and last line."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchgen.decisions import BoundaryDecision, first_difference, ranges, trace_of
from batchgen.memory import ConfigError
from batchgen.policy import policy_names
from batchgen.sim.run import simulate
from batchgen.compare import CaseResult, Side
from batchgen.validate.cases import cases_from_args, profiles_first
from batchgen.validate.report import summary_line
from tests.conftest import make_job

POLICIES = ("coroutine", "continuous", "static", "sglang_opt")


def small_job(policy: str):
    rng = np.random.default_rng(1)
    knobs = {"continuous_chunks": {"token_budget": 24},  # prompts split over forwards
             "continuous_conservative": {"token_budget": 24, "admission": "conservative"}}.get(policy)
    return make_job(policy if policy in POLICIES else policy.split("_")[0],
                    cluster_overrides=dict(num_gpus=1, gpus_per_node=1),
                    inputs=rng.integers(8, 64, 12), outputs=rng.integers(2, 30, 12), page_tokens=16,
                    policy_overrides=knobs)


@pytest.mark.parametrize("policy", [*POLICIES, "continuous_chunks", "continuous_conservative"])
def test_both_backends_take_the_same_decisions(policy):
    """Given the executor's capabilities and KV pool, the simulator decides exactly as the executor did; with
    its own (layer-by-layer offload, the planned pool) it does not: the test can fail."""
    torch = pytest.importorskip("torch")
    from batchgen.exec.run import ExecSettings, execute

    job = small_job(policy)
    before = torch.get_num_threads()
    measured = execute(job, ExecSettings(device="cpu", threads=1, kv_budget_mb=0.5))
    assert torch.get_num_threads() == before
    same = simulate(job, capabilities=measured.capabilities,
                    kv_pages_per_gpu=measured.prepared.budget.kv_pages_per_gpu)
    m_trace, s_trace = trace_of(measured.records), trace_of(same.records)
    assert len(m_trace) >= 2 and m_trace == s_trace, first_difference(m_trace, s_trace).describe()
    own = simulate(job)
    assert first_difference(m_trace, trace_of(own.records)) is not None


def _decision(**changes) -> BoundaryDecision:
    base = dict(instance=0, phase="decode", prefilled=(), chunked=(), decoded=(0, 1, 2), host_resident=(),
                yielded=(), offloaded=(), evicted=(), migrated=(), admitted=(), partitioned=(), pinned=(), steps=16,
                stop="none", micro_batch=0, flags="")
    return BoundaryDecision(**{**base, **changes})


def test_first_difference_names_the_boundary_and_the_field():
    a = [_decision(phase="prefill", prefilled=(0, 1, 2), decoded=()), _decision(), _decision(decoded=(0, 2))]
    b = [a[0], _decision(yielded=(1,)), a[2]]
    d = first_difference(a, b)
    assert (d.instance, d.boundary, d.field) == (0, 1, "yielded")
    assert "boundary 1" in d.describe() and "+[1]" in d.describe()
    assert first_difference(a, a[:2]).field == "length"
    assert first_difference(a, list(a)) is None


def test_idle_changes_fold_into_the_next_decision_and_ids_print_as_ranges():
    idle = _decision(phase="idle", decoded=(), evicted=(7,))
    assert idle.changes_something() and not _decision(phase="idle", decoded=()).changes_something()
    merged = _decision(evicted=(3,)).merged(idle)
    assert merged.evicted == (3, 7) and merged.decoded == (0, 1, 2)
    assert ranges((0, 1, 2, 5, 7, 8)) == "0-2 5 7-8" and _decision().row()["decoded"] == "0-2"


@pytest.mark.parametrize("padding", [0.0, 1.0])
def test_simulated_modules_add_up_to_the_priced_run(padding):
    """With a data-sheet roofline (no per-forward or per-boundary overhead) and device-resident KV, a run's
    modules are its whole duration: the module split mirrors pricing.price (padded attention kernels too)."""
    from batchgen.latency import Efficiency
    out = simulate(make_job("continuous", n=30, efficiency=Efficiency(attention_padding=padding)))
    for r in out.records:
        assert set(r.modules) == {"attention", "ffn", "head"}
        assert sum(r.modules.values()) == pytest.approx(r.duration, rel=1e-9)


def test_cases_default_to_three_workloads_by_every_policy_on_this_runs_own_calibration():
    assert profiles_first([]) and profiles_first(["workload=small"])
    cases = cases_from_args([], Path("fresh.json"))
    assert len({c.workload for c in cases}) >= 3 and {c.policy for c in cases} == set(policy_names())
    assert all("latency.calibration=fresh.json" in c.overrides and "backend.threads=1" in c.overrides
               and "backend.clock=cpu" in c.overrides for c in cases)
    assert len(cases) == len(policy_names()) * len({c.workload for c in cases})


def test_a_stored_calibration_on_the_command_line_replaces_the_runs_own():
    args = ["latency.calibration=cpu_epyc_milan_2c-tiny_moe.json"]
    assert not profiles_first(args) and not profiles_first(["latency=roofline"])
    for c in cases_from_args(args):
        assert "latency=table" in c.overrides and args[0] in c.overrides


def test_cases_follow_the_command_line():
    cases = cases_from_args(["workload=azure_conv", "workload.trace=my.csv", "policy=static,coroutine",
                             "latency=roofline", "backend.repeats=7"])
    assert [c.name for c in cases] == ["azure_conv/static", "azure_conv/coroutine"]
    for c in cases:
        assert "latency=roofline" in c.overrides and not any(o.startswith("latency.calibration") for o in c.overrides)
        assert c.overrides.index("backend.repeats=7") > c.overrides.index("backend.repeats=3")  # the user wins
        assert "workload.trace=my.csv" in c.overrides


def test_one_default_workload_runs_as_in_the_default_run():
    alone = cases_from_args(["workload=small", "policy=continuous", "workload.num_sequences=6"])
    default = [c for c in cases_from_args(["policy=continuous"]) if c.workload == "small"]
    assert [c.name for c in alone] == [c.name for c in default] == ["small/continuous"]
    assert alone[0].overrides[:-1] == default[0].overrides  # the same case, then the user's override
    assert alone[0].overrides[-1] == "workload.num_sequences=6"


@pytest.mark.parametrize("args, words", [
    (["backend=sim"], "runs both backends"),
    (["policy=fastest"], "choose among"),
    (["policy="], "choose among"),
    (["model"], "not an override"),
    (["--repeats", "3"], "not an override"),
])
def test_bad_arguments_are_refused(args, words):
    with pytest.raises(ConfigError, match=words):
        cases_from_args(args)


def _run_validate(tmp_path, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "batchgen.validate", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["workload=no_such_workload"], "no_such_workload"),
    (["backend=sim"], "runs both backends"),
    (["workload.num_sequences=many"], "num_sequences"),
    (["backend.speed=11"], "speed"),
])
def test_cli_reports_bad_input_without_a_traceback(tmp_path, args, words):
    proc = _run_validate(tmp_path, *args, "latency=roofline", "efficiency=datasheet")
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_summary_line_is_median_and_worst_absolute_error():
    results = [CaseResult(cases_from_args([])[i], Side(1.0), Side(p), [1.0], 0.5, None, 3)
               for i, p in enumerate((1.02, 0.9, 1.05))]
    assert summary_line(results) == "median_abs_error=5.0% worst_abs_error=10.0%"
    assert summary_line(results, cpu=True) == "median_abs_error=104.0% worst_abs_error=110.0%"  # 1.02 / 0.5
    # a machine at 0.5x the calibration's times: the predictions, halved, are 49-55% low
    results = [dataclasses.replace(r, drift=0.5) for r in results]
    assert summary_line(results, drift=True) == "median_abs_error=49.0% worst_abs_error=55.0%"
    assert summary_line(results) == "median_abs_error=5.0% worst_abs_error=10.0%"  # the last line: unscaled


@pytest.mark.slow
def test_cli_prints_cases_and_ends_with_the_error_line(tmp_path):
    proc = _run_validate(tmp_path, "workload=small", "workload.num_sequences=6", "workload.max_output=16",
                         "policy=static", "backend.repeats=2", "latency=roofline", "efficiency=datasheet")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("small/static") and "equal" in line for line in lines)
    assert re.fullmatch(r"median_abs_error=\d+\.\d% worst_abs_error=\d+\.\d%", lines[-1])


def test_pd_disagg_cases_run_a_prefill_and_a_decode_unit():
    """The executor's default is one GPU; PD-disaggregation needs a unit of each kind: its cases ask for two GPUs,
    and an explicit cluster.num_gpus on the command line still wins (it comes later)."""
    case = next(c for c in cases_from_args(["policy=pd_disagg"]))
    assert "cluster.num_gpus=2" in case.overrides
    case = next(c for c in cases_from_args(["policy=pd_disagg", "cluster.num_gpus=4"]))
    assert case.overrides.index("cluster.num_gpus=4") > case.overrides.index("cluster.num_gpus=2")


@pytest.mark.slow
def test_by_default_validation_profiles_this_machine_first_and_predicts_from_that_file(tmp_path, monkeypatch, capsys):
    """The default run (no latency= on the command line) profiles first, writes its calibration under
    outputs/validate/<time>/ with the in-run ratios of its stage, run in the same rounds as the cases, and predicts
    every case from it (the grid and repeats made small here, the in-run stage on one policy; docs/calibration.md's
    example validates the file its profile example wrote)."""
    from batchgen.profile import in_run
    from batchgen.validate import __main__ as cli
    from batchgen.validate import fresh

    monkeypatch.setattr(fresh, "GRID", "test")
    monkeypatch.setattr(in_run, "POLICIES", ("static",))
    monkeypatch.setattr(fresh, "REPEATS", 1)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["workload=small", "workload.num_sequences=6", "workload.max_output=16", "policy=static",
                     "backend.repeats=2"]) == 0
    out, err = capsys.readouterr()
    written = list((tmp_path / "outputs" / "validate").glob("*/calibration.json"))
    assert len(written) == 1 and "profiling this machine first" in err
    in_run = json.loads(written[0].read_text())["in_run"]  # the in-run stage ran and its ratios were kept
    assert in_run["policies"] == ["static"] and set(in_run["scales"]) >= {"attention", "ffn", "head"}
    assert err.index("round 2 of every case") < err.index("in-run scales")  # measured in the cases' rounds
    row = next(line for line in out.splitlines() if line.startswith("small/static"))
    assert "equal" in row
    assert re.fullmatch(r"median_abs_error=\d+\.\d% worst_abs_error=\d+\.\d%", out.strip().splitlines()[-1])


@pytest.mark.parametrize("stage, cases", [(3, 24), (3, 1), (1, 5), (0, 4), (3, 0)])
def test_a_round_spreads_the_in_run_stage_evenly_among_the_cases(stage, cases):
    """The in-run ratios and the cases must sample the machine over the same minutes: each of the stage's jobs
    once per round, spread among the cases, every case once."""
    from batchgen.validate.fresh import interleave

    order = interleave(list(range(stage)), list(range(cases)))
    assert sorted(order) == list(range(cases + stage))
    where = [order.index(cases + i) for i in range(stage)]
    assert where == sorted(where)
    if stage and cases >= stage:
        gaps = [b - a for a, b in zip([-1] + where, where + [len(order)])]
        assert max(gaps) - min(gaps) <= cases // stage + 1  # no two of the stage's jobs bunched together
