"""How fast the simulator is: simulated sequences per wall-second and events per sequence at 10K, 100K and
1M sequences on 128 GPUs (two 64-GPU instances), under one policy.

    python benchmarks/sim_scale.py [--sizes 10000,100000,1000000] [--policy coroutine] [--model qwen3_30b_a3b]

The last line reads `wall_s_1M=<seconds> events_per_seq=<n>` (for the largest size run). Coroutine prefills
expert parallel here (`--prefill-parallel ep`), the job every recorded result measures.

    python benchmarks/sim_scale.py --policies [--vidur-s 9.7]
    python benchmarks/sim_scale.py --policies --vidur-dir DIR --vidur-python PY [--rounds 3]

runs Vidur's comparison workload instead (Llama-2-7B, one A100 80GB, the first 10K requests of the Azure
conversation trace, prompts clipped to 3,096 tokens) under every registered policy, one row each (wall s, CPU s
of this process, sequences per wall-second, events per sequence, simulated BCT, Vidur's wall time over the
policy's wall and CPU time: on a shared machine wall time grows with the load, CPU time much less; then what
the events are: forwards that prefill, decode runs and a decode run's mean iterations), and ends
with `slowest_policy=<name> vs_vidur=<ratio>` (wall). The target (issue 7) is at least 10x for every policy.
With --vidur-dir, Vidur runs in this process's rounds on the very same requests (benchmarks/vidur_run.py: each
round runs Vidur, then every policy), and the best of each is compared: the ratio measured side by side; without
it, the ratio is against a Vidur time passed in (--vidur-s, default VIDUR_RUN_S below). Side by side, `rounds` also
gives the lowest and highest of each round's own ratio (that round's Vidur over that round's policy): how far a
shared machine's changes of speed move the ratio.
Recorded results (with the machine and the date): benchmarks/results/sim_scale.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from batchgen.confdir import conf_dir
from batchgen.job import Job
from batchgen.memory import ConfigError
from batchgen.policy import make_policy, policy_names
from batchgen.setup import policy_config
from batchgen.sim.run import simulate
from batchgen.specs import cluster_from_config, load_cluster, load_model
from batchgen.workload import build_workload
from vidur_run import checkout_problem, run_vidur  # beside this script


# Vidur's event-loop seconds on the same workload (microsoft/vidur at 7d47513: Llama-2-7B, one A100, the first 10K
# Azure conversation requests all at t=0, its vLLM scheduler at its defaults, predictors trained and cached; see
# benchmarks/vidur_run.py): the default of --vidur-s, measured on a 2-core AVX-512 machine
# (benchmarks/results/sim_scale.md). A ratio against it is only as good as the two machines' likeness: prefer
# --vidur-dir, which measures Vidur beside batchgen.
VIDUR_RUN_S = 9.7


def _load_policy(name: str, model):
    """The policy as a run composes it for `model` (batchgen.setup.policy_config)."""
    return make_policy(policy_config(name, model))


def run_kinds(records) -> tuple[int, int, float]:
    """(runs that prefill, whole prompts or chunks beside decodes; decode runs; mean iterations of a decode run):
    what a policy's events are made of (a run is one event unless batchgen.engine.repeat merged identical ones)."""
    decodes = [r.iterations for r in records if r.phase == "decode"]
    forwards = sum(r.phase in ("prefill", "mixed") for r in records)
    return forwards, len(decodes), sum(decodes) / len(decodes) if decodes else 0.0


