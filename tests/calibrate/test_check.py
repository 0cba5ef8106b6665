"""The shipped GPU efficiency files against Vidur profiles of models they were not fitted on."""
import re
from pathlib import Path

import pytest

import batchgen
from batchgen.calibrate import __main__ as calibrate_main
from batchgen.calibrate import check

VIDUR = Path(batchgen.__file__).parent / "data" / "profiles" / "vidur"
TARGET_MEDIAN, TARGET_P95 = 8.0, 25.0  # issue 8: held-out GPU op check


def summary(capsys, *args):
    assert check.main(list(args)) == 0
    out = capsys.readouterr().out.splitlines()
    m = re.fullmatch(r"median_abs_error=(\d+\.\d)% p95_abs_error=(\d+\.\d)%", out[-1])
    assert m, out[-1]
    return out, float(m[1]), float(m[2])


@pytest.mark.parametrize("gpu, hardware, model", [
    ("a100", "a100_80g", "Llama-2-70b-hf"),   # fitted on Llama-2-7b-hf + Meta-Llama-3-70B
    ("a100", "a100_80g", "Meta-Llama-3-8B"),
    ("h100", "h100", "Llama-2-70b-hf"),       # fitted on Llama-2-7b-hf
])
def test_held_out_profiles_meet_the_target(capsys, gpu, hardware, model):
    out, median, p95 = summary(capsys, f"profile={VIDUR}/compute/{gpu}/meta-llama/{model}/mlp.csv",
                               f"hardware={hardware}")
    assert len(out) > 1000  # one line per (tokens, TP) row
    assert median <= TARGET_MEDIAN and p95 <= TARGET_P95, out[-1]


def test_bad_arguments_exit_2_with_one_line(capsys):
    for args in (["hardware=h100"], ["profile=/nonexistent/mlp.csv", "hardware=h100"],
                 [f"profile={VIDUR}/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv", "hardware=h999"],
                 [f"profile={VIDUR}/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv", "hardware=h100",
                  "efficiency=nope"], ["profile"]):
        assert check.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err


def test_calibrate_writes_a_loadable_efficiency_file(tmp_path, capsys):
    from batchgen.latency.efficiency import Efficiency
    import yaml

    out = tmp_path / "eff.yaml"
    h100 = VIDUR / "compute" / "h100" / "meta-llama"
    assert calibrate_main.main([f"profile={h100}/Llama-2-7b-hf/mlp.csv",
                                f"collectives={VIDUR}/network/h100_dgx/send_recv.csv",
                                f"held_out={h100}/Llama-2-70b-hf/mlp.csv", "hardware=h100", f"out={out}"]) == 0
    text = out.read_text()
    assert text.startswith("# Fitted by: python -m batchgen.calibrate") and "check: median_abs_error=" in text
    eff = Efficiency.from_dict(yaml.safe_load(text))
    assert 0.5 < eff.compute <= 1 and eff.gemm_pad_rows == 0 and eff.source["held_out"] == ["Llama-2-70b-hf"]
    assert calibrate_main.main(["profile=/nonexistent.csv", "hardware=h100", f"out={out}"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
