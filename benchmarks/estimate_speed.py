"""How fast `job.estimate=true` answers: 100K requests, Qwen3-30B-A3B on 128 H20 (two 64-GPU instances), the
coroutine, continuous and static policies. The issue's target: the estimate prints in under a minute on a 2-core
machine. Prints the table, each policy's simulation wall time, and ends with `estimate_wall_s=<seconds>` (from
before the input is built until the table is printed, as a user waits for it; interpreter start-up excluded).

    python benchmarks/estimate_speed.py [--requests 100000] [--output max_tokens] [--share auto|yes|no]
                                        [--workers N]

Recorded results (with the machine and the date): benchmarks/results/estimate_speed.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from batchgen.batch.estimate import DEFAULT_OUTPUT, EstimateInput, estimate, format_estimate
from batchgen.setup import policy_config
from batchgen.specs import load_cluster, load_model


def build_input(n: int, seed: int = 0) -> EstimateInput:
    """Prompts lognormal-ish within 200-2000 tokens (median ~600), max_tokens uniform in 512-1024."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(np.rint(np.exp(rng.normal(np.log(600), 0.6, n))), 200, 2000).astype(np.int64)
    max_tokens = rng.integers(512, 1024, size=n, endpoint=True, dtype=np.int64)
    return EstimateInput(prompts, max_tokens, np.zeros(n, dtype=bool))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--cluster", default="h20_128")
    ap.add_argument("--policies", default="coroutine,continuous,static")
    ap.add_argument("--output", choices=("default", "max_tokens"), default="default",
                    help="default: the Azure conversation trace's outputs; max_tokens: every request runs to it")
    ap.add_argument("--share", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()

    start = time.perf_counter()
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    policies = [policy_config(p, model) for p in args.policies.split(",")]
    inp = build_input(args.requests)
    output = DEFAULT_OUTPUT if args.output == "default" else {"kind": "max_tokens"}
    share = {"auto": None, "yes": True, "no": False}[args.share]
    rows = estimate(model, cluster, inp, policies, output=output, share=share, workers=args.workers,
                    progress=True)
    print(format_estimate(rows, inp, output, model, cluster))
    total = time.perf_counter() - start
    print()
    for r in rows:
        print(f"{r.policy}: simulation wall {r.wall_s:.1f} s ({r.simulated_requests:,} requests simulated)")
    print(f"estimate_wall_s={total:.1f}")


if __name__ == "__main__":
    main()
