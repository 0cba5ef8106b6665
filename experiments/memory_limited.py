"""What module-based batching buys on the paper's memory-limited rig: a b_moe sweep, GPU against CPU attention.

    python experiments/memory_limited.py [--model mixtral_8x7b] [--num-sequences 4000] [--out DIR] [overrides...]

One RTX A5000 (24 GB) with 1 TB of host memory, GSM8K-shaped requests (512 -> 256 tokens). The experts do not
fit on the GPU, so every decode iteration streams them over PCIe; the only way to amortise that is a large
expert batch, which device KV cannot hold. With host-resident KV (kv_residency=host) the running set, and so
the expert batch, is bounded by b_moe and host memory, at the price of restoring each attention micro-batch's
KV over PCIe (attention=gpu) or of reading it from host DRAM on the CPU (attention=cpu). The sweep prints, per
point, BCT, decode throughput, the decode expert batch (tokens per expert), running sequences and the bytes
moved host -> device per iteration, then the planner's own choice (everything `auto`), beside MoE-Gen's measured
decode throughput for the same model and GPU. A CSV and a figure (PNG and PDF) go to --out.
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

MOE_GEN_DECODE_TOK_S = {"mixtral_8x7b": 469.0, "mixtral_8x22b": 91.0}  # MoE-Gen, one A5000, 256-token outputs
B_MOE = [128, 256, 512, 1024, 2048, 4096, 8192]
COLUMNS = ["kv_residency", "attention", "b_moe", "b_attn", "bct_s", "tokens_per_s", "decode_tok_s",
           "decode_expert_batch", "mean_running", "gpu_idle_frac", "prefill_frac"]


def decode_tokens_per_s(row: dict) -> float:
    """Tokens made by decode iterations (the prefill makes each sequence's first) per second of decode."""
    return (row["output_tokens"] - row["num_sequences"]) / row["decode_s"] if row["decode_s"] else 0.0


def run_point(base: list[str], knobs: dict) -> dict:
    cfg = compose("config", overrides=[*base, *(f"policy.{k}={v}" for k, v in knobs.items())])
    out = simulate(build_job(cfg))
    row = summarize(out)
    row.update({k: getattr(out.prepared.policy, k) for k in ("kv_residency", "attention", "b_moe", "b_attn")})
    row["decode_tok_s"] = decode_tokens_per_s(row)
    return row


def plot(rows: list[dict], path: Path, reference: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for attention, marker in (("gpu", "o"), ("cpu", "s")):
        pts = [r for r in rows if r["attention"] == attention and r["kv_residency"] == "host"]
        xs = [r["b_moe"] for r in pts]
        ax1.plot(xs, [r["decode_tok_s"] for r in pts], marker=marker, label=f"host KV, {attention} attention")
        ax2.plot(xs, [r["decode_expert_batch"] for r in pts], marker=marker, label=f"{attention} attention")
    if reference:
        ax1.axhline(reference, color="grey", linestyle="--", label="MoE-Gen (measured)")
    for ax, label in ((ax1, "decode tokens/s"), (ax2, "decode expert batch (tokens/expert)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("b_moe (running sequences)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral_8x7b")
    ap.add_argument("--num-sequences", type=int, default=4000)
    ap.add_argument("--out", default="outputs/memory_limited")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    base = ["+policy=coroutine", f"model={args.model}", "cluster=a5000_1", "workload=gsm8k_512_256",
            f"workload.num_sequences={args.num_sequences}", *args.overrides]
    rows = []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        points = [{"kv_residency": "device", "attention": "gpu", "b_moe": 128, "b_attn": 128}]
        points += [{"kv_residency": "host", "attention": a, "b_moe": b, "b_attn": min(b, 256)}
                   for a in ("gpu", "cpu") for b in B_MOE]
        points.append({})  # the planner's choice
        for knobs in points:
            row = run_point(base, knobs)
            row["planned"] = not knobs
            rows.append(row)
            print(f"{'planned' if not knobs else ''} {row['kv_residency']:>6} {row['attention']} "
                  f"b_moe={row['b_moe']:>5} b_attn={row['b_attn']:>4}: BCT {row['bct_s']:,.0f} s, "
                  f"decode {row['decode_tok_s']:,.1f} tok/s, expert batch {row['decode_expert_batch']:.1f}, "
                  f"running {row['mean_running']:,.0f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "memory_limited.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["planned", *COLUMNS], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    reference = MOE_GEN_DECODE_TOK_S.get(args.model)
    plot(rows, out / "memory_limited", reference)
    small = next(r for r in rows if r["kv_residency"] == "host" and r["attention"] == "gpu" and r["b_moe"] == 128)
    big = next(r for r in rows if r["kv_residency"] == "host" and r["attention"] == "gpu" and r["b_moe"] == 4096)
    print(f"MoE-Gen measured {reference or 'n/a'} decode tok/s for {args.model} on one A5000")
    print(f"files: {out}/memory_limited.csv, .png, .pdf")
    print(f"expert_batch_4096/128={big['decode_expert_batch'] / small['decode_expert_batch']:.1f} "
          f"bct_128/4096={small['bct_s'] / big['bct_s']:.2f}")


if __name__ == "__main__":
    main()
