"""`python -m batchgen.experiment backend=exec`: the same entry point and result files, on real tensors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("policy", ["coroutine", "continuous", "static"])
def test_exec_backend_writes_results_and_outputs(tmp_path, policy):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", f"+policy={policy}", "backend=exec",
                           "model=tiny_moe", "workload.num_sequences=12", "workload.max_output=16",
                           "output.plot=false", f"hydra.run.dir={run}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((run / "results.json").read_text())
    assert results["backend"] == "exec" and results["policy"] == policy and results["num_sequences"] == 12
    assert results["bct_s"] > 0 and results["mean_expert_batch"] > 0
    # labelled by where it ran, never by the simulated cluster of the config (h100_8 by default)
    assert results["cluster"] == f"executor: 1 rank on {results['device']}" and results["gpu"] == results["device"]
    lines = [json.loads(x) for x in (run / "outputs.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == list(range(12))
    out_lens = [int(r.split(",")[2]) for r in (run / "sequences.csv").read_text().splitlines()[1:]]
    assert [len(x["output_token_ids"]) for x in lines] == out_lens  # ignore_eos: each runs to its length
    assert all(x["finish_reason"] == "length" for x in lines)


def test_exec_rejects_a_missing_model_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", "+policy=coroutine", "backend=exec",
                           f"backend.model_path={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_exec_rejects_a_prompt_longer_than_the_context(tmp_path):
    """tiny_moe allows 4,096 positions: a 5,000-token prompt is refused before the model runs."""
    proc = subprocess.run([sys.executable, "-m", "batchgen.experiment", "+policy=continuous", "backend=exec",
                           "model=tiny_moe", "workload=fixed_1k_1k", "workload.input.value=5000",
                           "workload.max_input=6000", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "4,096" in proc.stderr and "sequence 0" in proc.stderr and "Traceback" not in proc.stderr
