"""The paper's scale experiment in simulation: BCT of the policies on 128 H20 GPUs running DeepSeek-R1.

    python experiments/paper_scale.py [--shape 12k_4k|6_5k_2_8k] [--num-sequences 10000] [extra overrides...]

Runs coroutine on two 64-GPU instances (as the paper ran BatchGen), continuous both on 64-GPU instances and
as 16-GPU data-parallel groups (how the paper ran its SGLang-Opt baseline), and static, then prints one table
and the numbers that explain the differences. The paper reports 1.71-1.82x (12K->4K) and 2.2-2.3x
(6.5K->2.8K) lower BCT than SGLang-Opt on real hardware.
"""

from __future__ import annotations

import argparse

from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.results import explain, format_table, summarize
from batchgen.sim.run import simulate

VARIANTS = [
    ("coroutine", []),
    ("continuous", []),
    ("continuous", ["cluster.gpus_per_instance=16"]),
    # padded static batches prefill batch_size x the longest prompt in one forward: 4 x 16K tokens of
    # activations (~50 GB) is what fits beside DeepSeek-R1's weights on an H20 (64 would need ~800 GB)
    ("static", ["policy.batch_size=4"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="12k_4k", choices=["12k_4k", "6_5k_2_8k"])
    ap.add_argument("--num-sequences", type=int, default=10000)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. routing_skew=0.5")
    args = ap.parse_args()
    rows = []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for policy, extra in VARIANTS:
            cfg = compose("config", overrides=[f"+experiment=paper_scale_{args.shape}", f"+policy={policy}",
                                               f"workload.num_sequences={args.num_sequences}", *extra,
                                               *args.overrides])
            row = summarize(simulate(build_job(cfg)))
            rows.append(row)
            print(f"done: {policy} {' '.join(extra)} BCT {row['bct_s']:.0f} s (wall {row['wall_s']:.1f} s)",
                  flush=True)
    print(format_table(rows))
    print(explain(rows))


if __name__ == "__main__":
    main()
