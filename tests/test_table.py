"""The table predictor (measured points interpolated) and the per-module fit (roofline factors recovered)."""
import copy
import json

import numpy as np
import pytest

from batchgen.latency.calibration_file import FORMAT, CalibrationError, read, validate, write
from batchgen.calibrate.modules import fit_calibration, fit_calibration_file
from batchgen.latency.efficiency import Efficiency
from batchgen.latency.roofline import Roofline
from batchgen.latency.table import TablePredictor
from batchgen.specs.catalog import load_hardware, load_model

MODEL = load_model("tiny_moe")
HW = load_hardware("cpu_epyc_milan_2c")
PAGE = 16


def _key(model=MODEL):
    return {"device": "cpu", "device_name": "test", "hardware": HW.name, "model": model.to_dict(),
            "dtype": "float32", "threads": 1, "torch": "x", "python": "x", "batchgen": "x", "cuda": None}


def _padded(n):
    return -(-n // PAGE) * PAGE


def linear_calibration():
    """Seconds exactly linear in each module's coordinates (what interpolation must reproduce and continue)."""
    dec = [{"tokens": b, "context_sum": b * c, "max_context": c, "micro_batches": 1,
            "seconds": 1e-4 + 2e-6 * b + 3e-8 * b * _padded(c)} for b in (1, 4, 16, 64) for c in (16, 64, 256)]
    pre = [{"tokens": n * l, "context_sq_sum": n * l * l, "max_context": l, "sequences": n, "micro_batches": 1,
            "seconds": 2e-4 + 1e-6 * n * l + 1e-9 * n * l * _padded(l)} for n in (1, 4) for l in (16, 64, 256)]
    tok = lambda a, b: [{"tokens": t, "seconds": a + b * t} for t in (1, 8, 64, 512)]  # noqa: E731
    return {"format": FORMAT, "key": _key(), "settings": {"page_tokens": PAGE},
            "modules": {"attention_decode": dec, "attention_prefill": pre, "router": tok(1e-4, 1e-7),
                        "experts": [{"total_tokens": t, "seconds": 5e-4 + 4e-5 * t} for t in (1, 8, 64, 512)],
                        "lm_head": tok(3e-4, 2e-6), "step": [{"sequences": s, "seconds": 1e-3 + 2e-5 * s}
                                                          for s in (1, 4, 16, 64)],
                        "h2d": [{"bytes": n, "seconds": 1e-6 + n / 4e9} for n in (1 << 12, 1 << 20, 1 << 24)]}}


@pytest.fixture
def table():
    return TablePredictor(linear_calibration(), Roofline(MODEL, HW))


def test_table_reproduces_points_and_interpolates(table):
    for p in linear_calibration()["modules"]["attention_decode"]:
        got = table.attention_decode(p["tokens"], p["context_sum"], 1, p["max_context"])
        assert got == pytest.approx(p["seconds"], rel=1e-9)
    # between grid points: the linear truth, contexts rounded up to whole pages as the executor pads them
    b, c = np.array([10, 40]), np.array([100, 200])
    want = 1e-4 + 2e-6 * b + 3e-8 * b * _padded(c)
    np.testing.assert_allclose(table.attention_decode(b, b * c // 2, 1, c), want, rtol=1e-9)
    assert table.attention_prefill(2 * 100, 2 * 100 ** 2, 1, 100, 2) == pytest.approx(
        2e-4 + 1e-6 * 200 + 1e-9 * 2 * 100 * 112, rel=1e-9)
    assert table.router(100) == pytest.approx(1e-4 + 1e-5, rel=1e-9)
    worst, mean = table.experts(np.array([0, 100]))
    np.testing.assert_allclose(worst, [0.0, 5e-4 + 4e-3], rtol=1e-9)
    assert table.step_overhead(10) == pytest.approx(1e-3 + 2e-4, rel=1e-9)


def test_table_extrapolates_linearly_never_negative_and_splits_micro_batches(table):
    assert table.router(1024) == pytest.approx(1e-4 + 1024e-7, rel=1e-9)      # past the last point
    assert table.experts(0.5)[0] >= 0 and table.router(0) == 0.0
    far = table.attention_decode(np.array([128, 256]), 0, 1, np.array([512, 2048]))
    assert np.all(far > table.attention_decode(64, 64 * 256, 1, 256))
    two = table.attention_decode(32, 32 * 64, 2, 64)
    assert two == pytest.approx(2 * table.attention_decode(16, 16 * 64, 1, 64), rel=1e-9)
    assert table.h2d(2 << 20, copies=2) == pytest.approx(2 * table.h2d(1 << 20), rel=1e-9)
    grid = table.attention_decode(np.full((8, 1000), 17), np.full((8, 1000), 17 * 90), 1, np.full((8, 1000), 90))
    assert grid.shape == (8, 1000) and np.all(grid > 0)


def test_table_delegates_the_rest_and_refuses_another_model(table):
    roof = Roofline(MODEL, HW)
    assert table.all_to_all(64) == roof.all_to_all(64)
    assert table.shared_experts(64) == roof.shared_experts(64)  # not measured (tiny_moe has none)
    assert table.ep_ranks == 1 and table.model is MODEL
    with pytest.raises(CalibrationError, match="small_moe"):
        TablePredictor(linear_calibration(), Roofline(load_model("small_moe"), HW))


def test_malformed_files_error_clearly(tmp_path):
    good = linear_calibration()
    bad = copy.deepcopy(good)
    bad["modules"]["attention_decode"][0].pop("max_context")
    with pytest.raises(CalibrationError, match=r"attention_decode\[0\].*max_context"):
        validate(bad)
    bad = copy.deepcopy(good)
    bad["modules"]["warp_drive"] = []
    with pytest.raises(CalibrationError, match="unknown module 'warp_drive'"):
        validate(bad)
    bad = copy.deepcopy(good)
    bad["format"] = "other/2"
    with pytest.raises(CalibrationError, match="format"):
        validate(bad)
    bad = copy.deepcopy(good)
    bad["modules"]["router"][1]["seconds"] = -1
    with pytest.raises(CalibrationError, match=r"router\[1\]: seconds"):
        validate(bad)
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="not JSON"):
        read(path)
    with pytest.raises(CalibrationError, match="cannot read"):
        read(tmp_path / "missing.json")
    write(good, tmp_path / "ok.json")
    assert read(tmp_path / "ok.json")["modules"] == json.loads(json.dumps(good["modules"]))


def synthetic_from_roofline(eff: Efficiency):
    """A calibration file whose seconds are the roofline's at known factors."""
    roof = Roofline(MODEL, HW, eff, ep_ranks=1, gpus_per_node=1)
    dec = [{"tokens": b, "context_sum": b * c * 3 // 4, "max_context": c, "micro_batches": mb,
            "seconds": float(roof.attention_decode(b, b * c * 3 // 4, mb, c))}
           for b in (1, 8, 64, 256) for c in (64, 512, 4096) for mb in (1, 2)]
    experts = [{"total_tokens": t, "seconds": float(roof.experts(t)[0])} for t in (1, 4, 16, 64, 256, 1024, 8192)]
    step = [{"sequences": s, "seconds": float(roof.step_overhead(s))} for s in (1, 4, 16, 64)]
    return {"format": FORMAT, "key": _key(), "settings": {},
            "modules": {"attention_decode": dec, "experts": experts, "step": step}}


def test_fit_recovers_known_constants(tmp_path):
    truth = Efficiency(gemm_pad_rows=0.0, attention_padding=1.0, step_s=8e-4, step_per_sequence_s=2e-5,
                       modules={"attention_decode": {"compute": 0.2, "memory": 0.05, "kernel_s": 3e-4},
                                "experts": {"compute": 0.4, "memory": 0.3, "kernel_s": 1e-4}})
    path = write(synthetic_from_roofline(truth), tmp_path / "synthetic.json")
    got = fit_calibration_file(path, HW)
    assert got["attention_padding"] == 1.0
    assert got["step_s"] == pytest.approx(8e-4, rel=1e-3)
    assert got["step_per_sequence_s"] == pytest.approx(2e-5, rel=1e-3)
    for module, factors in truth.modules.items():
        for name, value in factors.items():
            assert got["modules"][module][name] == pytest.approx(value, rel=0.02), (module, name)
        assert got["source"]["residuals"][module]["max_abs_pct"] < 1.0
    Efficiency.from_dict(got)  # loads as an efficiency file


def test_fit_refuses_a_file_without_compute_modules():
    data = synthetic_from_roofline(Efficiency())
    data["modules"] = {"step": data["modules"]["step"]}
    with pytest.raises(ValueError, match="no compute module"):
        fit_calibration(data, HW)


def test_in_run_ratios_scale_the_measured_modules_and_survive_the_file(tmp_path):
    """The profile's in-run stage stores measured-in-run / predicted-from-grid per module kind; the table
    applies them to measured curves only (the fallback roofline has its own factors)."""
    plain = TablePredictor(linear_calibration(), Roofline(MODEL, HW))
    cal = linear_calibration()
    cal["in_run"] = {"scales": {"attention": 1.5, "ffn": 2.0, "head": 3.0, "step": 4.0}}
    path = write(cal, tmp_path / "cal.json")
    scaled = TablePredictor.from_file(path, Roofline(MODEL, HW))
    assert scaled.attention_decode(16, 16 * 64, 1, 64) == pytest.approx(1.5 * plain.attention_decode(16, 16 * 64, 1, 64))
    assert scaled.attention_prefill(256, 4 * 64 ** 2, 1, 64, 4) == pytest.approx(
        1.5 * plain.attention_prefill(256, 4 * 64 ** 2, 1, 64, 4))
    assert scaled.router(64) == pytest.approx(2.0 * plain.router(64))
    assert scaled.experts(64)[0] == pytest.approx(2.0 * plain.experts(64)[0])
    assert scaled.lm_head(8) == pytest.approx(3.0 * plain.lm_head(8))
    assert scaled.step_overhead(16) == pytest.approx(4.0 * plain.step_overhead(16))
    assert scaled.dense_ffn(64) == plain.dense_ffn(64)  # not measured: the roofline, unscaled
    assert scaled.key() != plain.key()
    cal["in_run"] = {"scales": {"attention": -1}}
    with pytest.raises(CalibrationError, match="in_run.scales"):
        validate(cal)


def test_the_ffn_ratio_follows_the_call_size_between_its_phases(tmp_path):
    """Decode and prefill FFN ratios sit at their phases' tokens per forward; a call between them gets the ratio
    interpolated in log size, beyond them the nearer one; a file without the sizes keeps the one FFN ratio."""
    plain = TablePredictor(linear_calibration(), Roofline(MODEL, HW))
    cal = linear_calibration()
    cal["in_run"] = {"scales": {"ffn": 1.0, "ffn_decode": 1.5, "ffn_prefill": 0.5},
                     "tokens_per_forward": {"ffn_decode": 8, "ffn_prefill": 512}}
    sized = TablePredictor.from_file(write(cal, tmp_path / "sized.json"), Roofline(MODEL, HW))
    for tokens, ratio in ((1, 1.5), (8, 1.5), (64, 1.0), (512, 0.5), (4096, 0.5)):  # 64: halfway in log size
        assert sized.experts(tokens)[0] == pytest.approx(ratio * plain.experts(tokens)[0])
        assert sized.router(tokens) == pytest.approx(ratio * plain.router(tokens))
    assert sized.lm_head(8) == plain.lm_head(8)  # the head keeps its own (here none)
    del cal["in_run"]["tokens_per_forward"]
    one = TablePredictor.from_file(write(cal, tmp_path / "one.json"), Roofline(MODEL, HW))
    assert one.experts(8)[0] == pytest.approx(plain.experts(8)[0]) and one.key() != sized.key()
    cal["in_run"]["tokens_per_forward"] = {"ffn_decode": 0}
    with pytest.raises(CalibrationError, match="tokens_per_forward"):
        validate(cal)


def test_ratios_by_call_size_scale_each_call_at_its_size(tmp_path):
    """in_run.by_size: decode attention (by sequences per call), the FFN (tokens) and the LM head (rows) each take
    the ratio interpolated in log size at the call's size, the nearer end's beyond the ends; prefill attention and
    the step keep their one ratios; sizes that do not ascend are refused."""
    plain = TablePredictor(linear_calibration(), Roofline(MODEL, HW))
    cal = linear_calibration()
    cal["in_run"] = {"scales": {"attention_decode": 9.0, "attention_prefill": 1.5, "ffn": 9.0, "head": 9.0,
                                "step": 2.0, "ffn_decode": 9.0, "ffn_prefill": 9.0},
                     "tokens_per_forward": {"ffn_decode": 8, "ffn_prefill": 512},
                     "by_size": {"attention_decode": [[2, 0.5], [32, 1.0]], "ffn": [[2, 0.6], [8, 0.8], [512, 1.2]],
                                 "head": [[4, 0.7], [16, 1.1]]}}
    by = TablePredictor.from_file(write(cal, tmp_path / "by.json"), Roofline(MODEL, HW))
    for b, ratio in ((1, 0.5), (2, 0.5), (8, 0.75), (32, 1.0), (64, 1.0)):  # 8: halfway between 2 and 32 in log
        assert by.attention_decode(b, b * 64, 1, 64) == pytest.approx(ratio * plain.attention_decode(b, b * 64, 1, 64))
    # two micro-batches of 8: each call's size is 8
    assert by.attention_decode(16, 16 * 64, 2, 64) == pytest.approx(0.75 * plain.attention_decode(16, 16 * 64, 2, 64))
    for t, ratio in ((1, 0.6), (4, 0.7), (8, 0.8), (64, 1.0), (4096, 1.2)):
        assert by.experts(t)[0] == pytest.approx(ratio * plain.experts(t)[0])
    for rows, ratio in ((1, 0.7), (8, 0.9), (64, 1.1)):
        assert by.lm_head(rows) == pytest.approx(ratio * plain.lm_head(rows))
    assert by.attention_prefill(256, 4 * 64 ** 2, 1, 64, 4) == pytest.approx(
        1.5 * plain.attention_prefill(256, 4 * 64 ** 2, 1, 64, 4))
    assert by.step_overhead(16) == pytest.approx(2.0 * plain.step_overhead(16))
    del cal["in_run"]["by_size"]
    assert TablePredictor.from_file(write(cal, tmp_path / "no.json"), Roofline(MODEL, HW)).key() != by.key()
    cal["in_run"]["by_size"] = {"ffn": [[8, 0.8], [2, 0.6]]}
    with pytest.raises(CalibrationError, match="by_size"):
        validate(cal)
