"""The Vidur side of benchmarks/sim_scale.py: the attention stand-in it writes and the checkout it refuses."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vidur_run  # noqa: E402
import vidur_standin  # noqa: E402


def fake_checkout(root: Path) -> Path:
    (root / "vidur").mkdir(parents=True)
    (root / "vidur" / "simulator.py").write_text("")
    profile = root / vidur_standin.PROFILE
    profile.parent.mkdir(parents=True)
    profile.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    return profile


def test_the_stand_in_has_the_profilers_columns_and_the_formulas_times(tmp_path):
    rows = list(csv.DictReader(open(vidur_standin.write(tmp_path))))
    assert len(rows) == len(vidur_standin.grid()) and list(rows[0]) == vidur_standin.COLUMNS
    prefill = [r for r in rows if r["is_prefill"] == "True"]
    decode = [r for r in rows if r["is_prefill"] == "False"]
    assert prefill and decode and len(prefill) + len(decode) == len(rows)
    assert all(int(r["prefill_chunk_size"]) + int(r["kv_cache_size"]) <= 4096 for r in prefill)
    r = next(r for r in prefill if r["prefill_chunk_size"] == "512" and r["kv_cache_size"] == "1024")
    assert float(r["time_stats.attn_prefill.median"]) == pytest.approx(0.012 + 4 * 512 * 1280 * 4096 / 200e12 * 1e3)
    assert r["time_stats.attn_decode.median"] == ""  # a prefill row measures no decode
    r = next(r for r in decode if r["batch_size"] == "64" and r["kv_cache_size"] == "2048")
    assert float(r["time_stats.attn_decode.median"]) == pytest.approx(0.010 + 64 * 2048 * 4 * 4096 / 1.5e12 * 1e3)
    assert float(r["time_stats.attn_kv_cache_save.median"]) == pytest.approx(0.005 + 64 * 4 * 4096 / 1.5e12 * 1e3)


def test_a_checkout_whose_attention_profile_is_an_lfs_pointer_is_refused_until_the_stand_in_is_written(tmp_path):
    assert "not a Vidur checkout" in vidur_run.checkout_problem(tmp_path)
    profile = fake_checkout(tmp_path)
    problem = vidur_run.checkout_problem(tmp_path)
    assert "Git LFS pointer" in problem and "vidur_standin.py" in problem
    assert vidur_standin.write(tmp_path) == profile
    assert not vidur_standin.is_lfs_pointer(profile) and vidur_run.checkout_problem(tmp_path) is None
