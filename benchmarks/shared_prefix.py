"""Prefix caching on the executor: a job whose prompts share a prefix, run with `policy.prefix_cache` on and off,
side by side in one process (rounds alternate), greedy outputs compared token for token.

    python benchmarks/shared_prefix.py [--prompts 96] [--group-size 8] [--prefix 384]
        [--policies coroutine,continuous,sglang_opt] [--rounds 2] [--threads 1] [--kv-mb 64]

The model is `small_moe` with random weights (seeded; batchgen.exec.models builds it), on one CPU "GPU"; the
prompts are groups of `--group-size` sequences whose first `--prefix` tokens are the same (the workload's prefix
columns), each with a short part of its own (16-64 tokens) and long-tailed outputs. Per policy it prints the best
BCT of the rounds with sharing on and off, the prompt tokens computed and whether the outputs are identical; the
last line reads `<policy>:sharing_on/sharing_off=<r> ...` (the BCT ratio: below 1 is faster with sharing). What
each policy shares: docs/simulator.md, Shared prefixes.

Recorded results (with the machine and the date): benchmarks/results/shared_prefix.md.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from batchgen.exec.run import ExecSettings, execute
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.results import summarize
from batchgen.setup import policy_config
from batchgen.specs import load_cluster, load_model
from batchgen.workload.spec import Workload

PAGE = 16


def grouped_workload(prompts: int, group_size: int, prefix: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    inputs = prefix + rng.integers(16, 65, prompts)
    outputs = np.minimum(rng.geometric(1 / 48, prompts) + 8, 256)
    return Workload("shared_prefix", inputs, outputs, prefix_group=np.arange(prompts) // group_size,
                    prefix_len=np.full(prompts, prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=384, help="shared tokens at the start of every prompt of a group")
    ap.add_argument("--policies", default="coroutine,continuous,sglang_opt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-mb", type=float, default=64.0, help="device KV memory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = load_model("small_moe")
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=1)
    workload = grouped_workload(args.prompts, args.group_size, args.prefix)
    settings = ExecSettings(device="cpu", dtype="float32", kv_budget_mb=args.kv_mb, threads=args.threads)
    print(f"small_moe, {args.prompts} prompts in groups of {args.group_size} sharing {args.prefix} tokens "
          f"(prompt tokens {int(workload.input_lens.sum()):,}, outputs {int(workload.output_lens.sum()):,} tokens), "
          f"KV {args.kv_mb:g} MB, {args.threads} thread(s), {args.rounds} rounds", flush=True)
    ratios = []
    for name in args.policies.split(","):
        knobs = {"two_batch_overlap": False} if name == "sglang_opt" else {}
        best: dict[bool, float] = {}
        outputs: dict[bool, list] = {}
        computed: dict[bool, int] = {}
        for _ in range(args.rounds):
            for on in (True, False):
                policy = make_policy(policy_config(name, spec, **knobs, prefix_cache=on))
                out = execute(Job(spec, cluster, workload, policy, page_tokens=PAGE), settings)
                s = summarize(out)
                best[on] = min(best.get(on, float("inf")), s["bct_s"])
                outputs[on], computed[on] = out.tokens.generated, s["prefill_tokens_computed"]
        same = outputs[True] == outputs[False]
        ratio = best[True] / best[False]
        ratios.append(f"{name}:sharing_on/sharing_off={ratio:.2f}")
        print(f"{name:12s} on {best[True]:6.2f} s  off {best[False]:6.2f} s  prompt tokens computed on "
              f"{computed[True]:,} off {computed[False]:,}  outputs identical: {same}", flush=True)
    print(" ".join(ratios))


if __name__ == "__main__":
    main()
