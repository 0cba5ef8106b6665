"""Runs side by side, as a fixed-width table and as sentences that say why one run's BCT is worse.

The sentences are built only from the numbers in the rows: a clause appears when its metric differs from the
best run's by more than a threshold, so the explanation points at what actually changed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

Row = dict[str, Any]

# (header, key, formatter) for each column of the table.
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("policy", "policy", str),
    ("gpus", "num_gpus", str),
    ("inst", "num_instances", str),
    ("BCT s", "bct_s", lambda v: f"{v:.2f}" if v < 10 else f"{v:.1f}"),
    ("x best", "bct_vs_group_best", lambda v: f"{v:.2f}x"),  # sweeps: BCT / the best BCT of the run's group
    ("spread %", "bct_spread", lambda v: f"{100 * v:.1f}"),   # executor repeats: (max - min) / median BCT
    ("tok/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("busy %", "gpu_busy_frac", lambda v: f"{100 * v:.1f}"),
    ("comm %", "gpu_comm_frac", lambda v: f"{100 * v:.1f}"),
    ("idle %", "gpu_idle_frac", lambda v: f"{100 * v:.1f}"),
    ("tail idle %", "tail_idle_frac", lambda v: f"{100 * v:.1f}"),
    ("prefill %", "prefill_frac", lambda v: f"{100 * v:.1f}"),
    ("mixed %", "mixed_frac", lambda v: f"{100 * v:.1f}"),  # forwards with prompt chunks beside decodes
    ("expert batch", "mean_expert_batch", lambda v: f"{v:.1f}"),
    ("decode expert batch", "decode_expert_batch", lambda v: f"{v:.1f}"),
    ("running", "mean_running", lambda v: f"{v:,.0f}"),
    ("gate tokens", "mean_gate_tokens", lambda v: f"{v:,.0f}"),
    ("host GB/iter", "host_bytes_per_decode_iter", lambda v: f"{v / 1e9:,.1f}"),
    ("prefill tok", "prefill_tokens_submitted", lambda v: f"{v:,}"),  # shown only where a prefix is shared
    ("distinct tok", "prefill_tokens_distinct", lambda v: f"{v:,}"),
    ("computed tok", "prefill_tokens_computed", lambda v: f"{v:,}"),
    ("KV GB/iter", "kv_bytes_read_per_decode_iter", lambda v: f"{v / 1e9:,.2f}"),
    ("yields", "yields", str),
    ("migrations", "migrations", str),
    ("recomputes", "recomputes", str),
]

IDLE_POINTS = 0.02      # idle / tail / comm shares must differ by 2 points of GPU-time to be mentioned
BATCH_RATIO = 0.9       # an expert batch under 90% of the best run's is mentioned
SAME_BCT = 1.005        # within 0.5% counts as the same BCT
WORK_RATIO = 1.05       # 5% more compute per output token is mentioned


def _cell(row: Row, key: str, fmt: Callable[[Any], str]) -> str:
    value = row.get(key)
    return "-" if value is None else fmt(value)


# Always shown; any other column that no row has a value for (the executor's spread in a simulated run, the
# ratio outside a sweep) is left out.
KEEP = ("policy", "bct_s")
# Every results.json has these; they are shown only when some run's workload shares a prefix, so a table of
# runs that share nothing stays as narrow as before.
SHARING = ("prefill_tokens_submitted", "prefill_tokens_distinct", "prefill_tokens_computed",
           "kv_bytes_read_per_decode_iter")


def shares_prefix(row: Row) -> bool:
    """The run's workload has prefix groups that save prefill: fewer distinct prompt tokens than submitted."""
    submitted, distinct = row.get("prefill_tokens_submitted"), row.get("prefill_tokens_distinct")
    return submitted is not None and distinct is not None and distinct < submitted


