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

    python benchmarks/dist_backend_scaling.py --overlap [--b-attn 4] [--rounds 3]

compares instead two processes with coroutine's `comm_overlap` off and on (KV on the device, attention
micro-batches of --b-attn sequences, so that each rank has several to overlap), alternating; the last line reads
`overlap_on_over_off=<r>` (best tokens/s with it over best without).

    python benchmarks/dist_backend_scaling.py --dp-prefill [--input 512] [--output 8] [--rounds 3]

compares two processes with coroutine's prefill expert parallel and data parallel (`policy.prefill_parallel`:
each process through every expert, the ones it lacks copied from its host copy), alternating; each run also
prints its seconds in prefill-only forwards, and the last line reads `dp_over_ep=<r>` (best tokens/s).

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


def job_for(args, procs: int, knobs: dict | None = None) -> Job:
    model = dataclasses.replace(load_model("tiny_moe"), hidden_size=args.hidden, moe_intermediate_size=args.inter,
                                num_layers=args.layers)
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=procs, gpus_per_instance=None)
    rng = np.random.default_rng(0)
    inputs = rng.integers(args.input // 2, args.input + 1, args.sequences)
    outputs = rng.integers(args.output // 2, args.output + 1, args.sequences)
    return Job(model=model, cluster=cluster, workload=Workload("scaling", inputs, outputs),
               policy=make_policy({"name": args.policy, **(knobs or {})}), page_tokens=16)


def run(job: Job, procs: int, label: str, r: int) -> float:
    """One run: its line, and its tokens per second."""
    out = execute_dist(job, DistSettings(device="cpu", procs=procs, kv_budget_mb=64, threads=1))
    tokens = int(out.prepared.state.table.output_len.sum())
    tps = tokens / bct(out)
    ranks = "; ".join(f"rank {i}: busy {b:.2f} comm {c:.2f} idle {d:.2f} s, cpu {u:.2f} s" for i, (b, c, d, u)
                      in enumerate(zip(out.rank_busy_s, out.rank_comm_s, out.rank_idle_s, out.rank_cpu_s)))
    prefill = sum(rec.duration for rec in out.records if rec.phase == "prefill")
    print(f"round {r} {label}: {tokens} tokens in {bct(out):.2f} s = {tps:.1f} tok/s ({tps / procs:.1f} per "
          f"process), {prefill:.2f} s in prefill-only forwards; {ranks}; load {os.getloadavg()[0]:.2f}", flush=True)
    return tps


def two_processes_ab(args, knobs: dict, knob: str, values: tuple) -> dict:
    """Two processes with the policy's `knob` at each of `values` (and `knobs`), alternating for --rounds
    rounds; the best tokens/s of each value."""
    best = dict.fromkeys(values, 0.0)
    for r in range(args.rounds):
        for v in (values if r % 2 == 0 else values[::-1]):
            label = f"procs=2 {knob}={str(v).lower()}"
            best[v] = max(best[v], run(job_for(args, 2, {**knobs, knob: v}), 2, label, r))
    print("best: " + ", ".join(f"{knob}={str(v).lower()} {tps:.1f} tok/s" for v, tps in best.items()))
    return best


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
    p.add_argument("--overlap", action="store_true", help="comm_overlap off against on, two processes")
    p.add_argument("--b-attn", type=int, default=4, help="with --overlap: attention micro-batch, in sequences")
    p.add_argument("--dp-prefill", action="store_true", help="prefill expert parallel against data parallel")
    args = p.parse_args()
    if args.overlap:
        best = two_processes_ab(args, {"kv_residency": "device", "b_attn": args.b_attn}, "comm_overlap",
                                (False, True))
        print(f"overlap_on_over_off={best[True] / best[False]:.3f}")
        return
    if args.dp_prefill:
        best = two_processes_ab(args, {}, "prefill_parallel", ("ep", "dp"))
        print(f"dp_over_ep={best['dp'] / best['ep']:.3f}")
        return
    best: dict[int, float] = {}
    for r in range(args.rounds):
        for procs in (1, 2):
            best[procs] = max(best.get(procs, 0.0), run(job_for(args, procs), procs, f"procs={procs}", r))
    for procs, tps in sorted(best.items()):
        print(f"best procs={procs}: {tps:.1f} tok/s ({tps / procs:.1f} per process)")
    print(f"speedup_2procs={best[2] / best[1]:.2f}")


if __name__ == "__main__":
    main()
