"""A sweep's runs side by side: one CSV row per run, a figure, and the summary table grouped.

A sweep (`python -m batchgen.experiment -m ...`) writes one numbered job directory per run, each with the
Hydra overrides it ran with (`.hydra/overrides.yaml`) and its `results.json`, or `error.txt` when the run was
impossible. The *swept keys* are the override keys whose value differs between jobs, named as typed on the
command line without the `+`/`++`/`~` prefix (`policy`, `model`, `cluster.num_gpus`). A *group* is the runs
that share the value of every swept key except the policy: policies are compared only within a group (never a
DeepSeek-R1 run against a Qwen3 run), and a group with a single run shows no ratio.

`summarize_sweep(sweep_dir)` writes `sweep.csv`, `sweep.png` and `sweep.pdf` into the sweep directory and
returns the printed text; `load_sweep` and `group_runs` are the parts it is made of.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.results.summary import explain, format_table

ERROR_FILE = "error.txt"
POLICY_KEY = "policy"
# Identity fields of results.json that tell runs apart when a job has no .hydra/overrides.yaml
# (hydra.output_subdir=null): the swept keys are then guessed from these.
FALLBACK_KEYS = ("policy", "model", "cluster", "num_gpus", "num_instances", "workload", "num_sequences")
# The first metric columns of sweep.csv, in this order; every other scalar of results.json follows, sorted.
METRIC_ORDER = ("bct_s", "bct_vs_group_best", "group_best", "tokens_per_s", "tokens_per_s_per_gpu",
                "gpu_busy_frac", "gpu_comm_frac", "gpu_idle_frac", "tail_idle_frac", "prefill_frac",
                "mean_expert_batch", "decode_expert_batch", "mean_running", "mean_gate_tokens",
                "host_bytes_per_decode_iter", "host_gb_per_decode_iter", "yields", "migrations", "partitions",
                "recomputes", "sct_p50_s", "sct_p99_s", "output_tokens", "prompt_tokens", "prefill_tokens_submitted",
                "prefill_tokens_distinct", "prefill_tokens_computed", "prefill_tokens_shared", "prefix_hit_rate",
                "kv_bytes_read_per_decode_iter")


@dataclass
class Run:
    """One job of the sweep: its directory name, the overrides it ran with, and its results or its error."""

    name: str
    overrides: dict[str, str]
    results: dict[str, Any] | None = None
    error: str | None = None
    keys: dict[str, str] = field(default_factory=dict)  # the swept keys' values (set by load_sweep)

    @property
    def ok(self) -> bool:
        return self.results is not None

    @property
    def policy(self) -> str:
        if self.results is not None and self.results.get("policy") is not None:
            return str(self.results["policy"])
        return self.keys.get(POLICY_KEY) or self.overrides.get(POLICY_KEY) or "?"


@dataclass
class Group:
    """Runs that share every swept key's value but the policy's; `label` names those values."""

    values: dict[str, str]
    runs: list[Run]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items()) or "all runs"


def parse_override(text: str) -> tuple[str, str]:
    """`+policy=coroutine` -> ("policy", "coroutine"); `~key` -> ("key", "(deleted)")."""
    text = text.strip()
    if text.startswith("~"):
        key, _, value = text[1:].partition("=")
        return key.strip(), f"(deleted{' ' + value if value else ''})"
    key, _, value = text.lstrip("+").partition("=")
    return key.strip(), value.strip()


def _read_overrides(job: Path) -> dict[str, str] | None:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf  # a list of strings; OmegaConf reads it without PyYAML's tag surprises

    items = OmegaConf.to_container(OmegaConf.load(path)) or []
    return dict(parse_override(str(item)) for item in items)


def job_dirs(sweep_dir: Path) -> list[Path]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def load_sweep(sweep_dir: Path) -> tuple[list[Run], list[str]]:
    """Every job of the sweep, and the swept keys (in the order they were typed)."""
    runs, guessed = [], False
    for job in job_dirs(sweep_dir):
        overrides = _read_overrides(job)
        results = error = None
        if (job / "results.json").is_file():
            results = json.loads((job / "results.json").read_text())
            results.pop("config", None)
        if (job / ERROR_FILE).is_file():
            error = (job / ERROR_FILE).read_text().strip() or "failed"
        elif results is None:
            error = "no results.json (the run did not finish)"
        if overrides is None:
            guessed = True
            overrides = {k: str(results[k]) for k in FALLBACK_KEYS if results and results.get(k) is not None}
        runs.append(Run(job.name, overrides, results, error if results is None else None))
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.overrides if k not in keys]
    swept = [k for k in keys if len({run.overrides.get(k) for run in runs}) > 1]
    if guessed and POLICY_KEY not in swept and len({r.policy for r in runs}) > 1:
        swept.insert(0, POLICY_KEY)
    for run in runs:
        run.keys = {k: run.overrides.get(k, "") for k in swept}
    return runs, swept


def group_runs(runs: list[Run], swept: list[str]) -> list[Group]:
    """Runs grouped by the value of every swept key but the policy, groups and runs in job order; each run
    with results gets `bct_vs_group_best` (its BCT over the group's best) and `group_best` when its group has
    at least two runs with a BCT."""
    others = [k for k in swept if k != POLICY_KEY]
    groups: dict[tuple[str, ...], Group] = {}
    for run in runs:
        values = tuple(run.keys.get(k, "") for k in others)
        groups.setdefault(values, Group(dict(zip(others, values)), [])).runs.append(run)
    for group in groups.values():
        done = [r for r in group.runs if r.ok and r.results.get("bct_s")]
        for run in group.runs:
            if run.ok:
                run.results.pop("bct_vs_group_best", None)
                run.results.pop("group_best", None)
        if len(done) < 2:
            continue
        best = min(done, key=lambda r: r.results["bct_s"])
        for run in done:
            run.results["bct_vs_group_best"] = run.results["bct_s"] / best.results["bct_s"]
            run.results["group_best"] = f"{best.policy} (run {best.name})"
    return list(groups.values())


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def csv_rows(groups: list[Group], swept: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """The header and one row per run: run, group, every swept key, the policy, error, then the metrics."""
    runs = [run for g in groups for run in g.runs]
    metrics: list[str] = []
    for run in runs:
        metrics += [k for k, v in (run.results or {}).items() if _scalar(v) and k not in metrics]
    if any(run.ok and run.results.get("host_bytes_per_decode_iter") is not None for run in runs):
        metrics.append("host_gb_per_decode_iter")
    # A results field named like a swept key (model, cluster, policy) is kept only where it says something
    # else than the override (e.g. the model's name when the override was model.path=...).
    clash = [k for k in metrics if k in swept or k == POLICY_KEY]
    differs = {k for k in clash if any(run.ok and k in run.results and str(run.results[k]) != (
        run.keys.get(k) if k in swept else run.policy) for run in runs)}
    metrics = [k for k in metrics if k not in clash] + [f"result.{k}" for k in clash if k in differs]
    ordered = [k for k in METRIC_ORDER if k in metrics or k in ("bct_vs_group_best", "group_best")]
    header = ["run", "group", *swept, *([] if POLICY_KEY in swept else [POLICY_KEY]), "error", *ordered,
              *sorted(k for k in metrics if k not in ordered)]
    rows = []
    for group in groups:
        for run in group.runs:
            row: dict[str, Any] = {"run": run.name, "group": group.label, **run.keys, POLICY_KEY: run.policy,
                                   "error": run.error or ""}
            res = run.results or {}
            for k in header[len(row):]:
                if k == "host_gb_per_decode_iter" and res.get("host_bytes_per_decode_iter") is not None:
                    row[k] = res["host_bytes_per_decode_iter"] / 1e9
                elif k.startswith("result."):
                    row[k] = res.get(k[len("result."):], "")
                else:
                    row[k] = res.get(k, "")
            rows.append(row)
    return header, rows


def write_csv(path: Path, header: list[str], rows: list[dict[str, Any]]) -> Path:
    with Path(path).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def plot_sweep(groups: list[Group], paths: list[Path]) -> list[Path]:
    """Write the sweep's figure (see `sweep_figure`) to each of `paths` (sweep.png, sweep.pdf)."""
    import matplotlib.pyplot as plt

    fig = sweep_figure(groups)
    for path in paths:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return list(paths)


def sweep_figure(groups: list[Group]):
    """BCT per policy, one panel per group (each with its own scale: groups may differ by 100x), the ratio to
    the group's best above each bar, and under it how each run's GPU time split into compute, communication
    and idle; failed runs are marked where their bar would be. The title names the model, cluster, workload
    and request count (a panel's own when they differ between groups), so the figure stands alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from batchgen.results.plot import plain_seconds

    n = max(len(groups), 1)
    cols = min(n, 3)
    rows = -(-n // cols)
    width = max(len(g.runs) for g in groups) if groups else 1
    fig, axes = plt.subplots(2 * rows, cols, figsize=(max(5.5, 1.2 * width + 2.0) * cols, 5.6 * rows),
                             squeeze=False, constrained_layout=True,
                             gridspec_kw={"height_ratios": [2, 1] * rows})
    bct_axes = [axes[2 * (i // cols), i % cols] for i in range(rows * cols)]
    share_axes = [axes[2 * (i // cols) + 1, i % cols] for i in range(rows * cols)]
    for ax in bct_axes[len(groups):] + share_axes[len(groups):]:
        ax.set_visible(False)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    policies: list[str] = []
    for g in groups:
        policies += [r.policy for r in g.runs if r.policy not in policies]
    common = job_identity([run for g in groups for run in g.runs])
    for ax, shares, group in zip(bct_axes, share_axes, groups):
        names = [run.policy if sum(r.policy == run.policy for r in group.runs) == 1
                 else f"{run.policy}\n(run {run.name})" for run in group.runs]
        bcts = [run.results.get("bct_s") or 0.0 if run.ok else 0.0 for run in group.runs]
        top = max(bcts) if any(bcts) else 1.0
        bars = ax.bar(range(len(group.runs)), bcts,
                      color=[colors[policies.index(r.policy) % len(colors)] for r in group.runs])
        for i, (bar, run) in enumerate(zip(bars, group.runs)):
            if not run.ok:
                ax.text(i, 0.02 * top, "failed", ha="center", va="bottom", rotation=90, color="firebrick")
                continue
            ratio = run.results.get("bct_vs_group_best")
            text = (f"{seconds_text(run.results.get('bct_s') or 0.0)} s"
                    + (f"\n{ratio:.2f}x" if ratio is not None else ""))
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(range(len(group.runs)), names, fontsize=9)
        ax.set_ylim(0, 1.3 * top)
        ax.set_ylabel("batch completion time (s)")
        plain_seconds(ax.yaxis)
        own = job_identity(group.runs)
        ax.set_title("\n".join(t for t in (group.label if group.values else "", own if own != common else "") if t)
                     or None, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        _draw_shares(shares, group.runs, names)
    fig.suptitle(f"Batch completion time per policy (lower is better; ratio to the group's best)\n{common}",
                 fontsize=10)
    return fig


def _draw_shares(ax, runs: list[Run], names: list[str]) -> None:
    """Each run's GPU time stacked as compute, communication and idle (results.json's gpu_*_frac)."""
    x = range(len(runs))
    bottom = [0.0] * len(runs)
    for key, label, color in (("gpu_busy_frac", "compute", "tab:blue"), ("gpu_comm_frac", "communication", "tab:red"),
                              ("gpu_idle_frac", "idle", "0.8")):
        values = [float(r.results.get(key) or 0.0) if r.ok else 0.0 for r in runs]
        ax.bar(x, values, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of GPU time")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(runs) > 1 else -0.2),
              frameon=False)


def job_identity(runs: list[Run]) -> str:
    """'model | cluster | workload, N requests' of the runs that finished; a field that differs lists its values."""
    done = [r.results for r in runs if r.ok]
    if not done:
        return ""

    def field_text(key: str) -> str:
        values = list(dict.fromkeys(str(res.get(key, "?")) for res in done))
        return " / ".join(values)

    counts = list(dict.fromkeys(res.get("num_sequences") for res in done))
    requests = " / ".join(f"{c:,}" if isinstance(c, int) else str(c) for c in counts)
    return f"{field_text('model')} | {field_text('cluster')} | {field_text('workload')}, {requests} requests"


def seconds_text(x: float) -> str:
    """Seconds as a plain number: 1,120 / 12.3 / 0.0456, never 1.12e+03."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.1f}"
    return f"{x:.4f}".rstrip("0").rstrip(".") if x else "0"


