"""Vidur's CSVs as calibration points: shapes per op, both the original and the reduced columns, and errors."""
import numpy as np
import pytest

from batchgen.calibrate.vidur import GEMM_OPS, read_collective_csv, read_mlp_csv, reduce_csv

STATS = ("min", "max", "mean", "median", "std")
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
SHAPE = {"n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_expanded_embd": 14336, "vocab_size": 128256,
         "use_gated_mlp": "True"}


def write_full_mlp(path, rows=((8, 1, 1.0), (8, 1, 3.0), (8, 2, 2.0), (512, 4, 4.0))):
    """A Vidur mlp.csv in the original layout: every op x stat column, shape columns, keys last."""
    header = [f"time_stats.{op}.{s}" for op in OPS for s in STATS] + list(SHAPE) + ["num_tokens",
                                                                                   "num_tensor_parallel_workers"]
    lines = [",".join(header)]
    for tokens, tp, ms in rows:
        stats = [str(ms) if s == "median" else "9.9" for op in OPS for s in STATS]
        lines.append(",".join(stats + [str(v) for v in SHAPE.values()] + [str(tokens), str(tp)]))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_full_mlp_csv_shapes_and_medians(tmp_path):
    p = read_mlp_csv(write_full_mlp(tmp_path / "mlp.csv"))
    assert len(p) == 3 * len(GEMM_OPS)  # (8, 1) twice -> one point per op
    got = {(op, m, tp): (k, n, s) for op, m, tp, k, n, s in zip(p.op, p.m, p.tp, p.k, p.n, p.seconds)}
    # head_dim 128: QKV = (32 + 2 * 8) * 128 = 6144 columns, gated MLP up = 2 * 14336
    assert got[("attn_pre_proj", 8, 1)] == (4096, 6144, pytest.approx(2e-3))  # median of 1 ms and 3 ms
    assert got[("attn_pre_proj", 8, 2)][:2] == (4096, 3072)
    assert got[("attn_post_proj", 512, 4)][:2] == (1024, 4096)
    assert got[("mlp_up_proj", 8, 2)][:2] == (4096, 14336)
    assert got[("mlp_down_proj", 512, 4)][:2] == (3584, 4096)
    assert set(p.model) == {tmp_path.name}


def test_reduced_csv_reads_the_same(tmp_path):
    full = write_full_mlp(tmp_path / "full.csv")
    reduce_csv(full, tmp_path / "reduced.csv")
    header = (tmp_path / "reduced.csv").read_text().splitlines()[0].split(",")
    assert "vocab_size" not in header and "time_stats.emb.median" not in header
    a, b = read_mlp_csv(full), read_mlp_csv(tmp_path / "reduced.csv")
    for field in ("m", "k", "n", "tp", "seconds"):
        np.testing.assert_allclose(getattr(a, field), getattr(b, field))


def test_collective_csv(tmp_path):
    f = tmp_path / "all_reduce.csv"
    f.write_text(",time_stats.all_reduce.median,rank,num_workers,size,collective,devices_per_node\n"
                 "0,0.05,0,2,2048,all_reduce,2\n1,0.07,0,2,2048,all_reduce,2\n2,0.5,0,8,1048576,all_reduce,8\n")
    c = read_collective_csv(f)
    assert list(c.bytes) == [2048, 1048576] and list(c.workers) == [2, 8]
    np.testing.assert_allclose(c.seconds, [6e-5, 5e-4])
    assert set(c.collective) == {"all_reduce"}


@pytest.mark.parametrize("text, match", [
    ("", "empty file"),
    ("a,b\n1,2\n", "missing column"),
    ("n_head,n_kv_head,n_embd,n_expanded_embd,use_gated_mlp,num_tokens,num_tensor_parallel_workers,"
     "time_stats.attn_pre_proj.median,time_stats.attn_post_proj.median,time_stats.mlp_up_proj.median,"
     "time_stats.mlp_down_proj.median\n32,8,4096,14336,True,8,1,abc,1,1,1\n", "not a time in ms"),
    ("n_head,n_kv_head,n_embd,n_expanded_embd,use_gated_mlp,num_tokens,num_tensor_parallel_workers,"
     "time_stats.attn_pre_proj.median,time_stats.attn_post_proj.median,time_stats.mlp_up_proj.median,"
     "time_stats.mlp_down_proj.median\n32,8,4096,14336,True,8,1,1,1,1,1\n64,8,4096,14336,True,8,2,1,1,1,1\n",
     "one model shape per file"),
])
def test_malformed_mlp_csv(tmp_path, text, match):
    f = tmp_path / "mlp.csv"
    f.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        read_mlp_csv(f)
    assert "expected" in str(e.value) or "not a" in str(e.value)


def test_missing_column_names_what_is_expected(tmp_path):
    f = write_full_mlp(tmp_path / "mlp.csv")
    f.write_text(f.read_text().replace("time_stats.mlp_down_proj.median", "time_stats.mlp_down.median"))
    with pytest.raises(ValueError, match=r"missing column\(s\) time_stats.mlp_down_proj.median; expected a Vidur"):
        read_mlp_csv(f)


def test_not_a_collective_csv(tmp_path):
    with pytest.raises(ValueError, match="expected exactly one of the columns"):
        read_collective_csv(write_full_mlp(tmp_path / "mlp.csv"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_collective_csv(tmp_path / "absent.csv")
