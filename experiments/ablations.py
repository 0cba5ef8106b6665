"""Which mechanism carries coroutine's gain in each of the paper's experiments: its mechanisms turned on one at a
time on the same instances, and the baselines' own options one at a time, each row one simulated run.

    python experiments/ablations.py [--experiment NAME] [--num-sequences N] [--out DIR] [extra Hydra overrides...]

Experiments (`EXPERIMENTS`): scale_12k_4k and scale_6_5k_2_8k, (a): DeepSeek-R1 on 128 H20, 10,000 requests;
pd_disagg, (b): the same rig on LongBench 8K->2K; longbench_h20_8, longbench_h20_16, longbench_h200_8, (c):
DeepSeek-R1, 8K->2K, 500 requests at sglang_opt's memory fraction; memory_limited, (d): Mixtral-8x7B on one
A5000, GSM8K; rl_rollout, (e1): DeepSeek-R1 on 16 H20, 256 long-tailed prompts. Coroutine's rows add, in
order: its module batching alone (KV on the device, no MIGRATE, no PARTITION: the planner still picks B_attn,
B_moe and the attention degree), host-resident KV where its plan takes it, MIGRATE (work stealing and tail
rebalancing), PARTITION, all with expert-parallel prefill; then the prefill planned, expert or data parallel
(coroutine as shipped); as shipped with its prefill stopped at twice its decode slots (the cap it had before it
prefilled until the host watermark); then what the experiment adds (the scale experiment's all-to-all overlapped
across attention micro-batches, and its 16-GPU groups, which separate the instance size from the rest; (c)'s
memory fraction). The baseline rows run each engine at its own defaults, then with each option it leaves off.
Each row's ratio is its BCT over coroutine as shipped; a row that does not fit the rig says so. Writes
ablations_<experiment>.csv and its figure (PNG and PDF) to --out.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.memory import ConfigError
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
EP_PREFILL = ["policy.prefill_parallel=ep"]
SHIPPED = "coroutine as shipped"
OVERLAP = "coroutine + all-to-all overlapped across micro-batches, 2 x 64"
PLANNED_SIZE = "coroutine, instance size planned (cluster.gpus_per_instance=auto)"


def coroutine_rows(suffix: str = "", extra: tuple[str, ...] = ()) -> list[tuple[str, str, list[str]]]:
    """Coroutine's mechanisms added one at a time (`extra`: overrides every row takes); expert-parallel prefill
    until coroutine as shipped; then as shipped with its prefill stopped early (the cap it had before it
    prefilled until the host watermark, as the authors' code does)."""
    return [(f"coroutine: module batching alone{suffix}", "coroutine",
             ["policy.kv_residency=device", *NO_MIGRATE, *NO_PARTITION, *EP_PREFILL, *extra]),
            ("+ host-resident KV (planned)", "coroutine", [*NO_MIGRATE, *NO_PARTITION, *EP_PREFILL, *extra]),
            ("+ MIGRATE", "coroutine", [*NO_PARTITION, *EP_PREFILL, *extra]),
            ("+ PARTITION", "coroutine", [*EP_PREFILL, *extra]),
            (f"+ prefill planned (expert or data parallel) = {SHIPPED}{suffix}", "coroutine", list(extra)),
            (f"{SHIPPED}{suffix}, prefill stopped at 2 x its decode slots", "coroutine",
             [*extra, "policy.prefill_ahead=2"])]


def sglang_rows(suffix: str = "", extra: tuple[str, ...] = ()) -> list[tuple[str, str, list[str]]]:
    """SGLang at its defaults, then with each option it leaves off (--enable-mixed-chunk,
    --enable-two-batch-overlap)."""
    return [(f"sglang_opt (SGLang defaults){suffix}", "sglang_opt", list(extra)),
            (f"sglang_opt + mixed chunks{suffix}", "sglang_opt", [*extra, "policy.mixed_chunks=true"]),
            (f"sglang_opt + two-batch overlap{suffix}", "sglang_opt", [*extra, "policy.two_batch_overlap=true"])]


@dataclass(frozen=True)
class Experiment:
    """One experiment's rig, its rows and how its figure names it."""

    base: tuple[str, ...]            # overrides every row takes (the rig, the workload)
    rows: list[tuple[str, str, list[str]]]
    model: str
    cluster: str
    workload: str
    num_sequences: int | None        # None: the workload's own
    paper_row: str                   # the row the paper's ratio is against ("" for none)
    paper: str


def _scale(shape: str) -> Experiment:
    return Experiment(
        (f"+experiment=paper_scale_{shape}",),
        [*coroutine_rows(", 2 x 64"),
         (OVERLAP, "coroutine", ["policy.comm_overlap=true"]),
         ("coroutine as shipped, 8 x 16", "coroutine", [GROUPS]),
         (PLANNED_SIZE, "coroutine", ["cluster.gpus_per_instance=auto"]),
         ("continuous (vLLM defaults), 8 x 16", "continuous", [GROUPS]),
         ("continuous (vLLM defaults), 2 x 64", "continuous", []),
         *sglang_rows(", 8 x 16", (GROUPS,))],
        "deepseek_r1", "h20_128", f"longbench_{shape}", 10000, "sglang_opt (SGLang defaults)",
        f"{PAPER[shape]} (SGLang-Opt)")


def _longbench(cluster: str) -> Experiment:
    fraction = "memory.gpu_memory_fraction=0.97"
    return Experiment(
        ("model=deepseek_r1", f"cluster={cluster}", "workload=longbench_8k_2k", fraction),
        [*coroutine_rows(),
         ("coroutine as shipped, memory fraction 0.9", "coroutine", ["memory.gpu_memory_fraction=0.9"]),
         ("coroutine as shipped, data-parallel attention", "coroutine", ["policy.attention_tp=1"]),
         ("continuous (vLLM defaults)", "continuous", []),
         *sglang_rows()],
        "deepseek_r1", cluster, "longbench_8k_2k", 500, "sglang_opt (SGLang defaults)",
        "1.31-1.85x (8 H20), 1.25-1.66x (16 H20, 8 H200)")


EXPERIMENTS = {
    "scale_12k_4k": _scale("12k_4k"),
    "scale_6_5k_2_8k": _scale("6_5k_2_8k"),
    "pd_disagg": Experiment(
        ("model=deepseek_r1", "cluster=h20_128", "workload=longbench_8k_2k"),
        [*coroutine_rows(", 2 x 64", ("cluster.gpus_per_instance=64",)),
         ("coroutine as shipped, 8 x 16", "coroutine", [GROUPS]),
         ("pd_disagg 4:4 (16-GPU units)", "pd_disagg", ["policy.prefill_units=4", "policy.decode_units=4",
                                                        "policy.unit_gpus=16"]),
         ("continuous (vLLM defaults), 8 x 16", "continuous", [GROUPS]),
         ("continuous (vLLM defaults), 2 x 64", "continuous", ["cluster.gpus_per_instance=64"])],
        "deepseek_r1", "h20_128", "longbench_8k_2k", 10000, "pd_disagg 4:4", "2.2x (best P:D, 4:4)"),
    "longbench_h20_8": _longbench("h20_8"),
    "longbench_h20_16": _longbench("h20_16"),
    "longbench_h200_8": _longbench("h200_8"),
    "memory_limited": Experiment(
        ("model=mixtral_8x7b", "cluster=a5000_1", "workload=gsm8k_512_256"),
        [("coroutine: module batching alone", "coroutine", ["policy.kv_residency=device"]),
         ("+ host-resident KV, attention on the GPU", "coroutine", ["policy.kv_residency=host",
                                                                     "policy.attention=gpu"]),
         (f"+ attention beside the KV on the CPU = {SHIPPED}", "coroutine", []),
         ("flexgen (its own search)", "flexgen", []),
         ("flexgen, KV on the GPU", "flexgen", ["policy.cache_on=gpu"]),
         ("flexgen, KV on the host restored to the GPU", "flexgen", ["policy.cache_on=cpu",
                                                                      "policy.cpu_delegation=false"]),
         ("moe_lightning (its own search)", "moe_lightning", []),
         ("moe_lightning, attention on the GPU", "moe_lightning", ["policy.attention=gpu"]),
         ("zero_inference", "zero_inference", [])],
        "mixtral_8x7b", "a5000_1", "gsm8k_512_256", None, "flexgen (its own search)",
        "up to 9.6x (the best offloading system)"),
    "rl_rollout": Experiment(
        ("+experiment=rl_rollout",),
        [*coroutine_rows(", data-parallel attention", ("policy.attention_tp=1",)),
         ("coroutine, attention degree planned", "coroutine", []),
         ("continuous (vLLM defaults)", "continuous", []),
         *sglang_rows()],
        "deepseek_r1", "h20_16", "rl_rollout", None, "", ""),
}
COLUMNS = ["row", "bct_s", "vs_shipped", "decode_expert_batch", "gpu_busy_frac", "gpu_idle_frac", "gpu_comm_frac",
           "prefill_frac", "mixed_frac", "mean_running", "migrations", "recomputes", "partitions", "num_sequences",
           "overrides", "error"]


def run_rows(name: str, num_sequences: int | None, extra: list[str]) -> list[dict]:
    """Every row of the experiment (one that does not fit keeps its error instead of numbers)."""
    exp = EXPERIMENTS[name]
    n = num_sequences if num_sequences is not None else exp.num_sequences
    count = [f"workload.num_sequences={n}"] if n is not None else []
    rows = []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for label, policy, overrides in exp.rows:
            cfg = compose("config", overrides=[*exp.base, f"+policy={policy}", *count, "output.plot=false",
                                               *overrides, *extra])
            try:
                row = summarize(simulate(build_job(cfg), progress=False))
            except ConfigError as e:
                rows.append(dict(row=label, overrides=" ".join(overrides) or "-", error=str(e)))
                print(f"does not fit: {label}: {e}", flush=True)
                continue
            row.update(row=label, overrides=" ".join(overrides) or "-", error="")
            rows.append(row)
            print(f"done: {label}: BCT {row['bct_s']:,.0f} s (wall {row['wall_s']:.1f} s)", flush=True)
    shipped = next(r["bct_s"] for r in rows if SHIPPED in r["row"] and not r["error"])
    for r in rows:
        r["vs_shipped"] = r["bct_s"] / shipped if not r["error"] else float("nan")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| row | BCT s | BCT / coroutine's | decode expert batch | running | idle | comm | prefill | mixed | "
             "migrations | partitions |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['row']} | does not fit: {r['error']} | | | | | | | | | |")
            continue
        lines.append(f"| {r['row']} | {r['bct_s']:,.0f} | {r['vs_shipped']:.2f} | {r['decode_expert_batch']:.1f} | "
                     f"{r['mean_running']:,.0f} | {r['gpu_idle_frac']:.0%} | {r['gpu_comm_frac']:.0%} | "
                     f"{r['prefill_frac']:.0%} | {r['mixed_frac']:.0%} | {r.get('migrations', 0):,} | "
                     f"{r.get('partitions', 0):,} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, name: str) -> list[Path]:
    """Each row's BCT with its ratio to coroutine as shipped written on the bar, and its GPU time as compute /
    communication / idle (rows that do not fit are left out)."""
    exp = EXPERIMENTS[name]
    rows = [r for r in rows if not r["error"]]
    names = [r["row"] for r in rows]
    ref = next(i for i, r in enumerate(rows) if SHIPPED in r["row"])
    fig, (bct, shares) = fs.figure(2, width=6.0, height=4.6)
    paper = {i: exp.paper for i, r in enumerate(rows) if exp.paper_row and r["row"].startswith(exp.paper_row)}
    fs.ratio_bars(bct, names, [r["bct_s"] for r in rows], ref, "s", paper=paper,
                  colors=[fs.OURS if r["row"].startswith(("coroutine", "+")) else fs.OTHERS for r in rows])
    bct.set_xlabel("batch completion time (s); ratio = row's BCT / coroutine as shipped")
    fs.share_stack(shares, names, rows)
    shares.set_yticklabels([])
    fig.suptitle(fs.title(exp.model, exp.cluster, exp.workload, rows[0]["num_sequences"],
                          "ablations: coroutine's mechanisms added one at a time (blue), the baselines' options (grey)"),
                 fontsize=10)
    return fs.save(fig, out, f"ablations_{name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="scale_12k_4k", choices=sorted(EXPERIMENTS))
    ap.add_argument("--num-sequences", type=int, default=None, help="requests (default: the experiment's)")
    ap.add_argument("--out", default="outputs/ablations", help="where the CSV and the figure go")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every row")
    args = ap.parse_args()
    rows = run_rows(args.experiment, args.num_sequences, args.overrides)
    print(markdown(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"ablations_{args.experiment}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, out, args.experiment)
    print(f"wrote {out / f'ablations_{args.experiment}.csv'} and the figure (.png, .pdf)")


if __name__ == "__main__":
    main()
