"""What every experiment figure shares, so that a reader of the paper checks it at a glance: readable names
for the configs (never a raw Hydra string), a title naming model, cluster, workload, request count and
"simulated", plain numbers with thousands separators (never 1e+03), bars with the ratio written on them and the
paper's number beside ours, and GPU time stacked as compute, communication and idle.

    from experiments.figure_style import figure, ratio_bars, share_stack, save
"""

from __future__ import annotations

from pathlib import Path

MODELS = {"deepseek_r1": "DeepSeek-R1", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3",
          "mixtral_8x7b": "Mixtral-8x7B", "mixtral_8x22b": "Mixtral-8x22B", "kimi_k2": "Kimi-K2",
          "qwen3_235b_a22b": "Qwen3-235B-A22B", "qwen3_30b_a3b": "Qwen3-30B-A3B"}
WORKLOADS = {"longbench_8k_2k": "LongBench 8K->2K", "longbench_2k_8k": "LongBench 2K->8K",
             "longbench_12k_4k": "LongBench 12K->4K", "longbench_6_5k_2_8k": "LongBench 6.5K->2.8K",
             "gsm8k_512_256": "GSM8K 512->256", "chatbotarena_256_512": "ChatBotArena 256->512",
             "rl_rollout": "RL rollout"}
GPUS = {"h20": "H20", "h200": "H200", "h100": "H100", "a100": "A100", "a5000": "RTX A5000"}
SHARES = (("gpu_busy_frac", "compute", "tab:blue"), ("gpu_comm_frac", "communication", "tab:red"),
          ("gpu_idle_frac", "idle", "0.8"))
OURS = "tab:blue"
OTHERS = "tab:gray"
PAPER_COLOR = "tab:green"


def model_name(key: str) -> str:
    return MODELS.get(key, key)


def workload_name(key: str) -> str:
    return WORKLOADS.get(key, key)


def cluster_name(key: str) -> str:
    """'h20_8' -> '8 x H20', 'a5000_1' -> '1 x RTX A5000'."""
    gpu, _, n = key.rpartition("_")
    return f"{n} x {GPUS.get(gpu, gpu.upper())}" if n.isdigit() and gpu else key


def title(model: str, cluster: str, workload: str, requests: str | int, headline: str = "") -> str:
    """'DeepSeek-R1 on 128 x H20, LongBench 12K->4K, 10,000 requests (simulated)', and the headline (ours
    against the paper's) on a second line."""
    n = f"{int(requests):,}" if isinstance(requests, (int, float)) else requests
    return (f"{model_name(model)} on {cluster_name(cluster)}, {workload_name(workload)}, {n} requests (simulated)"
            + (f"\n{headline}" if headline else ""))


def plain(axis) -> None:
    """Tick labels as plain numbers with thousands separators: 12,000, never 1.2e+04."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda x, _: number(x)))
    axis.set_minor_formatter(NullFormatter())


def number(x: float) -> str:
    if x != x:  # nan
        return "-"
    if abs(x) >= 100 or x == int(x):
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:,.1f}"
    return f"{x:.3g}"


def figure(ncols: int, width: float = 5.0, height: float = 4.2, **kw):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False, constrained_layout=True, **kw)
    return fig, list(axes[0])


def ratio_bars(ax, labels: list[str], values: list[float], ref: int, unit: str, paper: dict[int, str] | None = None,
               colors: list[str] | None = None, log: bool = False, ratios: bool = True) -> None:
    """Horizontal bars (first label on top) with each value and (`ratios`) its ratio to values[ref] written on
    the bar ("5,603 s, 1.77x"), and the paper's number beside the bars named in `paper` (index -> text)."""
    y = list(range(len(labels)))
    colors = colors or [OURS if i == ref else OTHERS for i in y]
    ranked = sorted((v for v in values if v == v), reverse=True)
    top = ranked[0] if ranked else 1.0
    # one bar over 3x all the others (static batching's 12x) is cut at the axis' end, so the others stay readable
    cut = not log and len(ranked) > 2 and top > 3 * ranked[1]
    if cut:
        top = ranked[1]
    ax.barh(y, [min(v, 1.75 * top) for v in values] if cut else values, color=colors)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    base = values[ref]
    for i, v in enumerate(values):
        if v != v:
            ax.text(0, i, "  did not run", va="center", fontsize=8, color="firebrick")
            continue
        text = f" {number(v)}{' ' + unit if unit else ''}"
        if ratios:
            text += f", {v / base:.2f}x" if i != ref and base else " (reference)"
        if cut and v > 1.75 * top:
            ax.text(1.75 * top, i, text.strip() + " (bar cut) ", va="center", ha="right", fontsize=8, color="white",
                    fontweight="bold")
            continue
        if paper and i in paper:
            ax.text(v, i, text + "\n", va="center", fontsize=8, fontweight="bold")
            ax.text(v, i, f"\n  paper: {paper[i]}", va="center", fontsize=8, color=PAPER_COLOR, fontweight="bold")
            continue
        ax.text(v, i, text, va="center", fontsize=8)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(right=top * 60)
    else:
        ax.set_xlim(0, top * 1.75)
        plain(ax.xaxis)
    ax.grid(axis="x", alpha=0.3)


def share_stack(ax, labels: list[str], rows: list[dict], horizontal: bool = True, legend: bool = True) -> None:
    """Each row's GPU time stacked as compute / communication / idle (summaries' gpu_*_frac; compute is the
    rest when gpu_busy_frac is missing), the shares written inside segments wide enough to hold them."""
    from matplotlib.ticker import PercentFormatter

    pos = list(range(len(labels)))
    start = [0.0] * len(rows)
    for key, name, color in SHARES:
        vals = []
        for r in rows:
            v = r.get(key)
            if (v is None or v == "") and key == "gpu_busy_frac":
                v = 1.0 - float(r.get("gpu_comm_frac") or 0) - float(r.get("gpu_idle_frac") or 0)
            vals.append(float(v or 0.0))
        if horizontal:
            ax.barh(pos, vals, left=start, color=color, label=name)
        else:
            ax.bar(pos, vals, bottom=start, color=color, label=name)
        for p, s, v in zip(pos, start, vals):
            if v >= 0.08:
                xy = (s + v / 2, p) if horizontal else (p, s + v / 2)
                ax.text(*xy, f"{v:.0%}", ha="center", va="center", fontsize=7,
                        color="white" if color != "0.8" else "black")
        start = [s + v for s, v in zip(start, vals)]
    if horizontal:
        ax.set_yticks(pos, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel("share of GPU time")
    else:
        ax.set_xticks(pos, labels, fontsize=8)
        ax.set_ylim(0, 1)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylabel("share of GPU time")
    if legend:
        ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)


def paper_note(ax, text: str, loc: str = "lower right") -> None:
    """The paper's number in a box in a corner of the panel."""
    x, ha = (0.98, "right") if "right" in loc else (0.02, "left")
    y, va = (0.02, "bottom") if "lower" in loc else (0.98, "top")
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va, fontsize=8, color=PAPER_COLOR,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": PAPER_COLOR, "alpha": 0.9})


def save(fig, out: Path, stem: str) -> list[Path]:
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths
