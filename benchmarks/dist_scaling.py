"""Expert-parallel scaling on CPU: tokens/s of a stack of MoE layers with 1 and 2 processes (gloo, one torch
thread per process), the same tokens and weights in both.

    python benchmarks/dist_scaling.py [--experts 8] [--hidden 768] [--inter 2048] [--layers 4] [--top-k 2]
        [--tokens 256] [--steps 4] [--rounds 3] [--pipelines 1,2] [--ab-steps 12]

The model is attention-free on purpose: only EP MoE layers (`batchgen.dist.ExpertParallelMoE`, residual
added), so the experts' GEMMs dominate and the ratio measures what expert parallelism buys and what its
all-to-alls cost. With P processes each holds E/P experts and 1/P of the tokens: it routes its tokens,
dispatches them to the owners, runs its experts on everything that arrived (the expert batch stays the
whole step's), and combines. Printed per run: tokens/s (all ranks' tokens, slowest rank's time), each rank's
share of time inside collectives (waiting for the other included), its experts' mean batch and its CPU
seconds (process time: on a loaded machine wall time minus CPU time is time spent waiting for a core); for
P=1 also the plain single-process SparseMoE stack on the same tokens (what EP with one process costs over it).

Each round also runs a ceiling: two processes splitting the experts as EP does, each routing every token and
running its own experts on the rows routed to them, with no communication at all; what two cores give this
split of the work, so that the gap between EP and one process is attributed (the cores' own scaling against EP's
all-to-alls and waits). Runs alternate (1, 2, ceiling, 1, 2, ...) for --rounds rounds and the best of each is
kept, since another load on the machine can only slow a run down. The weights are built once in the parent and the workers are forked (they
share them copy-on-write until each copies its own shard). Report `uptime` with the result: on a loaded
2-core machine the second process competes with other work, so the ratio is only meaningful on an idle one.

Two processes run once per `--pipelines` value (`ExpertParallelMoE(pipeline=...)`): 1 is the synchronous
exchange (one dispatch, all local experts, one combine), p > 1 pipelines it over p groups of local expert slots
so the all-to-alls overlap the experts' GEMMs (ep_moe.py); their order alternates between rounds. Each prints
its own line and speedup (`speedup_2procs_pipeline<p>=`) and, per round, its ratio to the synchronous run of
the same round. Then (--ab-steps) all of them run in the same two processes, alternating step by step, and the
median per-step time ratio to the first (synchronous) is printed: the A/B least biased by a changing load. The
last line reads `speedup_2procs=<r>` for the default (`batchgen.dist.ep_moe.DEFAULT_PIPELINE`, what
backend=dist runs); one process always runs synchronously.

Recorded results (with the machine and the date): benchmarks/results/dist_scaling.md. With gloo the pipelined
exchange is CPU work of the process that waits for it, which is why the default is the synchronous one.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from batchgen.dist import Comm, ExpertParallelMoE, ExpertPlacement, launch
from batchgen.dist.ep_moe import DEFAULT_PIPELINE
from batchgen.exec.models.config import ExecModelConfig
from batchgen.exec.models.loading import init_random


def keep_freed_memory() -> None:
    """glibc: large activations from the heap, never trimmed (otherwise each is a fresh mmap whose page faults
    cost as much as the copy; the same for every run)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * 2**20)
        libc.mallopt(-1, 2**31 - 1)
    except OSError:
        pass


def build_layers(args) -> list:
    cfg = ExecModelConfig(architecture="mixtral", vocab_size=32, hidden_size=args.hidden, num_layers=args.layers,
                          num_heads=2, num_kv_heads=1, head_dim=8, num_experts=args.experts, top_k=args.top_k,
                          moe_intermediate_size=args.inter)
    model = init_random(cfg, seed=0, std=0.02)
    return [model.moe(l) for l in range(args.layers)]


def tokens(args) -> torch.Tensor:
    return torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))


def _worker(ctx, layers, x, steps: int, pipeline: int):
    keep_freed_memory()
    torch.set_grad_enabled(False)
    comm = Comm()
    eps = [ExpertParallelMoE(m, comm, pipeline=pipeline) for m in layers]
    mine = torch.tensor_split(x, comm.size)[comm.rank]

    def step(h):
        for ep in eps:
            h = h + ep(h)
        return h

    step(mine)  # warm-up: allocations, the grouped-GEMM probe
    comm.barrier()
    comm.comm_s, batches = 0.0, []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step(mine)
        batches += [sum(ep.last_tokens_per_expert) / len(ep.local_experts) for ep in eps]
    in_comm, cpu = comm.comm_s, time.process_time() - c0
    comm.barrier()
    elapsed = time.perf_counter() - t0
    plain = None
    if comm.size == 1:  # the same stack without dist, for what the P=1 path costs over it
        h = mine
        for m in layers:
            h = h + m(h)
        t1 = time.perf_counter()
        for _ in range(steps):
            h = mine
            for m in layers:
                h = h + m(h)
        plain = time.perf_counter() - t1
    return elapsed, in_comm, sum(batches) / len(batches), plain, cpu


