"""Read Vidur's published operator profiles (microsoft/vidur, data/profiling) as calibration points.

Vidur times each operator of a transformer layer on a real GPU, per (num_tokens, tensor-parallel degree),
and the collectives by message size. They are the only GPU measurements a CPU-only machine can fit to, so
the importer accepts both Vidur's original CSVs and the reduced copies shipped in batchgen/data (same column
names, only the columns read here). Times are milliseconds there and seconds here; duplicated rows of one
(tokens, TP) or (size, workers, devices per node) are merged by their median.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")
MLP_KEYS = ("num_tokens", "num_tensor_parallel_workers")
COLLECTIVE_KEYS = ("size", "num_workers", "devices_per_node")
COLLECTIVES = ("all_reduce", "send_recv")

_MLP_FORMAT = ("a Vidur mlp.csv: one row per (num_tokens, num_tensor_parallel_workers) with the model shape in "
               f"columns {', '.join(SHAPE_COLUMNS)} and times in ms in columns time_stats.<op>.median for "
               f"op in {', '.join(GEMM_OPS)}")
_COLLECTIVE_FORMAT = ("a Vidur all_reduce.csv or send_recv.csv: one row per (size, num_workers, devices_per_node) "
                      "with the message size in bytes and the time in ms in column time_stats.<collective>.median")


@dataclass(frozen=True)
class GemmPoints:
    """Measured weight GEMMs, one entry per (op, tokens, TP): [m x k] @ [k x n] took `seconds` on one GPU."""

    op: np.ndarray  # str: one of GEMM_OPS
    m: np.ndarray
    k: np.ndarray
    n: np.ndarray
    tp: np.ndarray
    seconds: np.ndarray
    model: np.ndarray  # str: the profile's name (its folder), for held-out reports

    def __len__(self) -> int:
        return len(self.seconds)

    def select(self, mask) -> "GemmPoints":
        return GemmPoints(**{f: getattr(self, f)[mask] for f in self.__dataclass_fields__})

    @staticmethod
    def concat(parts) -> "GemmPoints":
        parts = list(parts)
        return GemmPoints(**{f: np.concatenate([getattr(p, f) for p in parts])
                             for f in GemmPoints.__dataclass_fields__})


@dataclass(frozen=True)
class CollectivePoints:
    """Measured collectives: `collective` over `bytes` among `workers` GPUs, `devices_per_node` per node."""

    collective: np.ndarray  # str: all_reduce or send_recv
    bytes: np.ndarray
    workers: np.ndarray
    devices_per_node: np.ndarray
    seconds: np.ndarray

    def __len__(self) -> int:
        return len(self.seconds)

    def select(self, mask) -> "CollectivePoints":
        return CollectivePoints(**{f: getattr(self, f)[mask] for f in self.__dataclass_fields__})

    @staticmethod
    def concat(parts) -> "CollectivePoints":
        parts = list(parts)
        return CollectivePoints(**{f: np.concatenate([getattr(p, f) for p in parts])
                                   for f in CollectivePoints.__dataclass_fields__})


def profile_name(path: str | Path) -> str:
    """The model a Vidur profile belongs to: its folder (compute/<gpu>/<org>/<model>/mlp.csv)."""
    return Path(path).parent.name or Path(path).stem


def gemm_shapes(shape: dict, tp: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(k, n) per op for a Vidur model shape, per GPU at tensor-parallel degree `tp` (Megatron sharding: QKV
    and gate/up split by columns, o_proj and down_proj by rows)."""
    embd, heads, kv_heads = shape["n_embd"], shape["n_head"], shape["n_kv_head"]
    head_dim = embd // heads
    up = (2 if shape["use_gated_mlp"] else 1) * shape["n_expanded_embd"]
    return {
        "attn_pre_proj": (np.full(tp.shape, float(embd)), (heads + 2 * kv_heads) * head_dim / tp),
        "attn_post_proj": (heads * head_dim / tp, np.full(tp.shape, float(embd))),
        "mlp_up_proj": (np.full(tp.shape, float(embd)), up / tp),
        "mlp_down_proj": (shape["n_expanded_embd"] / tp, np.full(tp.shape, float(embd))),
    }


