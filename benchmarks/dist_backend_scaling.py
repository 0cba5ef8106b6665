"""End-to-end `backend=dist` on CPU: tokens/s of a whole job (engine, policy, attention, EP MoE, sampling) with
1 and 2 processes (gloo, one torch thread each), on the same prompts and weights.

    python benchmarks/dist_backend_scaling.py [--policy coroutine] [--sequences 32] [--input 64] [--output 32]
        [--hidden 256] [--inter 2048] [--layers 4] [--rounds 2]

The model is tiny_moe with wider experts (--inter), so that the experts' GEMMs dominate a step. Each process
gets the same KV budget (large enough that nothing is yielded), so the 2-process run has twice the KV and
the policy may batch differently: this is the system-level comparison (what a second GPU gives the job), not
the layer-level one of benchmarks/dist_scaling.py. Runs alternate (1, 2, 1, 2, ...) and the best of each is
kept (another load can only slow a run down). Per run: tokens/s (output tokens / BCT), tokens/s per process,
and each rank's busy / comm / idle seconds as it measured them. Report `uptime` with the result.
The last line reads `speedup_2procs=<r>`.

Recorded results (with the machine and the date): benchmarks/results/dist_scaling.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from batchgen.dist.run import DistSettings, execute_dist
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.specs.catalog import load_cluster, load_model
from batchgen.workload import Workload
from batchgen.results.metrics import bct


def job_for(args, procs: int) -> Job:
    model = dataclasses.replace(load_model("tiny_moe"), hidden_size=args.hidden, moe_intermediate_size=args.inter,
                                num_layers=args.layers)
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=procs, gpus_per_instance=None)
    rng = np.random.default_rng(0)
    inputs = rng.integers(args.input // 2, args.input + 1, args.sequences)
    outputs = rng.integers(args.output // 2, args.output + 1, args.sequences)
    return Job(model=model, cluster=cluster, workload=Workload("scaling", inputs, outputs),
               policy=make_policy({"name": args.policy}), page_tokens=16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="coroutine")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--input", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    best: dict[int, tuple] = {}
    for r in range(args.rounds):
        for procs in (1, 2):
            out = execute_dist(job_for(args, procs), DistSettings(device="cpu", procs=procs, kv_budget_mb=64,
                                                                  threads=1))
            tokens = int(out.prepared.state.table.output_len.sum())
            tps = tokens / bct(out)
            ranks = "; ".join(f"rank {i}: busy {b:.2f} comm {c:.2f} idle {d:.2f} s, cpu {u:.2f} s" for i, (b, c, d, u)
                              in enumerate(zip(out.rank_busy_s, out.rank_comm_s, out.rank_idle_s, out.rank_cpu_s)))
            print(f"round {r} procs={procs}: {tokens} tokens in {bct(out):.2f} s = {tps:.1f} tok/s "
                  f"({tps / procs:.1f} per process); {ranks}; load {os.getloadavg()[0]:.2f}", flush=True)
            if procs not in best or tps > best[procs][0]:
                best[procs] = (tps, bct(out))
    for procs, (tps, b) in sorted(best.items()):
        print(f"best procs={procs}: {tps:.1f} tok/s ({tps / procs:.1f} per process), BCT {b:.2f} s")
    print(f"speedup_2procs={best[2][0] / best[1][0]:.2f}")


if __name__ == "__main__":
    main()
