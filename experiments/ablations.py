"""Which mechanism carries coroutine's gain in the scale experiment: its mechanisms turned on one at a time on
the same instances, and the baseline's own options one at a time, each row one simulated run.

    python experiments/ablations.py [--shape 12k_4k|6_5k_2_8k] [--num-sequences 10000] [--out DIR] [...]

DeepSeek-R1 on 128 H20 (experiments/paper_scale.py's setting). Coroutine's rows add, in order: its module
batching alone on 2 x 64 instances (KV on the device, no MIGRATE, no PARTITION: the planner still picks B_attn
and B_moe), host-resident KV where its plan takes it, MIGRATE (work stealing and tail rebalancing), PARTITION
(coroutine as shipped); then coroutine as shipped in the baseline's 16-GPU groups, which separates the instance
size from the rest. The baseline rows: continuous (vLLM's defaults) in 16-GPU groups and on 2 x 64 instances,
sglang_opt as shipped (SGLang's defaults, the paper's memory fraction), then with each option SGLang leaves off
(--enable-mixed-chunk, --enable-two-batch-overlap). Each row's ratio is its BCT over coroutine as shipped.
Writes ablations_<shape>.csv and its figure (PNG and PDF) to --out.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.results import summarize
from batchgen.sim.run import simulate

try:
    import figure_style as fs  # run as a script: experiments/ is on the path
    from paper_scale import PAPER
except ImportError:
    from experiments import figure_style as fs
    from experiments.paper_scale import PAPER

GROUPS = "cluster.gpus_per_instance=16"
NO_MIGRATE = ["policy.migrate=false", "policy.migrate_across_instances=false"]
NO_PARTITION = ["policy.partition=false"]
SHIPPED = "coroutine as shipped, 2 x 64"
ROWS = [
    ("coroutine: module batching alone, 2 x 64", "coroutine",
     ["policy.kv_residency=device", *NO_MIGRATE, *NO_PARTITION]),
    ("+ host-resident KV (planned)", "coroutine", [*NO_MIGRATE, *NO_PARTITION]),
    ("+ MIGRATE", "coroutine", NO_PARTITION),
    (f"+ PARTITION = {SHIPPED}", "coroutine", []),
    ("coroutine as shipped, 8 x 16", "coroutine", [GROUPS]),
    ("continuous (vLLM defaults), 8 x 16", "continuous", [GROUPS]),
    ("continuous (vLLM defaults), 2 x 64", "continuous", []),
    ("sglang_opt (SGLang defaults), 8 x 16", "sglang_opt", [GROUPS]),
    ("sglang_opt + mixed chunks, 8 x 16", "sglang_opt", [GROUPS, "policy.mixed_chunks=true"]),
    ("sglang_opt + two-batch overlap, 8 x 16", "sglang_opt", [GROUPS, "policy.two_batch_overlap=true"]),
]
COLUMNS = ["row", "bct_s", "vs_shipped", "decode_expert_batch", "gpu_busy_frac", "gpu_idle_frac", "gpu_comm_frac",
           "prefill_frac", "mixed_frac", "mean_running", "migrations", "recomputes", "num_sequences", "overrides"]
SHAPES = {"12k_4k": "12K->4K", "6_5k_2_8k": "6.5K->2.8K"}


def run_rows(shape: str, num_sequences: int, extra: list[str]) -> list[dict]:
    rows = []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for name, policy, overrides in ROWS:
            cfg = compose("config", overrides=[f"+experiment=paper_scale_{shape}", f"+policy={policy}",
                                               f"workload.num_sequences={num_sequences}", *overrides, *extra])
            row = summarize(simulate(build_job(cfg)))
            row.update(row=name, overrides=" ".join(overrides) or "-")
            rows.append(row)
            print(f"done: {name}: BCT {row['bct_s']:,.0f} s (wall {row['wall_s']:.1f} s)", flush=True)
    shipped = next(r["bct_s"] for r in rows if r["row"].endswith(SHIPPED))
    for r in rows:
        r["vs_shipped"] = r["bct_s"] / shipped
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| row | BCT s | BCT / coroutine's | decode expert batch | idle | comm | prefill | mixed | migrations |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['bct_s']:,.0f} | {r['vs_shipped']:.2f} | {r['decode_expert_batch']:.1f} | "
                     f"{r['gpu_idle_frac']:.0%} | {r['gpu_comm_frac']:.0%} | {r['prefill_frac']:.0%} | "
                     f"{r['mixed_frac']:.0%} | {r.get('migrations', 0):,} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, shape: str) -> list[Path]:
    """Each row's BCT with its ratio to coroutine as shipped written on the bar, and its GPU time as compute /
    communication / idle."""
    names = [r["row"] for r in rows]
    ref = next(i for i, r in enumerate(rows) if r["row"].endswith(SHIPPED))
    fig, (bct, shares) = fs.figure(2, width=6.0, height=4.6)
    opt = next(i for i, r in enumerate(rows) if r["row"].startswith("sglang_opt (SGLang defaults)"))
    fs.ratio_bars(bct, names, [r["bct_s"] for r in rows], ref, "s", paper={opt: f"{PAPER[shape]} (SGLang-Opt)"},
                  colors=[fs.OURS if r["row"].startswith(("coroutine", "+")) else fs.OTHERS for r in rows])
    bct.set_xlabel("batch completion time (s); ratio = row's BCT / coroutine as shipped")
    fs.share_stack(shares, names, rows)
    shares.set_yticklabels([])
    fig.suptitle(fs.title("deepseek_r1", "h20_128", f"longbench_{shape}", rows[0]["num_sequences"],
                          "ablations: coroutine's mechanisms added one at a time (blue), the baselines' options (grey)"),
                 fontsize=10)
    return fs.save(fig, out, f"ablations_{shape}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="12k_4k", choices=("12k_4k", "6_5k_2_8k"))
    ap.add_argument("--num-sequences", type=int, default=10000)
    ap.add_argument("--out", default="outputs/ablations", help="where the CSV and the figure go")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every row")
    args = ap.parse_args()
    rows = run_rows(args.shape, args.num_sequences, args.overrides)
    print(markdown(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"ablations_{args.shape}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, out, args.shape)
    print(f"wrote {out / f'ablations_{args.shape}.csv'} and the figure (.png, .pdf)")


if __name__ == "__main__":
    main()
