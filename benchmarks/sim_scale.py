"""How fast the simulator is: simulated sequences per wall-second and events per sequence at 10K, 100K and
1M sequences on 128 GPUs (two 64-GPU instances), under one policy.

    python benchmarks/sim_scale.py [--sizes 10000,100000,1000000] [--policy coroutine] [--model qwen3_30b_a3b]

The last line reads `wall_s_1M=<seconds> events_per_seq=<n>` (for the largest size run).
"""

from __future__ import annotations

import argparse
import time

from omegaconf import OmegaConf

from batchgen.confdir import conf_dir
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from batchgen.workload import build_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--policy", default="coroutine")
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--cluster", default="h20_128")
    ap.add_argument("--workload", default="longbench_12k_4k")
    args = ap.parse_args()
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    policy = make_policy(OmegaConf.to_container(OmegaConf.load(conf_dir() / "policy" / f"{args.policy}.yaml")))
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
