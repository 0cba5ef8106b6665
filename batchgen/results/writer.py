"""A run's results as files: one JSON summary and CSV tables that any tool (pandas, a spreadsheet) can read.

A job can hold a million sequences and 100K+ boundaries with thousands of ids each, so the tables that grow with
it (sequences, steps, decisions) are written from whole columns (batchgen.results.csvtext), never one Python
object per row; the per-GPU ones (devices, device_timeline) have a fixed size.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Collection

import numpy as np

from batchgen.decisions import FILE_COLUMNS as DECISION_COLUMNS, FILE_ID_COLUMNS, DecisionColumns
from batchgen.results import csvtext
from batchgen.results.metrics import StepArrays, device_table, step_arrays

SEQUENCE_COLUMNS = ("id", "input_len", "output_len", "first_token_s", "finish_s", "instance", "yields",
                    "migrations", "recomputes")
STEP_COLUMNS = ("instance", "start_s", "duration_s", "phase", "iterations", "tokens", "running", "expert_tokens",
                "expert_calls", "busy_mean_s", "busy_max_s")
TABLES = ("sequences.csv", "steps.csv", "devices.csv", "device_timeline.csv", "decisions.csv")


def write_results(out, run_dir: Path, summary: dict[str, Any], config: dict[str, Any] | None = None,
                  skip: Collection[str] = ()) -> dict[str, Path]:
    """results.json and every table of `TABLES` but those in `skip` (conf/config.yaml's output.*_csv switches);
    decisions.csv only where the run recorded decisions, outputs.jsonl only where it generated tokens. The step
    arrays are built once and shared by steps.csv and devices.csv (100K+ records)."""
    unknown = set(skip) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown result tables {sorted(unknown)}: the tables are {', '.join(TABLES)}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    wanted = [name for name in TABLES if name not in skip]
    paths = {name: run_dir / name for name in ("results.json", *wanted)}
    _write_json(paths["results.json"], summary, config)
    steps = step_arrays(out) if {"steps.csv", "devices.csv", "device_timeline.csv"} & set(wanted) else None
    if "sequences.csv" in paths:
        _write_sequences(paths["sequences.csv"], out)
    if "steps.csv" in paths:
        _write_steps(paths["steps.csv"], steps)
    if "devices.csv" in paths:
        _write_devices(paths["devices.csv"], device_table(out, steps))
    if "device_timeline.csv" in paths:
        _write_device_timeline(paths["device_timeline.csv"], out, steps)
    if "decisions.csv" in paths:
        trace = DecisionColumns.of(out.records)
        if len(trace):  # the same in both backends given the same lengths: diff two runs' files to see where they part
            _write_decisions(paths["decisions.csv"], trace)
        else:
            del paths["decisions.csv"]
    if getattr(out, "tokens", None) is not None:  # the executor's generated tokens, in input order
        paths["outputs.jsonl"] = run_dir / "outputs.jsonl"
        _write_outputs(paths["outputs.jsonl"], out)
    return paths


def _write_json(path: Path, summary: dict[str, Any], config: dict[str, Any] | None) -> None:
    doc = dict(summary)
    if config is not None:
        doc["config"] = config
    # default=str: a config may carry a Path or an enum; the summary itself is plain already.
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _write_sequences(path: Path, out) -> None:
    t = out.prepared.state.table
    cols = (np.arange(len(t)), t.input_len, t.output_len, t.first_token_time, t.finish_time, t.instance,
            t.yields, t.migrations, t.recomputes)
    fmt = ["%d", "%d", "%d", "%.6f", "%.6f", "%d", "%d", "%d", "%d"]
    _write_table(path, SEQUENCE_COLUMNS, fmt, cols)


def _write_steps(path: Path, s: StepArrays) -> None:
    ranks = max(s.busy.shape[1], 1)
    busy_mean = s.busy.sum(axis=1) / ranks
    busy_max = s.busy.max(axis=1, initial=0.0)
    cols = (s.instance, s.start, s.duration, s.phase, s.iterations, s.tokens, s.running, s.expert_tokens,
            s.expert_calls, busy_mean, busy_max)
    fmt = ["%d", "%.6f", "%.6f", "%s", "%d", "%d", "%d", "%.1f", "%d", "%.6f", "%.6f"]
    _write_table(path, STEP_COLUMNS, fmt, cols)


def _write_table(path: Path, header, fmt, cols) -> None:
    with path.open("w", newline="") as fh:
        fh.write(",".join(header) + "\n")
        csvtext.formatted(fh, fmt, cols)


def _write_devices(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["gpu"])
        w.writeheader()
        w.writerows(rows)


def _write_device_timeline(path: Path, out, steps, bins: int = 100) -> None:
    """Each GPU's busy and communication share in `bins` equal slices of the run (long format: bin, gpu).

    Per-step, per-GPU rows would be millions for a large job; slices keep the shape of the timeline (which
    GPUs idled when) at a fixed size. A step's seconds are spread over the slices it overlaps, pro rata."""
    topo = out.prepared.state.topo
    horizon = max(float(steps.end.max(initial=0.0)), 1e-12)
    edges = np.linspace(0.0, horizon, bins + 1)
    overlap = np.clip(np.minimum(steps.end[:, None], edges[None, 1:])
                      - np.maximum(steps.start[:, None], edges[None, :-1]), 0.0, None)
    share = overlap / np.maximum(steps.duration, 1e-300)[:, None]   # (steps x bins), rows sum to 1
    busy = np.zeros((bins, topo.num_gpus))
    comm = np.zeros((bins, topo.num_gpus))
    for inst in range(topo.num_instances):
        mine = steps.instance == inst
        gpus = topo.instance_gpus(inst)
        busy[:, gpus] = share[mine].T @ steps.busy[mine]
        comm[:, gpus] = share[mine].T @ steps.comm[mine]
    width = horizon / bins
    b, g = np.meshgrid(np.arange(bins), np.arange(topo.num_gpus), indexing="ij")
    cols = (b.ravel(), edges[:-1][b.ravel()], g.ravel(), busy.ravel() / width, comm.ravel() / width)
    np.savetxt(path, np.column_stack(cols), fmt=["%d", "%.6f", "%d", "%.4f", "%.4f"], delimiter=",",
               header="bin,start_s,gpu,busy_frac,comm_frac", comments="")


def _write_decisions(path: Path, trace: DecisionColumns) -> None:
    """One row per boundary, id sets as ranges ("0-15 18"), the running sets as their changes
    (`DecisionColumns`); `batchgen.decisions.read_decisions` reads it back as the trace."""
    k = len(trace)
    cells: dict[str, csvtext.Cells] = {"boundary": csvtext.Numbers(np.arange(k))}
    for f, values in trace.scalars.items():
        cells[f] = csvtext.Numbers(values) if values.dtype.kind in "iu" else csvtext.Strings(values.tolist())
    for f in FILE_ID_COLUMNS:
        cells[f] = csvtext.Ranges(*trace.ids[f])
    names = ["boundary", *DECISION_COLUMNS]
    csvtext.write(path, names, [cells[n] for n in names])


def _write_outputs(path: Path, out) -> None:
    tokens = out.tokens
    with path.open("w") as f:
        for sid in range(len(tokens.prompts)):
            row = {"id": sid, "prompt_tokens": int(len(tokens.prompts[sid])),
                   "output_token_ids": tokens.generated[sid], "finish_reason": tokens.finish_reason(sid)}
            text = tokens.text(sid)
            if text is not None:
                row["text"] = text
            f.write(json.dumps(row) + "\n")
