"""A sweep's results: sweep.csv, sweep.png/.pdf and the grouped table (batchgen/results/sweep.py).

Most tests fabricate a multirun directory (numbered job dirs, each with .hydra/overrides.yaml and results.json
or error.txt) instead of running Hydra; one runs a real small sweep through the command line.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.results import explain, format_table, summarize_sweep
from batchgen.results.sweep import group_runs, load_sweep, parse_override

PNG = b"\x89PNG\r\n\x1a\n"


def result(policy: str, bct: float, *, model: str = "qwen3_30b_a3b", num_gpus: int = 8, **extra) -> dict:
    return {"policy": policy, "backend": "sim", "model": model, "cluster": "h100_8", "gpu": "h100",
            "workload": "small", "num_sequences": 100, "num_gpus": num_gpus, "num_instances": 1, "bct_s": bct,
            "tokens_per_s": 1000.0 / bct, "gpu_busy_frac": 0.7, "gpu_comm_frac": 0.2, "gpu_idle_frac": 0.1,
            "tail_idle_frac": 0.0, "prefill_frac": 0.1, "mean_expert_batch": 50.0, "decode_expert_batch": 20.0,
            "mean_running": 100.0, "recomputes": 0, "host_bytes_per_decode_iter": 2.5e9, "output_tokens": 1000,
            "plan": {"b_moe": 64}, **extra}


def fake_sweep(root: Path, jobs: list[tuple[list[str], dict | str]]) -> Path:
    """jobs: (overrides as typed, results dict or an error message) per job, numbered in order."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (overrides, outcome) in enumerate(jobs):
        job = root / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        if isinstance(outcome, str):
            (job / "error.txt").write_text(outcome + "\n")
        else:
            (job / "results.json").write_text(json.dumps({**outcome, "config": {"seed": 0}}))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def two_models(tmp_path):
    """+policy=coroutine,continuous model=deepseek_r1,qwen3_30b_a3b cluster.num_gpus=8 workload.num_sequences=100,
    R1 ~196x slower than Qwen: runs of different models must never be compared."""
    jobs = []
    bcts = {("coroutine", "deepseek_r1"): 1960.0, ("continuous", "deepseek_r1"): 2940.0,
            ("coroutine", "qwen3_30b_a3b"): 10.0, ("continuous", "qwen3_30b_a3b"): 12.5}
    for policy in ("coroutine", "continuous"):
        for model in ("deepseek_r1", "qwen3_30b_a3b"):
            jobs.append(([f"+policy={policy}", f"model={model}", "cluster.num_gpus=8", "workload.num_sequences=100"],
                         result(policy, bcts[policy, model], model=model)))
    return fake_sweep(tmp_path / "sweep", jobs)


def test_parse_override_strips_the_prefix_only():
    assert parse_override("+policy=coroutine") == ("policy", "coroutine")
    assert parse_override("++cluster.num_gpus=8") == ("cluster.num_gpus", "8")
    assert parse_override("workload.max_output=a=b") == ("workload.max_output", "a=b")
    assert parse_override("~routing_skew")[0] == "routing_skew"


def test_swept_keys_are_the_overrides_that_vary(two_models):
    runs, swept = load_sweep(two_models)
    assert swept == ["policy", "model"]  # cluster.num_gpus and num_sequences are the same in every job
    assert [r.name for r in runs] == ["0", "1", "2", "3"]
    groups = group_runs(runs, swept)
    assert [g.label for g in groups] == ["model=deepseek_r1", "model=qwen3_30b_a3b"]
    assert all(len(g.runs) == 2 for g in groups)


def test_ratios_are_within_a_group_only(two_models):
    text, runs = summarize_sweep(two_models, plot=False)
    rows = read_csv(two_models / "sweep.csv")
    ratio = {(r["policy"], r["model"]): float(r["bct_vs_group_best"]) for r in rows}
    assert ratio == pytest.approx({("coroutine", "deepseek_r1"): 1.0, ("continuous", "deepseek_r1"): 1.5,
                                   ("coroutine", "qwen3_30b_a3b"): 1.0, ("continuous", "qwen3_30b_a3b"): 1.25})
    best = {r["model"]: r["group_best"] for r in rows}
    assert best == {"deepseek_r1": "coroutine (run 0)", "qwen3_30b_a3b": "coroutine (run 1)"}
    # the printed explanation never compares a model with the other one
    assert "196.00x" not in text and "294.00x" not in text and "@" not in text
    assert "continuous: 1.50x the BCT of coroutine" in text
    assert "continuous: 1.25x the BCT of coroutine" in text
    assert text.index("[model=deepseek_r1]") < text.index("[model=qwen3_30b_a3b]")


