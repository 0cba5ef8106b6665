"""Results: the summary agrees with the run it describes, the files read back, the plot renders, and the
explanation's ratios are the ones in the table."""

from __future__ import annotations

import csv
import json
import re
from dataclasses import replace

import numpy as np
import pytest

from batchgen.job import Job
from batchgen.policy import make_policy, policy_names
from batchgen.results import device_table, explain, format_table, plot_timeline, summarize, write_results
from batchgen.results.metrics import step_arrays
from batchgen.results.plot import _binned_mean
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from batchgen.workload import build_workload

WORKLOAD = {"name": "t", "num_sequences": 200, "input": {"kind": "uniform", "low": 64, "high": 512},
            "output": {"kind": "longtail", "mean": 128, "max": 512}}
# one-instance runs: pd_disagg always runs as at least two units (instances); tests/test_pd_disagg.py checks it
POLICIES = [p for p in policy_names() if p != "pd_disagg"]
TOL = 1e-5  # summaries keep six significant digits


def _run(policy: str, model: str = "qwen3_30b_a3b", instances: int = 1):
    cluster = load_cluster("h100_8")
    cluster = replace(cluster, gpus_per_instance=cluster.num_gpus // instances)
    job = Job(load_model(model), cluster, build_workload(WORKLOAD, seed=0), make_policy({"name": policy}))
    return simulate(job)


@pytest.fixture(scope="module")
def runs():
    return {p: _run(p) for p in POLICIES}


@pytest.fixture(scope="module")
def summaries(runs):
    return {p: summarize(out) for p, out in runs.items()}


@pytest.mark.parametrize("policy", POLICIES)
def test_summary_matches_the_run(runs, summaries, policy):
    out, s = runs[policy], summaries[policy]
    t = out.prepared.state.table
    assert s["policy"] == policy and s["backend"] == "sim" and s["workload"] == "t"
    assert s["num_sequences"] == 200 and s["num_gpus"] == 8 and s["num_instances"] == 1
    assert s["bct_s"] == pytest.approx(np.max(t.finish_time), rel=TOL)
    assert s["sct_p99_s"] <= s["bct_s"] and s["sct_p50_s"] <= s["sct_p99_s"]
    assert s["output_tokens"] == int(out.job.workload.output_lens.sum())
    assert s["prompt_tokens"] == int(out.job.workload.input_lens.sum())
    assert s["tokens_per_s"] == pytest.approx(s["output_tokens"] / s["bct_s"], rel=TOL)
    assert s["steps"] == len(out.records)
    assert s["prefill_s"] + s["decode_s"] + s["mixed_s"] == pytest.approx(sum(r.duration for r in out.records),
                                                                          rel=TOL)


@pytest.mark.parametrize("policy", POLICIES)
def test_time_fractions_add_up(summaries, policy):
    s = summaries[policy]
    for key in ("gpu_busy_frac", "gpu_comm_frac", "gpu_idle_frac", "tail_idle_frac", "peak_kv_frac",
                "peak_host_frac"):
        assert 0.0 <= s[key] <= 1.0, key
    assert s["gpu_busy_frac"] + s["gpu_comm_frac"] + s["gpu_idle_frac"] == pytest.approx(1.0, abs=1e-4)
    assert s["tail_idle_frac"] <= s["gpu_idle_frac"] + 1e-6
    assert s["tail_idle_frac"] == 0.0  # one instance: nothing drains before the end of the run


@pytest.mark.parametrize("policy", POLICIES)
def test_expert_batch_follows_from_gate_tokens(runs, summaries, policy):
    s, m = summaries[policy], runs[policy].job.model
    calls = sum(r.expert_calls for r in runs[policy].records)
    gate = sum(r.expert_tokens for r in runs[policy].records) / calls
    assert s["mean_gate_tokens"] == pytest.approx(gate, rel=TOL)
    assert s["mean_expert_batch"] == pytest.approx(s["mean_gate_tokens"] * m.top_k / m.num_experts, rel=TOL)


@pytest.mark.parametrize("policy", POLICIES)
def test_decode_expert_batch_and_mean_running_follow_from_the_steps(runs, summaries, policy):
    s, out = summaries[policy], runs[policy]
    m = out.job.model
    decode = [r for r in out.records if r.phase == "decode"]
    tokens = sum(r.expert_tokens for r in decode) / sum(r.expert_calls for r in decode)
    assert s["decode_expert_batch"] == pytest.approx(tokens * m.top_k / m.num_experts, rel=TOL)
    weighted = sum(r.running * r.duration for r in out.records)
    assert s["mean_running"] == pytest.approx(weighted / s["bct_s"], rel=1e-4)  # one instance
    assert 0 < s["mean_running"] <= max(r.running for r in out.records)


def test_planned_knobs_are_in_the_results(runs, summaries):
    """coroutine's b_attn / b_moe / kv_residency / attention default to auto: the plan that resolved them is in
    results.json, and the run used exactly those values."""
    plan, ran = summaries["coroutine"]["plan"], runs["coroutine"].prepared.policy
    assert (plan["b_attn"], plan["b_moe"], plan["kv_residency"], plan["attention"]) == \
        (ran.b_attn, ran.b_moe, ran.kv_residency, ran.attention)
    assert plan["layer_s"] > 0 and plan["tokens_per_s"] > 0
    assert "plan" not in summaries["continuous"]  # nothing to plan: no auto knobs


def test_summary_is_plain_json(summaries):
    s = summaries["coroutine"]
    assert json.loads(json.dumps(s)) == s


def test_dense_model_has_no_expert_batch():
    s = summarize(_run("continuous", model="llama2_7b"))
    assert s["mean_expert_batch"] is None and s["mean_gate_tokens"] is None


def test_tail_idle_counts_instances_that_drained_early():
    out = _run("continuous", instances=2)
    s, steps = summarize(out), step_arrays(out)
    ends = [steps.end[steps.instance == i].max() for i in range(2)]
    expected = sum((max(ends) - e) * 4 for e in ends) / (8 * max(ends))
    assert s["num_instances"] == 2
    assert s["tail_idle_frac"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_device_table_accounts_every_gpu(runs, summaries):
    out, s = runs["coroutine"], summaries["coroutine"]
    rows = device_table(out)
    assert [r["gpu"] for r in rows] == list(range(8))
    busy = sum(r["busy_s"] for r in rows)
    assert busy / (8 * s["bct_s"]) == pytest.approx(s["gpu_busy_frac"], rel=1e-4)
    for r in rows:
        assert r["busy_s"] + r["comm_s"] + r["idle_s"] == pytest.approx(s["bct_s"], rel=1e-4)
        assert 0 <= r["peak_kv_pages"] <= r["kv_pages_capacity"]


def test_files_read_back(runs, summaries, tmp_path):
    out, s = runs["coroutine"], summaries["coroutine"]
    paths = write_results(out, tmp_path / "run", s, config={"policy": {"name": "coroutine"}})
    assert set(paths) == {"results.json", "sequences.csv", "steps.csv", "devices.csv", "device_timeline.csv",
                          "decisions.csv"}
    decisions = paths["decisions.csv"].read_text().splitlines()
    assert len(decisions) == 1 + len(out.records) and decisions[0].startswith("boundary,instance,phase,prefilled")
    doc = json.loads(paths["results.json"].read_text())
    assert doc["config"] == {"policy": {"name": "coroutine"}}
    assert {k: v for k, v in doc.items() if k != "config"} == s
    seqs = np.genfromtxt(paths["sequences.csv"], delimiter=",", names=True)
    assert seqs.size == s["num_sequences"]
    assert seqs["finish_s"].max() == pytest.approx(s["bct_s"], rel=TOL)
    assert int(seqs["output_len"].sum()) == s["output_tokens"]
    with paths["steps.csv"].open() as fh:
        steps = list(csv.DictReader(fh))
    assert len(steps) == len(out.records) and {r["phase"] for r in steps} <= {"prefill", "decode"}
    with paths["devices.csv"].open() as fh:
        assert len(list(csv.DictReader(fh))) == s["num_gpus"]


def test_plot_is_a_png(runs, tmp_path):
    path = plot_timeline(runs["coroutine"], tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_drawn_in_a_forked_process_is_the_same_file(runs, tmp_path):
    """TimelinePlot forks before the run and draws in the child: the file equals the one drawn here; a child
    whose input never comes exits without a file."""
    from batchgen.results import TimelinePlot
    from batchgen.results.forked import fork_is_safe

    out = runs["coroutine"]
    plot = TimelinePlot(tmp_path / "forked.png")
    assert (plot._child.pid is not None) == fork_is_safe()
    plot.draw(out)
    assert plot.wait().read_bytes() == plot_timeline(out, tmp_path / "here.png").read_bytes()
    unused = TimelinePlot(tmp_path / "never.png")
    unused.cancel()
    assert not (tmp_path / "never.png").exists()


def test_a_failed_forked_plot_is_an_error(runs, tmp_path, capfd):
    from batchgen.results.forked import Deferred, fork_is_safe

    if not fork_is_safe():
        pytest.skip("no safe fork here: the work runs in this process")

    def fail(payload):
        raise ValueError(f"bad payload {payload}")

    child = Deferred(lambda: None, fail, "the test's work")
    child.send(7)
    with pytest.raises(RuntimeError, match="the test's work failed in its process"):
        child.wait()
    assert "bad payload 7" in capfd.readouterr().err


def _texts(fig) -> list[str]:
    """Every text of a figure: titles, axis labels, tick labels, legend entries, annotations."""
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_position"))]


def test_timeline_stands_alone(runs):
    """It names what ran (policy, model, cluster, workload, request count), labels its axes with units, shows
    communication beside compute and idle, and prints seconds plainly."""
    from batchgen.results.plot import timeline_figure

    out = runs["coroutine"]
    fig = timeline_figure(out)
    fig.canvas.draw()
    title = fig._suptitle.get_text()
    for word in ("coroutine", out.job.model.name, out.job.cluster.name, out.job.workload.name,
                 f"{len(out.prepared.state.table):,} requests"):
        assert word in title, title
    top, bottom = fig.axes[:2]
    assert {"compute", "communication", "idle"} <= set(top.get_legend_handles_labels()[1])
    assert "(s)" in bottom.get_xlabel() and "share" in top.get_ylabel()
    assert not any("e+" in t or "e-0" in t for t in _texts(fig)), [t for t in _texts(fig) if "e+" in t]
    _all_inside(fig)


def _all_inside(fig) -> None:
    """Nothing drawn runs off the canvas (a label cut at the figure's edge): the bounding box of everything drawn,
    as a tight bounding box would crop it, lies within the figure's."""
    fig.canvas.draw()
    drawn, canvas = fig.get_tightbbox(fig.canvas.get_renderer()), fig.bbox_inches
    assert (drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= canvas.x1 + 0.01
            and drawn.y1 <= canvas.y1 + 0.01), (drawn, canvas)


def test_timeline_holds_large_counts_and_long_titles(runs):
    """Margins sized from what they hold: seven-digit running counts and a title of two lines stay on the canvas."""
    from batchgen.results.plot import draw_timeline, timeline_of

    t = timeline_of(runs["coroutine"])
    t.series["running"] = t.series["running"] * 5e6 / max(float(t.series["running"].max()), 1.0)
    t.title = t.title + " | " + "a much longer title, " * 8
    _all_inside(draw_timeline(t))


def test_binning_keeps_the_integral():
    start = np.array([0.0, 1.0, 1.5, 4.0])
    end = np.array([1.0, 1.5, 3.0, 5.0])
    value = np.array([0.5, 1.0, 0.2, 0.8])
    edges = np.linspace(0, 5, 7)
    binned = _binned_mean(start, end, value, edges)
    assert (binned * np.diff(edges)).sum() == pytest.approx((value * (end - start)).sum())
    assert binned[0] == pytest.approx(0.5)  # the first bin lies inside the first step


def test_table_has_one_line_per_run(summaries):
    text = format_table(list(summaries.values()))
    lines = text.splitlines()
    assert len(lines) == 2 + len(summaries)
    assert len({len(line) for line in lines}) == 1  # fixed width
    for policy, line in zip(summaries, lines[2:]):
        assert line.startswith(policy)


def test_explain_ratios_match_the_numbers(summaries):
    rows = list(summaries.values())
    text = explain(rows)
    best = min(rows, key=lambda r: r["bct_s"])
    assert text.splitlines()[0].startswith(f"{best['policy']}: best BCT")
    found = dict(re.findall(r"^(\w+): (\d+\.\d+)x the BCT of", text, flags=re.M))
    assert set(found) == {r["policy"] for r in rows} - {best["policy"]}
    for r in rows:
        if r is not best:
            assert found[r["policy"]] == f"{r['bct_s'] / best['bct_s']:.2f}"


def test_explain_points_at_what_differs():
    base = {"policy": "a", "num_gpus": 8, "bct_s": 10.0, "gpu_busy_frac": 0.8, "gpu_comm_frac": 0.1,
            "gpu_idle_frac": 0.1, "tail_idle_frac": 0.0, "mean_expert_batch": 60.0, "recomputes": 0}
    worse = {**base, "policy": "b", "bct_s": 15.0, "gpu_busy_frac": 0.5, "gpu_idle_frac": 0.4,
             "tail_idle_frac": 0.12, "mean_expert_batch": 38.0}
    text = explain([worse, base])
    assert "b: 1.50x the BCT of a" in text
    assert "idle 40%" in text and "(a 10%)" in text and "12% of GPU-time after" in text
    assert "expert batch 38 vs 60" in text
    assert "communication" not in text and "recomputed" not in text
    assert explain([base]) == ""


def test_device_timeline_slices_add_up_to_the_totals(runs, summaries, tmp_path):
    out, summary = runs["continuous"], summaries["continuous"]
    paths = write_results(out, tmp_path, summary)
    rows = np.loadtxt(paths["device_timeline.csv"], delimiter=",", skiprows=1)
    busy, comm = rows[:, 3], rows[:, 4]
    assert np.all(busy + comm <= 1.0 + 1e-3)  # no slice holds more than its own length of work
    gpus = out.prepared.state.topo.num_gpus
    assert rows.shape[0] == 100 * gpus
    # the mean busy share over slices and GPUs is the run's busy share
    assert busy.mean() == pytest.approx(summary["gpu_busy_frac"], rel=1e-2)


def test_results_json_counts_prefill_tokens_with_and_without_sharing(tmp_path):
    """A shared-prefix workload's results.json says how many prompt tokens were submitted and how many are
    distinct (each group's prefix once); a workload that shares nothing has the two equal."""
    from batchgen.workload.spec import WorkloadSpec

    cfg = {"name": "g", "num_sequences": 32, "input": {"kind": "uniform", "low": 64, "high": 256},
           "output": {"kind": "uniform", "low": 4, "high": 32}, "prefix": {"group_size": 8, "length": "prompt"}}
    shared = WorkloadSpec.from_config(cfg).build(0, progress=False)
    plain = build_workload({k: v for k, v in cfg.items() if k != "prefix"}, seed=0)
    docs = {}
    for name, workload in (("shared", shared), ("plain", plain)):
        out = simulate(Job(load_model("tiny_moe"), load_cluster("h100_8"), workload, make_policy({"name": "static"})))
        write_results(out, tmp_path / name, summarize(out), skip=("decisions.csv",))
        docs[name] = json.loads((tmp_path / name / "results.json").read_text())
    groups = shared.input_lens[::8]
    assert docs["shared"]["prefill_tokens_submitted"] == docs["shared"]["prompt_tokens"] == 8 * int(groups.sum())
    assert docs["shared"]["prefill_tokens_distinct"] == int(groups.sum())
    assert docs["plain"]["prefill_tokens_distinct"] == docs["plain"]["prefill_tokens_submitted"] == int(
        plain.input_lens.sum())


def test_table_shows_prefill_counts_only_for_a_workload_that_shares_a_prefix():
    """A shared-prefix run's table row carries both counts; a run without groups prints the table it always
    did (the counts are in its results.json, not in the table)."""
    from batchgen.workload.spec import WorkloadSpec

    cfg = {"name": "g", "num_sequences": 32, "input": {"kind": "uniform", "low": 64, "high": 256},
           "output": {"kind": "uniform", "low": 4, "high": 32}, "prefix": {"group_size": 8, "length": "prompt"}}
    rows = {}
    for name, workload in (("shared", WorkloadSpec.from_config(cfg).build(0, progress=False)),
                           ("plain", build_workload({k: v for k, v in cfg.items() if k != "prefix"}, seed=0))):
        out = simulate(Job(load_model("tiny_moe"), load_cluster("h100_8"), workload, make_policy({"name": "static"})))
        rows[name] = summarize(out)
    head, _, line = format_table([rows["shared"]]).splitlines()
    cells = dict(zip(re.split(r"\s{2,}", head), line.split()))
    assert cells["prefill tok"] == f"{rows['shared']['prefill_tokens_submitted']:,}"
    assert cells["distinct tok"] == f"{rows['shared']['prefill_tokens_distinct']:,}"
    assert rows["shared"]["prefill_tokens_distinct"] * 8 == rows["shared"]["prefill_tokens_submitted"]
    plain = format_table([rows["plain"]])
    assert "prefill tok" not in plain and "distinct tok" not in plain
    without = {k: v for k, v in rows["plain"].items() if not k.startswith("prefill_tokens_")}
    assert plain == format_table([without])  # the same table as before the counts existed
    both = format_table([rows["shared"], rows["plain"]]).splitlines()  # a sweep over both: each run's counts
    assert f"{rows['plain']['prefill_tokens_submitted']:,}" in both[3]
