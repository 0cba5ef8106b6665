"""The paper's PD-disaggregation experiment in simulation: DeepSeek-R1 on 128 H20, LongBench 8K->2K.

    python experiments/pd_disagg.py [--num-sequences 10000] [--ratios 1:7,2:6,3:5,4:4,5:3,6:2,7:1]
                                    [--unit-gpus 16] [--out DIR] [extra Hydra overrides...]
    python experiments/pd_disagg.py --report DIR/pd_disagg.csv   # the table and figure again, no run

Runs `pd_disagg` at each P:D ratio of 16-GPU units (prefill units only prefill, decode units only decode, the
KV of every prefilled sequence shipped to a decode unit over the network) and coroutine as 2 x 64 (how the paper
ran BatchGen), then writes pd_disagg.csv, pd_disagg.png and pd_disagg.pdf into the run directory and prints
BCT per point beside the numbers that explain it: the share of the prefill units' time they ran (the rest they
waited on back-pressure or ran out of prompts), the decode units' idle share (waiting for KV), the KV shipped,
recomputes and the decode expert batch. The paper: BCT from 38.6 to 137.9 minutes over the seven ratios, the
best at 4:4, and BatchGen 2.2x faster than that best ratio.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.results import summarize
from batchgen.sim.run import simulate

try:
    import figure_style as fs  # run as a script: experiments/ is on the path
except ImportError:
    from experiments import figure_style as fs

PAPER = {"bct_min_range": (38.6, 137.9), "best_ratio": "4:4", "batchgen_over_best": 2.2}
RATIOS = "1:7,2:6,3:5,4:4,5:3,6:2,7:1"
BASE = ["model=deepseek_r1", "cluster=h20_128", "workload=longbench_8k_2k", "output.sequences_csv=false",
        "output.plot=false"]


class Shipped:
    """A step observer: bytes moved node -> node (the KV shipped to decode units) and each instance's time in
    runs (the rest of the job's span it waited)."""

    def __init__(self):
        self.network_bytes = 0.0
        self.run_s: dict[int, float] = {}

    def __call__(self, plan, result) -> None:
        self.network_bytes += float(plan.moves.network.sum())
        self.run_s[plan.instance] = self.run_s.get(plan.instance, 0.0) + result.duration


def run_point(label: str, overrides: list[str], prefill_units: int) -> dict:
    cfg = compose("config", overrides=[*BASE, *overrides])
    shipped = Shipped()
    out = simulate(build_job(cfg), on_step=shipped, progress=False)
    row = summarize(out)
    end = max(r.start + r.duration for r in out.records)
    n_inst = out.prepared.state.topo.num_instances
    busy = np.array([shipped.run_s.get(i, 0.0) for i in range(n_inst)]) / end
    row.update(point=label, bct_min=row["bct_s"] / 60, kv_shipped_gb=shipped.network_bytes / 1e9,
               prefill_units_running=float(busy[:prefill_units].mean()) if prefill_units else float("nan"),
               decode_units_idle=float(1 - busy[prefill_units:].mean()) if prefill_units else float("nan"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-sequences", type=int, default=10000)
    ap.add_argument("--ratios", default=RATIOS, help="P:D in units, comma-separated")
    ap.add_argument("--unit-gpus", type=int, default=16)
    ap.add_argument("--no-coroutine", action="store_true", help="skip the coroutine 2 x 64 reference")
    ap.add_argument("--out", type=Path, default=None, help="the run directory")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the table and redraw the figure from this pd_disagg.csv instead of running")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. routing_skew=0.5")
    args = ap.parse_args()
    if args.report:
        rows = read_csv(args.report)
        plot(rows, args.report.parent)
        report(rows)
        return
    out_dir = args.out or Path("outputs/experiments/pd_disagg") / time.strftime("%Y-%m-%d_%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    n = f"workload.num_sequences={args.num_sequences}"
    points = []
    for ratio in args.ratios.split(","):
        p, d = (int(x) for x in ratio.split(":"))
        points.append((ratio, ["+policy=pd_disagg", f"policy.prefill_units={p}", f"policy.decode_units={d}",
                               f"policy.unit_gpus={args.unit_gpus}"], p))
    if not args.no_coroutine:
        points.append(("coroutine 2x64", ["+policy=coroutine", "cluster.gpus_per_instance=64"], 0))
    rows = []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for label, extra, p in points:
            start = time.perf_counter()
            try:
                row = run_point(label, [*extra, n, *args.overrides], p)
            except Exception as e:  # a point that cannot run is reported, the others still are
                print(f"{label}: cannot run: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append(row)
            print(f"done: {label} BCT {row['bct_min']:.1f} min (wall {time.perf_counter() - start:.0f} s)", flush=True)
    if not rows:
        raise SystemExit("no point ran")
    write_csv(rows, out_dir / "pd_disagg.csv")
    plot(rows, out_dir)
    report(rows)
    print(f"run directory: {out_dir} (pd_disagg.csv, pd_disagg.png, pd_disagg.pdf)")


COLUMNS = ["point", "bct_min", "bct_s", "prefill_units_running", "decode_units_idle", "prefill_frac",
           "gpu_busy_frac", "gpu_comm_frac", "gpu_idle_frac", "kv_shipped_gb", "migrations", "recomputes",
           "decode_expert_batch", "mean_expert_batch", "mean_running", "tokens_per_s", "num_sequences", "wall_s"]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    def value(key: str, text: str):
        if key == "point":
            return text
        number = float(text) if text not in ("", "None") else 0.0
        return int(number) if key in ("migrations", "recomputes", "num_sequences") else number
    with open(path, newline="") as f:
        return [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def plot(rows: list[dict], out_dir: Path) -> None:
    """BCT per P:D ratio with its ratio to coroutine's on the bar and the paper's numbers beside; each point's
    GPU time as compute / communication / idle; and which side waits."""
    from matplotlib.ticker import PercentFormatter

    pd_rows = [r for r in rows if ":" in r["point"]]
    co = next((r for r in rows if r["point"].startswith("coroutine")), None)
    fig, (a, s, b) = fs.figure(3, width=5.0, height=4.4)
    x = np.arange(len(pd_rows))
    bars = a.bar(x, [r["bct_min"] for r in pd_rows], color=fs.OTHERS, label="pd_disagg")
    best = min(pd_rows, key=lambda r: r["bct_s"]) if pd_rows else None
    for bar, r in zip(bars, pd_rows):
        text = f"{r['bct_min']:,.1f}" + (f"\n{r['bct_s'] / co['bct_s']:.2f}x" if co else "")
        a.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom", fontsize=7,
               fontweight="bold" if r is best else "normal")
    if co:
        a.axhline(co["bct_min"], color=fs.OURS, label=f"coroutine 2 x 64: {co['bct_min']:,.1f} min")
    a.set_xticks(x, [r["point"] for r in pd_rows])
    a.set_xlabel("P:D (prefill : decode units, 16 GPUs each)")
    a.set_ylabel("batch completion time (min)")
    fs.plain(a.yaxis)
    top = max([r["bct_min"] for r in rows] or [1.0])
    a.set_ylim(0, 1.9 * top)
    a.legend(fontsize=7, loc="upper left")
    a.set_title("BCT; on the bars: BCT / coroutine's", fontsize=9)
    lo, hi = PAPER["bct_min_range"]
    fs.paper_note(a, f"paper: pd_disagg {lo}-{hi} min,\nbest {PAPER['best_ratio']};\nBatchGen "
                     f"{PAPER['batchgen_over_best']}x over it", loc="upper right")
    share_rows = pd_rows + ([co] if co else [])
    fs.share_stack(s, [r["point"].replace("coroutine 2x64", "coroutine\n2 x 64") for r in share_rows], share_rows,
                   horizontal=False)
    s.set_xlabel("P:D (prefill : decode units), and coroutine")
    s.tick_params(axis="x", labelsize=7)
    b.plot(x, [r["prefill_units_running"] for r in pd_rows], "o-", label="prefill units running")
    b.plot(x, [r["decode_units_idle"] for r in pd_rows], "s-", label="decode units waiting for KV")
    b.set_xticks(x, [r["point"] for r in pd_rows])
    b.set_xlabel("P:D (prefill : decode units, 16 GPUs each)")
    b.set_ylabel("share of the job's span")
    b.yaxis.set_major_formatter(PercentFormatter(1.0))
    b.set_ylim(0, 1.05)
    b.set_title("which side waits", fontsize=9)
    b.legend(fontsize=7)
    n = (co or rows[0])["num_sequences"]
    headline = (f"coroutine {best['bct_s'] / co['bct_s']:.2f}x lower BCT than the best P:D ratio ({best['point']}); "
                f"paper: {PAPER['batchgen_over_best']}x over {PAPER['best_ratio']}") if co and best else ""
    fig.suptitle(fs.title("deepseek_r1", "h20_128", "longbench_8k_2k", n, headline), fontsize=10)
    fs.save(fig, out_dir, "pd_disagg")


def report(rows: list[dict]) -> None:
    # prefill run %: share of the span the prefill units ran (the rest: stalled on back-pressure, or no prompt
    # left); decode wait %: share of the span the decode units had nothing to run (waiting for KV); GPU idle %:
    # every rank's time neither computing nor communicating (a decode unit running a small batch is mostly idle)
    print(f"\n{'point':>15} {'BCT min':>8} {'prefill run %':>13} {'decode wait %':>13} {'GPU idle %':>10} "
          f"{'prefill %':>9} {'KV shipped GB':>13} {'recomputes':>10} {'dec. expert batch':>17} {'running':>8}")
    for r in rows:
        print(f"{r['point']:>15} {r['bct_min']:8.1f} {100 * r['prefill_units_running']:13.1f} "
              f"{100 * r['decode_units_idle']:13.1f} {100 * r['gpu_idle_frac']:10.1f} {100 * r['prefill_frac']:9.1f} "
              f"{r['kv_shipped_gb']:13,.0f} {r['recomputes']:10d} {r['decode_expert_batch'] or 0:17.1f} "
              f"{r['mean_running']:8,.0f}")
    pd_rows = [r for r in rows if ":" in r["point"]]
    co = next((r for r in rows if r["point"].startswith("coroutine")), None)
    lo, hi = PAPER["bct_min_range"]
    if pd_rows:
        best = min(pd_rows, key=lambda r: r["bct_s"])
        bcts = [r["bct_min"] for r in pd_rows]
        print(f"\npaper: pd_disagg BCT {lo}-{hi} min over the seven ratios, best {PAPER['best_ratio']}; "
              f"ours: {min(bcts):.1f}-{max(bcts):.1f} min, best {best['point']}")
        if co:
            print(f"paper: BatchGen {PAPER['batchgen_over_best']}x lower BCT than the best ratio; ours: coroutine 2x64 "
                  f"{co['bct_min']:.1f} min, BCT of {best['point']} / coroutine's = {best['bct_s'] / co['bct_s']:.2f}x")


if __name__ == "__main__":
    main()
