"""The profiler end to end on a tiny grid, and its one-line errors; the calibration check."""
from pathlib import Path

import pytest

import batchgen
from batchgen.latency.calibration_file import read
from batchgen.latency.roofline import Roofline
from batchgen.latency.table import TablePredictor
from batchgen.profile.__main__ import main
from batchgen.specs.catalog import load_hardware, load_model


def test_profile_writes_a_valid_file_the_table_reads(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["model=tiny_moe", "backend.device=cpu", "backend.threads=1", "grid=test", "warmup=0",
                 "repeats=2", f"out={out}"]) == 0
    data = read(out)
    assert data["key"]["threads"] == 1 and data["key"]["dtype"] == "float32"
    assert data["key"]["model"]["name"] == "tiny_moe"
    assert {"attention_decode", "attention_prefill", "router", "experts", "lm_head", "step", "h2d",
            "d2h"} <= set(data["modules"])
    dec = data["modules"]["attention_decode"]
    assert any(p["context_sum"] < p["tokens"] * p["max_context"] for p in dec)  # unequal contexts measured
    assert any(p["micro_batches"] > 1 for p in dec)
    assert all(p["seconds"] > 0 and p["repeats"] == 2 for p in dec)
    table = TablePredictor.from_file(out, Roofline(load_model("tiny_moe"), load_hardware("cpu_epyc_milan_2c")))
    p = dec[0]
    assert table.attention_decode(p["tokens"], p["context_sum"], 1, p["max_context"]) == pytest.approx(
        p["seconds"], rel=1e-6)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["model=no_such_model"], "no_such_model"),
    (["model=tiny_moe", "backend.device=tpu"], "backend.device"),
    (["model=tiny_moe", "grid=huge"], "grid='huge'"),
    (["backend.device=cpu"], "model=<name>"),
    (["tiny_moe"], "key=value"),
])
def test_bad_arguments_give_one_line_errors(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_in_run_stage_measures_each_module_inside_real_runs(tmp_path):
    """The in-run stage runs the executor on the calibration workload and the simulator on the grid's table,
    with the same decisions, and keeps measured / predicted per module kind."""
    import dataclasses

    from batchgen.profile.in_run import SCALED, calibration_cases, in_run_scales

    out = tmp_path / "cal.json"
    assert main(["model=tiny_moe", "backend.device=cpu", "backend.threads=1", "grid=test", "warmup=0",
                 "repeats=1", f"out={out}"]) == 0
    cases = calibration_cases("tiny_moe", "cpu", 1, "cpu_epyc_milan_2c", out, repeats=1)[:1]
    cases = [dataclasses.replace(c, overrides=(*c.overrides, "workload.num_sequences=6")) for c in cases]
    stage = in_run_scales(cases)
    assert set(stage["scales"]) == set(SCALED)
    # same code, same machine: within 20x either way (the test grid has few prefill points and times each once,
    # so its prefill for 6 prompts came out 4-11x the run's on December 3 and 7, beside another test; the bound
    # checks units, a ms-for-s slip being 1000x, not accuracy)
    assert all(0.05 < v < 20 for v in stage["scales"].values()), stage["scales"]
    assert all(stage["measured_s"][k] > 0 and stage["predicted_s"][k] > 0 for k in SCALED)


def test_the_calibration_check_tells_a_file_that_no_longer_describes_this_machine(tmp_path):
    """The check times a few of a file's own points again. A file profiled here just now, with every recorded time
    scaled by 8 (as if profiled on a machine eight times slower) or by 1/8, is stale, and the check's factor says
    which way: a shared machine's noise (up to 4x here) is far below that."""
    import json

    from batchgen.profile.probe import probe

    out = tmp_path / "cal.json"
    assert main(["model=tiny_moe", "backend.device=cpu", "backend.threads=1", "grid=test", "warmup=1",
                 "repeats=5", f"out={out}", "in_run=false"]) == 0
    data = json.loads(out.read_text())
    spec = load_model("tiny_moe")
    for scale in (8.0, 0.125):
        scaled = tmp_path / f"x{scale}.json"
        for points in data["modules"].values():
            for p in points:
                p["seconds"] *= scale
        scaled.write_text(json.dumps(data))
        drift = probe(scaled, spec)
        assert drift.stale and drift.points >= 6 and "Profile this machine again" in drift.describe()
        assert (drift.factor < 0.5) if scale > 1 else (drift.factor > 2.0)
        for points in data["modules"].values():  # back to the measured times
            for p in points:
                p["seconds"] /= scale


def test_the_calibration_check_declines_a_file_it_cannot_time_again(tmp_path):
    """A GEMM-only file (Vidur's, imported) has no module point to time; a CUDA file cannot be timed on a machine
    without CUDA: the check says why instead of failing."""
    import json

    import torch

    from batchgen.profile.probe import probe

    shipped = json.loads((Path(batchgen.__file__).parent / "data" / "calibration" /
                          "cpu_epyc_milan_2c-tiny_moe.json").read_text())
    gemms = tmp_path / "gemms.json"
    gemms.write_text(json.dumps({**shipped, "modules": {}}))
    with pytest.raises(ValueError, match="no module points"):
        probe(gemms, load_model("tiny_moe"))
    if not torch.cuda.is_available():
        cuda = tmp_path / "cuda.json"
        cuda.write_text(json.dumps({**shipped, "key": {**shipped["key"], "device": "cuda", "device_name": "H200"}}))
        with pytest.raises(ValueError, match="H200.*none"):
            probe(cuda, load_model("tiny_moe"))