def vs_vidur(args: argparse.Namespace) -> None:
    """Every registered policy on Vidur's comparison workload, against Vidur's wall time: Vidur run in this
    process's rounds (`--vidur-dir`: each round runs Vidur, then every policy; the best of each is compared), or
    a time passed in (`--vidur-s`)."""
    model = load_model("llama2_7b")
    cluster = cluster_from_config({"name": "a100_1", "gpu": "a100_80g", "num_gpus": 1, "gpus_per_node": 1,
                                       "gpus_per_instance": None, "host_mem_gb_per_node": 2000,
                                       "host": "epyc_7742_2s"}, conf_dir() / "hardware")
    wcfg = OmegaConf.load(conf_dir() / "workload" / "azure_conv.yaml")
    wcfg.num_sequences = args.requests
    wcfg.max_input, wcfg.max_output = 3096, 1000  # within Llama-2's 4,096 (Vidur clips prompt + output to 4,096)
    workload = build_workload(wcfg, seed=0)
    side_by_side = args.vidur_dir is not None
    source = ("run beside it, best of each over the rounds" if side_by_side else "measured separately, not in this run"
              if args.vidur_s > 0 else "derived: 13.5 x coroutine's wall (the issue's 12-15x)")
    print(f"every policy on llama2_7b, 1 x {cluster.gpu.name}, azure_conv, {args.requests:,} sequences; "
          f"Vidur: {'%.1f s, ' % args.vidur_s if args.vidur_s > 0 and not side_by_side else ''}{source}")
    best: dict[str, tuple] = {}  # policy -> (wall, cpu, events, bct, runs by kind) of its best run
    vidur_runs = []
    paired: dict[str, list[float]] = {}  # policy -> Vidur's wall over the policy's, per round (side by side)
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds if side_by_side else 1):
            if side_by_side:
                run_s, end_s = run_vidur(args.vidur_python, args.vidur_dir, workload.input_lens,
                                         workload.output_lens, Path(work))
                vidur_runs.append(run_s)
                print(f"round {round_}: Vidur {run_s:.2f} s in its event loop (simulated end {end_s:,.0f} s)",
                      flush=True)
            for name in policy_names():
                start, cpu_start = time.perf_counter(), time.process_time()
                try:
                    out = simulate(Job(model, cluster, workload, _load_policy(name, model)), progress=False)
                except ConfigError as e:  # a policy this workload cannot run (pd_disagg needs an MoE model)
                    if round_ == 0:
                        print(f"{name:>12} refused: {e}", flush=True)
                    continue
                wall = time.perf_counter() - start
                cpu = time.process_time() - cpu_start  # this process's CPU s: what a loaded machine inflates less
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, cpu, out.events, float(out.prepared.state.table.finish_time.max()),
                                  run_kinds(out.records))
                if side_by_side:
                    paired.setdefault(name, []).append(vidur_runs[-1] / wall)
                    print(f"round {round_}: {name} {wall:.2f} s ({paired[name][-1]:.1f}x this round's Vidur)",
                          flush=True)
    vidur = (min(vidur_runs) if side_by_side else args.vidur_s if args.vidur_s > 0
             else 13.5 * best["coroutine"][0])
    print(f"{'policy':>12} {'wall_s':>8} {'cpu_s':>7} {'seq/wall_s':>11} {'events':>8} {'events/seq':>10} "
          f"{'bct_s':>10} {'vs_vidur':>9} {'cpu_vs':>7} {'rounds':>10} {'forwards':>9} {'decodes':>8} "
          f"{'iters/dec':>9}   (Vidur {vidur:.2f} s; rounds: the lowest-highest of the ratios within a round)")
    for name, (wall, cpu, events, bct, (forwards, decodes, iters)) in best.items():
        within = f"{min(paired[name]):.1f}-{max(paired[name]):.1f}" if name in paired else "-"
        print(f"{name:>12} {wall:>8.2f} {cpu:>7.2f} {args.requests / wall:>11,.0f} {events:>8,} "
              f"{events / args.requests:>10.4f} {bct:>10.0f} {vidur / wall:>9.1f} {vidur / cpu:>7.1f} {within:>10} "
              f"{forwards:>9,} {decodes:>8,} {iters:>9.2f}")
    slowest = max(best, key=lambda name: best[name][0])
    print(f"slowest_policy={slowest} vs_vidur={vidur / best[slowest][0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--policy", default="coroutine")
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--cluster", default="h20_128")
    ap.add_argument("--workload", default="longbench_12k_4k")
    ap.add_argument("--prefill-parallel", default="ep", choices=("ep", "dp", "auto"),
                    help="coroutine's policy.prefill_parallel: ep, the job of the recorded results (auto, the "
                         "config's, plans dp on this job: fewer events, another job)")
    ap.add_argument("--policies", action="store_true",
                    help="every policy on Vidur's workload (Llama-2-7B, 1 A100, azure_conv), against Vidur")
    ap.add_argument("--requests", type=int, default=10_000, help="with --policies: sequences of the trace")
    ap.add_argument("--vidur-s", type=float, default=VIDUR_RUN_S,
                    help="with --policies: Vidur's wall time on that workload; 0 derives it from coroutine's")
    ap.add_argument("--vidur-dir", default=None,
                    help="with --policies: a Vidur checkout to run beside the policies (benchmarks/vidur_run.py)")
    ap.add_argument("--vidur-python", default="python",
                    help="with --vidur-dir: an interpreter that has Vidur's requirements")
    ap.add_argument("--rounds", type=int, default=3, help="with --vidur-dir: rounds of Vidur, then every policy")
    args = ap.parse_args()
    if args.vidur_dir is not None and checkout_problem(args.vidur_dir):
        ap.error(checkout_problem(args.vidur_dir))
    if args.policies:
        vs_vidur(args)
        return
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    policy = _load_policy(args.policy, model)
    if hasattr(policy, "prefill_parallel") and args.policy == "coroutine":
        policy = dataclasses.replace(policy, prefill_parallel=args.prefill_parallel)
    wcfg = OmegaConf.load(conf_dir() / "workload" / f"{args.workload}.yaml")
    print(f"{args.policy} on {args.model}, {cluster.num_gpus} x {cluster.gpu.name} "
          f"({cluster.num_instances} instances), workload shape {args.workload}")
    print(f"{'sequences':>10} {'wall_s':>8} {'seq/wall_s':>11} {'events':>8} {'events/seq':>10} {'bct_s':>10}")
    wall = events_per_seq = 0.0
    for n in (int(s) for s in args.sizes.split(",")):
        wcfg.num_sequences = n
        workload = build_workload(wcfg, seed=0)
        start = time.perf_counter()
        out = simulate(Job(model, cluster, workload, policy))
        wall = time.perf_counter() - start
        events_per_seq = out.events / n
        bct = float(out.prepared.state.table.finish_time.max())
        print(f"{n:>10,} {wall:>8.1f} {n / wall:>11,.0f} {out.events:>8,} {events_per_seq:>10.4f} {bct:>10.0f}",
              flush=True)
    print(f"wall_s_1M={wall:.1f} events_per_seq={events_per_seq:.4f}")


if __name__ == "__main__":
    main()
