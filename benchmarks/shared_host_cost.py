"""What shared host copies (`backend.shared_host_copies`, batchgen/dist/shared_host.py) cost a run that loses
nothing.

    python benchmarks/shared_host_cost.py [--rounds 3] [--sequences 32] [--kv-mb 0.5] [--sizes 16x512,256x2048,...]

1. Per boundary: `SharedHostFiles.publish` over a cache holding S host copies of T tokens each (--sizes SxT,...),
   when nothing changed (the entry list built and compared: what most boundaries pay) and when it changed (the
   JSON index written and renamed as well); microseconds per call, median of many.
2. End to end: `backend=dist`, 2 processes (gloo, one thread each), tiny_moe with wider experts, a KV budget
   small enough that sequences yield to host, run alternately with shared host copies on and off (same job,
   same process); best BCT of each (another load can only slow a run down) and the yields both made.
Report `uptime` with the result. The last line reads `shared_over_anonymous=<BCT ratio>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from batchgen.dist.run import DistSettings, execute_dist
from batchgen.dist.shared_host import SHM_DIR, SharedHostFiles
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.results.metrics import bct
from batchgen.specs.catalog import load_cluster, load_model
from batchgen.workload import Workload


def publish_cost(seqs: int, tokens: int, page: int = 16, calls: int = 200) -> tuple[float, float, int]:
    """(us per unchanged publish, us per changed publish, index bytes) for `seqs` host copies of `tokens`."""
    with tempfile.TemporaryDirectory(dir=SHM_DIR) as root:
        files = SharedHostFiles("bench", 0, root=root)
        pages = seqs * -(-tokens // page)
        cache = PagedKVCache(1, 1, 1, page_size=page, num_pages=pages, host_pages=pages, host_alloc=files.alloc)
        for sid in range(seqs):
            cache.prepare([sid], [tokens], [0])
        cache.yield_to_host(list(range(seqs)))
        files.publish(cache)
        same, changed = [], []
        for i in range(calls):
            t0 = time.perf_counter()
            files.publish(cache)
            same.append(time.perf_counter() - t0)
            files._published = None  # as after a boundary that changed a copy
            t0 = time.perf_counter()
            files.publish(cache)
            changed.append(time.perf_counter() - t0)
        size = os.path.getsize(files.index)
        files.close()
    return statistics.median(same) * 1e6, statistics.median(changed) * 1e6, size


def job_for(args) -> Job:
    model = dataclasses.replace(load_model("tiny_moe"), hidden_size=256, moe_intermediate_size=1024, num_layers=4)
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=2, gpus_per_instance=None)
    rng = np.random.default_rng(0)
    inputs = rng.integers(32, 65, args.sequences)
    outputs = rng.integers(16, 33, args.sequences)
    return Job(model=model, cluster=cluster, workload=Workload("shm", inputs, outputs),
               policy=make_policy({"name": "coroutine", "b_moe": 8}), page_tokens=16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--kv-mb", type=float, default=0.5)
    p.add_argument("--sizes", default="16x512,256x2048,2048x2048")
    args = p.parse_args()
    torch.set_num_threads(1)
    for size in args.sizes.split(","):
        seqs, tokens = map(int, size.split("x"))
        same, changed, nbytes = publish_cost(seqs, tokens, calls=50)
        print(f"publish, {seqs} host copies of {tokens} tokens: unchanged {same:.0f} us, changed {changed:.0f} us "
              f"(index {nbytes} bytes)")
    best: dict[bool, float] = {}
    for _ in range(args.rounds):
        for shared in (True, False):
            out = execute_dist(job_for(args), DistSettings(device="cpu", procs=2, kv_budget_mb=args.kv_mb, threads=1,
                                                           shared_host_copies=shared))
            t = bct(out)
            best[shared] = min(best.get(shared, float("inf")), t)
            print(f"shared_host_copies={str(shared).lower():5} BCT {t:.3f} s  yields {out.kv_moves.get('yield', 0)} "
                  f"restores {out.kv_moves.get('restore', 0)}")
    print(f"best BCT: shared {best[True]:.3f} s, anonymous {best[False]:.3f} s")
    print(f"shared_over_anonymous={best[True] / best[False]:.3f}")


if __name__ == "__main__":
    main()