def read_mlp_csv(path: str | Path) -> GemmPoints:
    """The four weight GEMMs of a Vidur mlp.csv (original or reduced) as GemmPoints, times in seconds."""
    header, rows = _read(path, _MLP_FORMAT)
    medians = [f"time_stats.{op}.median" for op in GEMM_OPS]
    _require_columns(path, header, (*SHAPE_COLUMNS, *MLP_KEYS, *medians), _MLP_FORMAT)
    shape = {}
    for col in SHAPE_COLUMNS:
        values = {r[col].strip() for r in rows}
        if len(values) != 1:
            raise ValueError(f"{path}: column {col} holds several values {sorted(values)[:4]}; expected one model "
                             f"shape per file ({_MLP_FORMAT})")
        value = values.pop()
        shape[col] = _parse_bool(path, col, value) if col == "use_gated_mlp" else _parse_int(path, col, value)
    keys = np.array([[_parse_int(path, c, r[c]) for c in MLP_KEYS] for r in rows], dtype=float)
    times = np.array([[_parse_float(path, c, r[c], i) for c in medians] for i, r in enumerate(rows)]) * 1e-3
    if np.any(keys <= 0):
        raise ValueError(f"{path}: num_tokens and num_tensor_parallel_workers must be positive ({_MLP_FORMAT})")
    uniq, times = _median_by_key(keys, times)
    m, tp = uniq[:, 0], uniq[:, 1]
    shapes = gemm_shapes(shape, tp)
    name = profile_name(path)
    parts = [GemmPoints(op=np.full(m.shape, op, dtype=object), m=m, k=shapes[op][0], n=shapes[op][1], tp=tp,
                        seconds=times[:, i], model=np.full(m.shape, name, dtype=object))
             for i, op in enumerate(GEMM_OPS)]
    return GemmPoints.concat(parts)


def read_collective_csv(path: str | Path) -> CollectivePoints:
    """A Vidur all_reduce.csv or send_recv.csv (original or reduced) as CollectivePoints, times in seconds."""
    header, rows = _read(path, _COLLECTIVE_FORMAT)
    found = [c for c in COLLECTIVES if f"time_stats.{c}.median" in header]
    if len(found) != 1:
        raise ValueError(f"{path}: expected exactly one of the columns "
                         f"{', '.join(f'time_stats.{c}.median' for c in COLLECTIVES)}, found {len(found)}; "
                         f"expected {_COLLECTIVE_FORMAT}")
    name = found[0]
    column = f"time_stats.{name}.median"
    _require_columns(path, header, (*COLLECTIVE_KEYS, column), _COLLECTIVE_FORMAT)
    keys = np.array([[_parse_int(path, c, r[c]) for c in COLLECTIVE_KEYS] for r in rows], dtype=float)
    times = np.array([[_parse_float(path, column, r[column], i)] for i, r in enumerate(rows)]) * 1e-3
    if np.any(keys <= 0):
        raise ValueError(f"{path}: size, num_workers and devices_per_node must be positive ({_COLLECTIVE_FORMAT})")
    uniq, times = _median_by_key(keys, times)
    return CollectivePoints(collective=np.full(len(uniq), name, dtype=object), bytes=uniq[:, 0],
                            workers=uniq[:, 1], devices_per_node=uniq[:, 2], seconds=times[:, 0])


def reduce_csv(src: str | Path, dst: str | Path) -> None:
    """Copy a Vidur CSV keeping only the columns the importer reads (Vidur's names, medians to 6 digits)."""
    header, rows = _read(src, "a Vidur mlp.csv, all_reduce.csv or send_recv.csv")
    if "num_tokens" in header:
        keep = [*SHAPE_COLUMNS, *MLP_KEYS, *(f"time_stats.{op}.median" for op in GEMM_OPS)]
        fmt = _MLP_FORMAT
    else:
        keep = [*COLLECTIVE_KEYS, *(f"time_stats.{c}.median" for c in COLLECTIVES
                                    if f"time_stats.{c}.median" in header)]
        fmt = _COLLECTIVE_FORMAT
    _require_columns(src, header, keep, fmt)
    with open(dst, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(keep)
        for r in rows:
            w.writerow([f"{float(r[c]):.6g}" if c.startswith("time_stats") else r[c] for c in keep])


# ---- parsing helpers ------------------------------------------------------------------------------------

def _read(path, fmt: str) -> tuple[list[str], list[dict]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; expected {fmt}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        rows = list(reader)
    if not header:
        raise ValueError(f"{path}: empty file; expected {fmt}")
    if not rows:
        raise ValueError(f"{path}: a header but no rows; expected {fmt}")
    return header, rows


def _require_columns(path, header, needed, fmt: str) -> None:
    missing = [c for c in needed if c not in header]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; expected {fmt}")


def _parse_int(path, col, value) -> int:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: column {col} holds {value!r}, not a number") from None
    if not f.is_integer():
        raise ValueError(f"{path}: column {col} holds {value!r}, not a whole number")
    return int(f)


def _parse_float(path, col, value, row) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: row {row + 2}, column {col} holds {value!r}, not a time in ms") from None
    if not (np.isfinite(f) and f > 0):
        raise ValueError(f"{path}: row {row + 2}, column {col} holds {value!r}; times must be positive ms")
    return f


def _parse_bool(path, col, value) -> bool:
    v = value.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0"):
        return False
    raise ValueError(f"{path}: column {col} holds {value!r}; expected True or False")


def _median_by_key(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique key rows (sorted) and the median of `values` rows sharing each key."""
    uniq, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    out = np.zeros((len(uniq), values.shape[1]))
    single = counts[inverse] == 1
    out[inverse[single]] = values[single]
    for i in np.flatnonzero(counts > 1):
        out[i] = np.median(values[inverse == i], axis=0)
    return uniq, out