def format_table(rows: list[Row]) -> str:
    """Fixed width, one line per run; every header is defined in docs/simulator.md (The summary table)."""
    sharing = any(shares_prefix(r) for r in rows)
    columns = [c for c in COLUMNS if c[1] in KEEP or (c[1] not in SHARING or sharing)
               and any(r.get(c[1]) is not None for r in rows)]
    cells = [[h for h, _, _ in columns]] + [[_cell(r, k, f) for _, k, f in columns] for r in rows]
    widths = [max(len(line[j]) for line in cells) for j in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


QUALIFIERS = (("num_gpus", "{}gpu"), ("num_instances", "{}inst"), ("cluster", "{}"), ("model", "{}"),
              ("workload", "{}"))
# Runs are compared only with runs of the same job on the same GPUs: the same values of these (how the GPUs
# are split into instances is the policy's choice, so runs with different instance counts are compared).
SAME_JOB = ("model", "cluster", "gpu", "num_gpus", "workload", "num_sequences", "backend")


def labels(rows: list[Row]) -> list[str]:
    """The policy name, qualified by whatever tells apart runs of the same policy (GPUs, instances, ...)."""
    names = [str(r.get("policy")) for r in rows]
    out = []
    for name, row in zip(names, rows):
        group = [r for n, r in zip(names, rows) if n == name]
        quals = [fmt.format(row.get(k)) for k, fmt in QUALIFIERS if len({str(r.get(k)) for r in group}) > 1]
        out.append("@".join([name, *quals]))
    dup = Counter(out)
    return [lab if dup[lab] == 1 else f"{lab}#{i}" for i, lab in enumerate(out)]


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def _compute_per_token(row: Row) -> float | None:
    """GPU compute-seconds per output token: catches runs that are busy but get less done per second."""
    keys = ("gpu_busy_frac", "num_gpus", "bct_s", "output_tokens")
    if any(row.get(k) is None for k in keys) or not row["output_tokens"]:
        return None
    return row["gpu_busy_frac"] * row["num_gpus"] * row["bct_s"] / row["output_tokens"]


def _reasons(row: Row, best: Row, best_name: str) -> list[str]:
    """Clauses for the metrics in which `row` is worse than the best run by a noticeable margin."""
    out = []
    if row.get("num_gpus") != best.get("num_gpus"):
        out.append(f"{row.get('num_gpus')} GPUs vs {best.get('num_gpus')}")
    work, best_work = _compute_per_token(row), _compute_per_token(best)
    if work and best_work and work > WORK_RATIO * best_work:
        out.append(f"{work / best_work:.2f}x the GPU compute-seconds per output token")
    idle, best_idle = row.get("gpu_idle_frac"), best.get("gpu_idle_frac")
    if idle is not None and best_idle is not None and idle > best_idle + IDLE_POINTS:
        out.append(f"its GPUs sat idle {_pct(idle)} of the time ({best_name} {_pct(best_idle)})")
    tail, best_tail = row.get("tail_idle_frac") or 0.0, best.get("tail_idle_frac") or 0.0
    if tail > best_tail + IDLE_POINTS:
        out.append(f"{_pct(tail)} of GPU-time after its instance drained ({best_name} {_pct(best_tail)})")
    comm, best_comm = row.get("gpu_comm_frac") or 0.0, best.get("gpu_comm_frac") or 0.0
    if comm > best_comm + IDLE_POINTS:
        out.append(f"{_pct(comm)} of GPU-time in communication ({best_name} {_pct(best_comm)})")
    pre, best_pre = row.get("prefill_frac") or 0.0, best.get("prefill_frac") or 0.0
    if pre > best_pre + IDLE_POINTS and pre * row["bct_s"] > best_pre * best["bct_s"]:
        out.append(f"{_pct(pre)} of its time in forwards that prefill, stalling decode on every rank "
                   f"({best_name} {_pct(best_pre)})")
    batch, best_batch = row.get("mean_expert_batch"), best.get("mean_expert_batch")
    if batch is not None and best_batch and batch < BATCH_RATIO * best_batch:
        out.append(f"expert batch {batch:.0f} vs {best_batch:.0f} tokens/expert")
    if (row.get("recomputes") or 0) > (best.get("recomputes") or 0):
        out.append(f"{row['recomputes']} recomputed sequences ({best_name} {best.get('recomputes') or 0})")
    return out


def _overlap(row: Row, best: Row) -> bool:
    """Both repeated (executor runs) and their BCT ranges overlap: the medians' order may not hold."""
    keys = ("bct_min_s", "bct_max_s")
    if any(r.get(k) is None for r in (row, best) for k in keys) or (row.get("repeats") or 1) < 2:
        return False
    return row["bct_min_s"] <= best["bct_max_s"]


def _line(name: str, row: Row, best: Row, best_name: str) -> str:
    ratio = row["bct_s"] / best["bct_s"]
    head = f"{name}: {ratio:.2f}x the BCT of {best_name}"
    if ratio <= SAME_BCT:
        return head + " (the same, within 0.5%)"
    if _overlap(row, best):
        head += (f" (within noise: repeats ranged {row['bct_min_s']:.1f}-{row['bct_max_s']:.1f} s and "
                 f"{best['bct_min_s']:.1f}-{best['bct_max_s']:.1f} s)")
    reasons = _reasons(row, best, best_name)
    if not reasons:
        reasons = [f"no single metric stands out (busy {_pct(row.get('gpu_busy_frac') or 0.0)} vs "
                   f"{_pct(best.get('gpu_busy_frac') or 0.0)})"]
    return head + "; " + ", ".join(reasons)


def explain(rows: list[Row]) -> str:
    """Each run against the best BCT among the runs of the same job (same model, cluster, GPUs, workload,
    backend): never one model's run against another model's. A job with one run says nothing."""
    runs = [(n, r) for n, r in zip(labels(rows), rows) if r.get("bct_s")]
    groups: dict[tuple[str, ...], list[tuple[str, Row]]] = {}
    for name, row in runs:
        groups.setdefault(tuple(str(row.get(k)) for k in SAME_JOB), []).append((name, row))
    lines: list[str] = []
    for group in groups.values():
        if len(group) < 2:
            continue
        best_name, best = min(group, key=lambda nr: nr[1]["bct_s"])
        lines.append(f"{best_name}: best BCT, {best['bct_s']:.1f} s")
        lines += [_line(n, r, best, best_name) for n, r in group if n != best_name]
    return "\n".join(lines)
