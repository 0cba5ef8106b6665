"""Nested prefix groups in the simulator: a workload whose groups share an outer prefix (a subject's few-shot block,
a system prompt) beneath their own, run with its prefix tree and with the same groups on one level (the outer
prefix then computed and held again per group), under each policy, side by side in one process.

    python benchmarks/nested_prefixes.py [--workload fewshot_pass_at_k] [--model qwen3_30b_a3b] [--cluster h100_8]
        [--policies coroutine,continuous,sglang_opt]

Per policy it prints BCT and prompt tokens computed for both runs, against the workload's distinct tokens (each
segment of the tree once) and its distinct tokens on one level; the last line reads
`<policy>:nested/flat=<r> ...` (the BCT ratio: below 1 is faster with the tree). Each job is the one
`python -m batchgen.experiment +policy=P model=M cluster=C workload=W` runs (the nested row is that command's); the
prompts' lengths, outputs and groups are the same in both runs, only the tree differs.

Recorded results (with the machine and the date): benchmarks/results/shared_prefix.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.sim.run import simulate
from batchgen.workload.prefixes import prefill_tokens_distinct


def job_of(policy: str, model: str, cluster: str, workload: str):
    """The job `python -m batchgen.experiment +policy=P model=M cluster=C workload=W` runs."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+policy={policy}", f"model={model}", f"cluster={cluster}",
                                                       f"workload={workload}", "output.plot=false"])
    return build_job(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="fewshot_pass_at_k")
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--cluster", default="h100_8")
    ap.add_argument("--policies", default="coroutine,continuous,sglang_opt")
    args = ap.parse_args()
    names = args.policies.split(",")
    nested = job_of(names[0], args.model, args.cluster, args.workload).workload
    if nested.prefix_tree is None:
        ap.error(f"workload {args.workload} has no nested groups (workload.prefix.outer)")
    flat = dataclasses.replace(nested, prefix_tree=None)
    distinct = {"nested": nested.prefill_tokens()["prefill_tokens_distinct"],
                "flat": prefill_tokens_distinct(flat.input_lens, flat.prefix_group, flat.prefix_len)}
    print(f"{args.model} on {args.cluster}, {args.workload}: {len(nested):,} sequences, prompt tokens "
          f"{int(nested.input_lens.sum()):,}, distinct {distinct['nested']:,} with the tree, {distinct['flat']:,} on "
          "one level")
    print(f"{'policy':<12} {'groups':<7} {'BCT s':>9} {'computed':>12} {'distinct':>12} {'wall s':>7}")
    ratios = []
    for name in names:
        bct, job = {}, job_of(name, args.model, args.cluster, args.workload)
        for label, workload in (("nested", nested), ("flat", flat)):
            start = time.perf_counter()
            out = simulate(dataclasses.replace(job, workload=workload), progress=False)
            wall = time.perf_counter() - start
            state = out.prepared.state
            bct[label] = float(state.table.finish_time.max())
            print(f"{name:<12} {label:<7} {bct[label]:>9.1f} {state.prefill_computed:>12,} {distinct[label]:>12,} "
                  f"{wall:>7.1f}", flush=True)
        ratios.append(f"{name}:nested/flat={bct['nested'] / bct['flat']:.2f}")
    print(" ".join(ratios))


if __name__ == "__main__":
    main()