def _ceiling_worker(ctx, layers, x, steps: int):
    """Expert parallelism's compute without its communication: each process routes every token (no dispatch),
    runs its own block of experts on the rows routed to them (the same expert batches as with EP) and adds the
    result; nothing is exchanged but the barriers around the timed steps. Two cores' ceiling for this split."""
    keep_freed_memory()
    torch.set_grad_enabled(False)
    comm = Comm()
    placement = ExpertPlacement.contiguous(layers[0].num_experts, comm.size)
    local = placement.experts_of(comm.rank)
    shards = [m.expert_shard(local) for m in layers]

    def step(h):
        for shard in shards:
            ids, weights = shard.route(h)
            k, flat = ids.shape[1], ids.reshape(-1)
            mine = torch.nonzero((flat >= local[0]) & (flat <= local[-1])).squeeze(1)
            order = mine[torch.argsort(flat[mine], stable=True)]
            counts = torch.bincount(flat[order] - local[0], minlength=len(local))
            y = shard.sorted_expert_rows(h[order // k], counts) * weights.reshape(-1)[order, None]
            h = h + torch.zeros_like(h).index_add_(0, order // k, y.to(h.dtype))
        return h

    step(x)
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x)
    comm.barrier()
    return time.perf_counter() - t0


def _interleaved_worker(ctx, layers, x, steps: int, variants: list[int]):
    """Every pipeline variant in the same two processes, alternating step by step (the order reversed every
    other step), a barrier before each step: the per-step times of the variants see the same load, so their
    ratio step by step is an A/B that a machine's changing load does not bias."""
    keep_freed_memory()
    torch.set_grad_enabled(False)
    comm = Comm()
    eps = {v: [ExpertParallelMoE(m, comm, pipeline=v) for m in layers] for v in variants}
    mine = torch.tensor_split(x, comm.size)[comm.rank]

    def step(v):
        h = mine
        for ep in eps[v]:
            h = h + ep(h)

    for v in variants:
        step(v)
    times: dict[int, list[float]] = {v: [] for v in variants}
    cpu = dict.fromkeys(variants, 0.0)
    for i in range(steps):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(v)
            times[v].append(time.perf_counter() - t0)
            cpu[v] += time.process_time() - c0
    return times, cpu


def interleaved(layers, x, steps: int, variants: list[int]) -> tuple[dict, dict]:
    """Per variant, each step's time on the slower of the two ranks, and the two ranks' CPU seconds per step
    (their own and their gloo threads': what the variant costs a machine with no core to spare)."""
    results = _launch(_interleaved_worker, 2, layers, x, steps, variants)
    times = {v: [max(r[0][v][i] for r in results) for i in range(steps)] for v in variants}
    return times, {v: sum(r[1][v] for r in results) / steps for v in variants}


def _launch(fn, procs: int, *args) -> list:
    """fn(ctx, *args) on `procs` forked processes (one thread each); their return values by rank, or the failures
    raised."""
    results = launch(fn, procs, args, start_method="fork", threads=1, join_timeout_s=1800)
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError("\n".join(f"rank {r.rank}: exit {r.exitcode}: {r.error}" for r in bad))
    return [r.value for r in results]


def ceiling(layers, x, steps: int) -> float:
    """Tokens/s of two processes splitting the experts with no communication (`_ceiling_worker`)."""
    return x.shape[0] * steps / max(_launch(_ceiling_worker, 2, layers, x, steps))


def run(layers, x, procs: int, steps: int, pipeline: int = 1) -> dict:
    results = _launch(_worker, procs, layers, x, steps, pipeline)
    elapsed = max(r[0] for r in results)
    out = dict(procs=procs, seconds=elapsed, tokens_per_s=x.shape[0] * steps / elapsed,
               comm_share=[r[1] / r[0] for r in results],
               expert_batch=[r[2] for r in results], cpu_s=[r[4] for r in results])
    if results[0][3] is not None:
        out["plain_tokens_per_s"] = x.shape[0] * steps / results[0][3]
    return out


def pipelines(text: str) -> list[int]:
    """--pipelines: comma-separated positive integers, the default pipeline always included (its speedup is the
    last line)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--pipelines {text!r}: give comma-separated integers >= 1, e.g. 1,2") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--pipelines {text!r}: give comma-separated integers >= 1, e.g. 1,2")
    return sorted(set(values) | {DEFAULT_PIPELINE})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pipelines", default="1,2",
                   help="pipeline values for the 2-process runs (1 = synchronous exchange)")
    p.add_argument("--ab-steps", type=int, default=12,
                   help="steps per variant of the interleaved A/B of the pipeline values (0: skip it)")
    args = p.parse_args()
    variants = pipelines(args.pipelines)
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}; cores: {os.cpu_count()}")
    print(f"model: {args.layers} MoE layers x {args.experts} experts (hidden {args.hidden}, expert width "
          f"{args.inter}, top-{args.top_k}), {args.tokens} tokens per step, {args.steps} steps per run, fp32; "
          f"2 processes with pipeline {variants} (default {DEFAULT_PIPELINE})")
    layers, x = build_layers(args), tokens(args)
    best: dict = {}  # 1 -> the one-process run; (2, pipeline) -> each two-process variant

    def keep(key, r):
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r

    def describe(r) -> str:
        return (f"{r['tokens_per_s']:.1f} tok/s ({r['seconds']:.2f} s), time in collectives per rank "
                f"{[f'{s:.0%}' for s in r['comm_share']]}, mean expert batch per rank "
                f"{[f'{b:.0f}' for b in r['expert_batch']]}, CPU s per rank {[f'{c:.2f}' for c in r['cpu_s']]}")

    best_ceiling = 0.0
    for rnd in range(args.rounds):
        one = run(layers, x, 1, args.steps)
        print(f"round {rnd} procs=1: {describe(one)}, plain SparseMoE {one['plain_tokens_per_s']:.1f} tok/s",
              flush=True)
        keep(1, one)
        this_round = {}
        for pipeline in (variants if rnd % 2 == 0 else variants[::-1]):
            r = this_round[pipeline] = run(layers, x, 2, args.steps, pipeline)
            print(f"round {rnd} procs=2 pipeline={pipeline}: {describe(r)}; "
                  f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x this round's 1 process", flush=True)
            keep((2, pipeline), r)
        if 1 in this_round and len(variants) > 1:
            print(f"round {rnd} tokens/s over the synchronous run's: " + ", ".join(
                f"{this_round[v]['tokens_per_s'] / this_round[1]['tokens_per_s']:.3f} with pipeline={v}"
                for v in variants if v != 1), flush=True)
        c = ceiling(layers, x, args.steps)
        print(f"round {rnd} no-communication ceiling, 2 processes: {c:.1f} tok/s", flush=True)
        best_ceiling = max(c, best_ceiling)
    if args.ab_steps > 0 and len(variants) > 1:
        times, cpu = interleaved(layers, x, args.ab_steps, variants)
        base = times[variants[0]]
        print(f"interleaved A/B, 2 processes, {args.ab_steps} steps each, alternating step by step: median step "
              + ", ".join(f"{statistics.median(times[v]) * 1e3:.1f} ms (CPU {cpu[v] * 1e3:.0f} ms, both ranks) with "
                          f"pipeline={v}" for v in variants)
              + "; median per-step time ratio to pipeline=" + f"{variants[0]}: "
              + ", ".join(f"{statistics.median(a / b for a, b in zip(times[v], base)):.3f} (pipeline={v})"
                          for v in variants[1:]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    two = best[(2, DEFAULT_PIPELINE)]
    cpu_ratio = sum(best[1]["cpu_s"]) / max(two["cpu_s"])
    print(f"diagnostic, not a speed: CPU seconds of 1 process / of the busiest of 2 = {cpu_ratio:.2f} (the ratio "
          "2 idle cores could give if waiting cost nothing; the wall-clock ratio below is the measurement)")
    print(f"diagnostic: two processes splitting the experts with no communication reach {best_ceiling:.1f} tok/s, "
          f"{best_ceiling / best[1]['tokens_per_s']:.2f}x one process (what two cores give this split; expert "
          f"parallelism's all-to-alls and waits cost the rest: EP reaches "
          + ", ".join(f"{best[(2, v)]['tokens_per_s'] / best_ceiling:.0%} with pipeline={v}" for v in variants)
          + " of it)")
    print(f"best: 1 process {best[1]['tokens_per_s']:.1f} tok/s, 2 processes "
          + ", ".join(f"{best[(2, v)]['tokens_per_s']:.1f} tok/s with pipeline={v}" for v in variants))
    for v in variants:
        print(f"speedup_2procs_pipeline{v}={best[(2, v)]['tokens_per_s'] / best[1]['tokens_per_s']:.2f}")
    print(f"speedup_2procs={two['tokens_per_s'] / best[1]['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
