"""The attention profile Vidur needs for `benchmarks/sim_scale.py --policies --vidur-dir DIR`, written from a formula.

Why. Vidur's Llama-2-7B A100 attention profile (data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv)
is a Git LFS object, and stored copies of the repository hold only its pointer. Vidur's random forests train on
whatever times the file gives and its event loop looks their predictions up in a table, so the loop's cost (what
sim_scale compares) does not depend on them; its simulated end does. The times here, per layer, in ms:

    prefill  0.012 + 4 chunk (kv + chunk / 2) 4096 / 200 TFLOP/s
    decode   0.010 + batch kv 2 4096 x 2 bytes / 1.5 TB/s
    KV save  0.005 + tokens 2 4096 x 2 bytes / 1.5 TB/s   (tokens: the chunk, or the batch)

on a grid coarse enough for the forests' grid search to train in minutes on one core (Vidur's own profiling grid
has about 11K rows; a first try with it was on course for an hour or more per forest and was stopped): prefill
chunks 16-4,096 over KV 0, 256, ... (chunk + KV within 4,096), decode batches 1-128 over KV 16-4,096. The columns are those Vidur's attention profiler writes
(vidur/profiling/attention), prefill rows leaving the decode times empty and decode rows the prefill ones.

    python benchmarks/vidur_standin.py DIR   # DIR: the Vidur checkout; then delete DIR/cache/attn_* if it exists

Vidur caches its predictions under a key of the estimator's settings, not of the training data: after the file
changes, its old attention predictions would be reused unless cache/attn_* goes.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

PROFILE = Path("data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv")
MAX_TOKENS, HIDDEN, HEADS, BLOCK = 4096, 4096, 32, 16
CHUNKS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128)
DECODE_KV = (16, 64, 128, *range(256, MAX_TOKENS + 1, 256))
TIMES = ("attn_kv_cache_save", "attn_prefill", "attn_decode")
STATS = ("min", "max", "mean", "median", "std")
COLUMNS = ([f"time_stats.{t}.{s}" for t in TIMES for s in STATS]
           + ["n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers", "max_model_len",
              "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill", "attention_backend"])


def prefill_ms(chunk: int, kv: int) -> float:
    return 0.012 + 4 * chunk * (kv + chunk / 2) * HIDDEN / 200e12 * 1e3


def decode_ms(batch: int, kv: int) -> float:
    return 0.010 + batch * kv * 2 * HIDDEN * 2 / 1.5e12 * 1e3


def kv_save_ms(tokens: int) -> float:
    return 0.005 + tokens * 2 * HIDDEN * 2 / 1.5e12 * 1e3


def grid() -> list[tuple[int, int, int, bool]]:
    """(chunk, kv, batch, is_prefill) of every row, sorted."""
    rows = {(c, kv, 1, True) for c in CHUNKS for kv in range(0, MAX_TOKENS - c + 1, 256)}
    rows |= {(0, kv, b, False) for kv in DECODE_KV for b in BATCHES}
    return sorted(rows)


def _times(name: str, ms: float | None) -> dict[str, object]:
    """One measured time as the profiler reports it (every statistic the one value, no spread); empty if none."""
    return {f"time_stats.{name}.{s}": ("" if ms is None else 0.0 if s == "std" else ms) for s in STATS}


def write(vidur_dir: str | Path) -> Path:
    """Write the stand-in into the checkout (over the LFS pointer); returns its path."""
    path = Path(vidur_dir) / PROFILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS)
        out.writeheader()
        for chunk, kv, batch, prefill in grid():
            out.writerow({**_times("attn_kv_cache_save", kv_save_ms(chunk if prefill else batch)),
                          **_times("attn_prefill", prefill_ms(chunk, kv) if prefill else None),
                          **_times("attn_decode", None if prefill else decode_ms(batch, kv)),
                          "n_embd": HIDDEN, "n_q_head": HEADS, "n_kv_head": HEADS, "block_size": BLOCK,
                          "num_tensor_parallel_workers": 1, "max_model_len": MAX_TOKENS, "batch_size": batch,
                          "prefill_chunk_size": chunk, "kv_cache_size": kv, "is_prefill": prefill,
                          "attention_backend": "FLASHINFER"})
    return path


def is_lfs_pointer(path: Path) -> bool:
    """A file Git LFS left as its pointer (the object itself was never fetched)."""
    with open(path, "rb") as f:
        return f.read(40).startswith(b"version https://git-lfs")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} VIDUR_DIR")
    written = write(sys.argv[1])
    print(f"wrote {len(grid())} rows to {written}")