def test_grouping_uses_every_swept_key(tmp_path):
    """policy x model x cluster.num_gpus: four groups of two policies; a group key never mixes two GPU counts."""
    jobs = []
    for policy in ("coroutine", "static"):
        for model in ("tiny_moe", "small_moe"):
            for gpus in (8, 16):
                bct = (1.0 if policy == "coroutine" else 2.0) * (10 if model == "small_moe" else 1) * 8 / gpus
                jobs.append(([f"+policy={policy}", f"model={model}", f"cluster.num_gpus={gpus}"],
                             result(policy, bct, model=model, num_gpus=gpus)))
    sweep = fake_sweep(tmp_path / "sweep", jobs)
    summarize_sweep(sweep, plot=False)
    rows = read_csv(sweep / "sweep.csv")
    assert len(rows) == 8
    header = list(rows[0])
    assert header[:5] == ["run", "group", "policy", "model", "cluster.num_gpus"]
    assert len({r["group"] for r in rows}) == 4
    for r in rows:
        assert r["group"] == f"model={r['model']}, cluster.num_gpus={r['cluster.num_gpus']}"
        assert float(r["bct_vs_group_best"]) == pytest.approx(1.0 if r["policy"] == "coroutine" else 2.0)


def test_csv_columns_hold_the_metrics(two_models):
    summarize_sweep(two_models, plot=False)
    rows = read_csv(two_models / "sweep.csv")
    header = list(rows[0])
    for col in ("run", "group", "policy", "model", "error", "bct_s", "bct_vs_group_best", "group_best",
                "tokens_per_s", "gpu_busy_frac", "gpu_idle_frac", "gpu_comm_frac", "prefill_frac",
                "mean_expert_batch", "decode_expert_batch", "mean_running", "recomputes",
                "host_bytes_per_decode_iter", "host_gb_per_decode_iter"):
        assert col in header, col
    assert "plan" not in header and "config" not in header  # nested documents stay in results.json
    assert "result.model" not in header  # results.json's model says the same as the override
    assert header.index("bct_s") < header.index("tokens_per_s")
    assert float(rows[0]["host_gb_per_decode_iter"]) == pytest.approx(2.5)
    assert all(r["error"] == "" for r in rows)


def test_a_group_with_one_policy_shows_no_ratio(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep", [
        (["+policy=coroutine", "model=tiny_moe"], result("coroutine", 2.0, model="tiny_moe")),
        (["+policy=coroutine", "model=small_moe"], result("coroutine", 3.0, model="small_moe")),
    ])
    text, _ = summarize_sweep(sweep, plot=False)
    rows = read_csv(sweep / "sweep.csv")
    assert [r["bct_vs_group_best"] for r in rows] == ["", ""]
    assert "x best" not in text and "the BCT of" not in text


def test_failed_runs_are_listed_with_their_error(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep", [
        (["+policy=coroutine", "model=deepseek_r1"], result("coroutine", 100.0, model="deepseek_r1")),
        (["+policy=continuous", "model=deepseek_r1"], "the weights need 84 GB per GPU, the GPU has 72"),
        (["+policy=coroutine", "model=qwen3_30b_a3b"], result("coroutine", 10.0)),
        (["+policy=continuous", "model=qwen3_30b_a3b"], result("continuous", 11.0)),
    ])
    text, runs = summarize_sweep(sweep)
    assert [r.name for r in runs if r.error] == ["1"]
    rows = {r["run"]: r for r in read_csv(sweep / "sweep.csv")}
    failed = rows["1"]
    assert failed["policy"] == "continuous" and failed["model"] == "deepseek_r1"
    assert "84 GB" in failed["error"] and failed["bct_s"] == "" and failed["tokens_per_s"] == ""
    assert rows["0"]["bct_vs_group_best"] == ""  # the only run of its group that finished
    assert float(rows["3"]["bct_vs_group_best"]) == pytest.approx(1.1)
    assert "continuous: run 1 failed: the weights need 84 GB" in text
    assert "continuous: run 0 failed: " + "x" * 100 + "..." in summarize_sweep(fake_sweep(tmp_path / "long", [
        (["+policy=continuous"], "x" * 300)]), plot=False)[0]
    assert (sweep / "sweep.png").read_bytes()[:8] == PNG


def test_figure_files_are_written(two_models):
    text, _ = summarize_sweep(two_models)
    assert (two_models / "sweep.png").read_bytes()[:8] == PNG
    assert (two_models / "sweep.pdf").read_bytes()[:5] == b"%PDF-"
    assert "sweep.csv" in text and "sweep.png" in text and "sweep.pdf" in text


def test_sweep_figure_stands_alone(tmp_path):
    """BCTs of 1,120 s are printed plainly, the title names model, cluster, workload and request count, and
    each run's GPU time is split into compute, communication and idle."""
    import matplotlib.pyplot as plt

    from batchgen.results.sweep import sweep_figure

    sweep = fake_sweep(tmp_path / "sweep", [([f"+policy={p}"], result(p, bct)) for p, bct in
                                            (("coroutine", 1120.0), ("continuous", 1530.0))])
    runs, swept = load_sweep(sweep)
    fig = sweep_figure(group_runs(runs, swept))
    fig.canvas.draw()
    title = fig._suptitle.get_text()
    assert "qwen3_30b_a3b | h100_8 | small, 100 requests" in title, title
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_position"))]
    assert "1,120 s\n1.00x" in texts and "1,530 s\n1.37x" in texts, texts
    assert not any("e+" in t for t in texts), texts
    bct_ax, share_ax = fig.axes[0], fig.axes[1]
    assert bct_ax.get_ylabel() == "batch completion time (s)"
    assert share_ax.get_ylabel() == "share of GPU time"
    assert share_ax.get_legend_handles_labels()[1] == ["compute", "communication", "idle"]
    plt.close(fig)