def _short(error: str | None, limit: int = 100) -> str:
    """An error's first line, cut to fit beside the table (the whole one is in sweep.csv and on stderr)."""
    line = (error or "failed").splitlines()[0]
    return line if len(line) <= limit else line[:limit].rstrip() + "... (see sweep.csv)"


def format_sweep(groups: list[Group]) -> str:
    """One table, its rows grouped under a line naming each group, then each group's explanation."""
    done = [run for g in groups for run in g.runs if run.ok]
    table = format_table([run.results for run in done]).splitlines() if done else []
    header, body = table[:2], iter(table[2:])
    lines = list(header)
    notes: list[str] = []
    for group in groups:
        if len(groups) > 1 or group.values:
            lines.append(f"[{group.label}]")
        for run in group.runs:
            lines.append(next(body) if run.ok else f"{run.policy}: run {run.name} failed: {_short(run.error)}")
        text = explain([run.results for run in group.runs if run.ok])
        if text:
            notes += ([f"[{group.label}]"] if len(groups) > 1 or group.values else []) + text.splitlines()
    out = "\n".join(lines)
    if notes:
        out += "\n\n" + "\n".join(notes)
    return out


def summarize_sweep(sweep_dir: Path, plot: bool = True) -> tuple[str, list[Run]]:
    """Write sweep.csv (and sweep.png, sweep.pdf) into the sweep directory; return the grouped table as text
    and the runs (failed ones have `error`)."""
    sweep_dir = Path(sweep_dir)
    runs, swept = load_sweep(sweep_dir)
    if not runs:
        return "", runs
    groups = group_runs(runs, swept)
    header, rows = csv_rows(groups, swept)
    written = [write_csv(sweep_dir / "sweep.csv", header, rows)]
    if plot:
        written += plot_sweep(groups, [sweep_dir / "sweep.png", sweep_dir / "sweep.pdf"])
    n_groups = f"{len(groups)} group{'s' if len(groups) != 1 else ''}"
    head = (f"{len(runs)} run{'s' if len(runs) != 1 else ''}, {n_groups}"
            f" (swept: {', '.join(swept) or 'nothing'}; policies compared within a group only)")
    text = head + "\n" + format_sweep(groups)
    text += "\nwritten: " + ", ".join(str(p) for p in written)
    return text, runs
