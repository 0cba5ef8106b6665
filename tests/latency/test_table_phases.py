"""The table's in-run ratios: decode and prefill attention each scaled by their own (they differ inside runs)."""
import pytest

from batchgen.latency.calibration_file import FORMAT
from batchgen.latency.roofline import Roofline
from batchgen.latency.table import TablePredictor
from batchgen.specs.catalog import load_hardware, load_model

MODEL, HW = load_model("tiny_moe"), load_hardware("cpu_epyc_milan_2c")


def calibration(scales: dict) -> dict:
    key = {"device": "cpu", "device_name": "test", "hardware": HW.name, "model": MODEL.to_dict(), "dtype": "float32",
           "threads": 1, "torch": "x", "python": "x", "batchgen": "x", "cuda": None}
    dec = [{"tokens": b, "context_sum": b * c, "max_context": c, "micro_batches": 1, "seconds": 1e-4 + 1e-8 * b * c}
           for b in (1, 4, 16) for c in (16, 64, 256)]
    pre = [{"tokens": n * l, "context_sq_sum": n * l * l, "max_context": l, "sequences": n, "micro_batches": 1,
            "seconds": 2e-4 + 1e-9 * n * l * l} for n in (1, 4) for l in (16, 64, 256)]
    return {"format": FORMAT, "key": key, "settings": {"page_tokens": 16},
            "modules": {"attention_decode": dec, "attention_prefill": pre}, "in_run": {"scales": scales}}


def test_decode_and_prefill_attention_have_their_own_in_run_ratio():
    plain = TablePredictor(calibration({}), Roofline(MODEL, HW))
    split = TablePredictor(calibration({"attention": 1.0, "attention_decode": 0.75, "attention_prefill": 1.25}),
                           Roofline(MODEL, HW))
    assert split.attention_decode(4, 4 * 64, 1, 64) == pytest.approx(0.75 * plain.attention_decode(4, 4 * 64, 1, 64))
    assert split.attention_prefill(256, 4 * 64 ** 2, 1, 64, 4) == pytest.approx(
        1.25 * plain.attention_prefill(256, 4 * 64 ** 2, 1, 64, 4))


def test_a_file_with_one_attention_ratio_scales_both():
    plain = TablePredictor(calibration({}), Roofline(MODEL, HW))
    one = TablePredictor(calibration({"attention": 0.5}), Roofline(MODEL, HW))
    assert one.attention_decode(4, 4 * 64, 1, 64) == pytest.approx(0.5 * plain.attention_decode(4, 4 * 64, 1, 64))
    assert one.attention_prefill(64, 64 ** 2, 1, 64, 1) == pytest.approx(0.5 * plain.attention_prefill(64, 64 ** 2, 1, 64, 1))