def test_missing_overrides_fall_back_to_the_results(tmp_path):
    """hydra.output_subdir=null leaves no .hydra: the swept keys are guessed from results.json."""
    sweep = fake_sweep(tmp_path / "sweep", [
        ([], result("coroutine", 1.0, model="a")), ([], result("static", 2.0, model="a")),
        ([], result("coroutine", 5.0, model="b")), ([], result("static", 6.0, model="b")),
    ])
    for job in sweep.iterdir():
        if job.is_dir():
            (job / ".hydra" / "overrides.yaml").unlink()
    _, runs = summarize_sweep(sweep, plot=False)
    rows = read_csv(sweep / "sweep.csv")
    assert {r["group"] for r in rows} == {"model=a", "model=b"}
    assert float(next(r for r in rows if r["model"] == "b" and r["policy"] == "static")["bct_vs_group_best"]) \
        == pytest.approx(1.2)


def test_table_shows_comm_share_and_drops_empty_columns():
    rows = [result("coroutine", 10.0), result("static", 12.0)]
    text = format_table(rows)
    head = text.splitlines()[0]
    assert "comm %" in head and "20.0" in text
    assert "spread %" not in head and "x best" not in head  # no row has them
    assert "BCT s" in format_table([{"policy": "a"}])


def test_explain_never_compares_different_models():
    rows = [result("coroutine", 1960.0, model="deepseek_r1"), result("coroutine", 10.0, model="qwen3_30b_a3b"),
            result("continuous", 12.0, model="qwen3_30b_a3b")]
    text = explain(rows)
    assert "196.00x" not in text and "best BCT, 1960" not in text
    assert "continuous: 1.20x the BCT of coroutine@qwen3_30b_a3b" in text


def test_real_sweep_through_the_cli(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", "-m", "+policy=coroutine,static",
                           "workload.num_sequences=50", "model=tiny_moe,small_moe", "output.plot=false",
                           "output.sequences_csv=false", f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = read_csv(sweep / "sweep.csv")
    assert len(rows) == 4
    assert {(r["policy"], r["model"]) for r in rows} == {(p, m) for p in ("coroutine", "static")
                                                          for m in ("tiny_moe", "small_moe")}
    for model in ("tiny_moe", "small_moe"):
        group = [r for r in rows if r["model"] == model]
        assert min(float(r["bct_vs_group_best"]) for r in group) == pytest.approx(1.0)
        assert {r["group"] for r in group} == {f"model={model}"}
    assert (sweep / "sweep.png").is_file() and (sweep / "sweep.pdf").is_file()
    summary = proc.stdout[proc.stdout.index("== sweep summary =="):]
    assert "[model=tiny_moe]" in summary and "[model=small_moe]" in summary and "comm %" in summary


def test_prefill_counts_in_the_csv_beside_the_prompt_tokens_and_in_the_table(tmp_path):
    """workload=rl_rollout,rl_rollout_grouped: sweep.csv has both counts after prompt_tokens for every run, the
    grouped table shows them because one run shares its prompts; a sweep that shares nothing has no such column."""
    counts = {"rl_rollout": (4096, 4096), "rl_rollout_grouped": (4096, 256)}
    jobs = [(["+policy=coroutine", f"workload={w}"], result("coroutine", 10.0, prompt_tokens=s,
             prefill_tokens_submitted=s, prefill_tokens_distinct=d)) for w, (s, d) in counts.items()]
    text, _ = summarize_sweep(fake_sweep(tmp_path / "sweep", jobs), plot=False)
    header = next(csv.reader((tmp_path / "sweep" / "sweep.csv").open()))
    at = header.index("prompt_tokens")
    assert header[at + 1:at + 3] == ["prefill_tokens_submitted", "prefill_tokens_distinct"]
    rows = {r["workload"]: r for r in read_csv(tmp_path / "sweep" / "sweep.csv")}
    assert rows["rl_rollout_grouped"]["prefill_tokens_distinct"] == "256"
    assert "distinct tok" in text and "4,096" in text and "256" in text
    plain = [(["+policy=coroutine", f"workload.num_sequences={n}"], result("coroutine", 10.0,
              prefill_tokens_submitted=n, prefill_tokens_distinct=n)) for n in (100, 200)]
    assert "prefill tok" not in summarize_sweep(fake_sweep(tmp_path / "plain", plain), plot=False)[0]
