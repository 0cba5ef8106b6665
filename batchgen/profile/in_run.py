"""The profile's in-run stage: the grid times each module alone; inside a real run the same module is slower.

Alone, a module's weights and KV stay in the caches from one repeat to the next; in a run the rest of the
model passes through them in between (tiny_moe's 58 MB against a 32 MB L3), sampling and token bookkeeping
work per sequence, and the engine does its own work between forwards. So the profiler also runs the executor
on a short calibration job (conf/workload/calibration.yaml: uniform lengths, unlike every workload validation
checks), predicts the same job with the table built from the grid (the executor's capabilities and KV pool,
hence the same decisions), and keeps, per module kind, the ratio of the time measured inside the runs to the
time predicted: attention, ffn (router and experts), head (LM head and sampling) and step (everything else a
run lasts: the engine's per-forward and per-boundary work). `TablePredictor` multiplies by these ratios.

Attention has two ratios, one for decode and one for prefill (the runs' decode and prefill records), besides the
combined one: the two move apart within one executor run (benchmarks/results/code_figures.md), so one ratio fitted to
the calibration workload's mix misprices each phase by an amount that depends on each workload's prefill share. The
FFN's calls move apart the same way with their size (a decode forward of a few dozen tokens against a whole-prompt
prefill of thousands): it has a ratio for each phase too, with each phase's tokens per forward, and the table
interpolates between them by the call's size.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from batchgen.compare import Case, compare, measure_rounds, side_of

# module kinds with a ratio: attention over all records, and apart in decode and in prefill records
SCALED = ("attention", "attention_decode", "attention_prefill", "ffn", "ffn_decode", "ffn_prefill", "head", "step")
PHASES = {"attention_decode": ("decode",), "attention_prefill": ("prefill", "mixed"),
          "ffn_decode": ("decode",), "ffn_prefill": ("prefill", "mixed")}
POLICIES = ("continuous", "coroutine", "static")


def calibration_cases(model: str, device: str, threads: int | None, hardware: str, table: Path, repeats: int):
    """The executor jobs of the stage, as validation cases (same composition, same comparison)."""
    base = (f"model={model}", "backend=exec", f"backend.device={device}", f"backend.repeats={repeats}",
            f"backend.threads={threads if threads is not None else 'auto'}", f"cluster.gpu={hardware}",
            "output.plot=false", "efficiency=auto", "latency=table", f"latency.calibration={table.resolve()}",
            "workload=calibration")
    if device == "cpu" and threads == 1:
        base += ("backend.clock=cpu",)  # the working thread's CPU time, as the grid was timed
    return [Case("calibration", p, (*base, f"+policy={p}")) for p in POLICIES]


def in_run_scales(cases, rounds: list[list] | None = None, log=None) -> dict:
    """Per module kind, measured / predicted seconds summed over the cases (each case's measured seconds the mean
    over its runs), with what they were computed from. `rounds`: each case's executor runs, where they were taken
    already (validation interleaves them with the cases it checks); None: run them here."""
    rounds = rounds if rounds is not None else measure_rounds(cases)
    results = [compare(case, runs) for case, runs in zip(cases, rounds, strict=True)]
    predictions = [r.predicted_records for r in results]
    measured = {k: sum(statistics.mean(_total(run.records, k, side_of(run)) for run in runs) for runs in rounds)
                for k in SCALED}
    predicted = {k: sum(_total(recs, k, r.predicted) for recs, r in zip(predictions, results)) for k in SCALED}
    scales = {k: round(measured[k] / predicted[k], 4) for k in SCALED if predicted[k] > 0 and measured[k] > 0}
    if log:
        for r in results:
            log(f"in-run {r.case.name}: measured {r.measured.bct_s:.3f} s (mean of {len(r.runs_s)}), grid-only "
                f"prediction {r.predicted.bct_s:.3f} s, decisions {'equal' if r.difference is None else 'differ'}")
        log("in-run scales: " + ", ".join(f"{k} x{v:.2f}" for k, v in scales.items()))
    return {"workload": "calibration", "policies": [c.policy for c in cases], "scales": scales,
            "tokens_per_forward": tokens_per_forward(predictions),
            "measured_s": {k: round(v, 4) for k, v in measured.items()},
            "predicted_s": {k: round(v, 4) for k, v in predicted.items()},
            "bct_s": {r.case.name: [round(r.measured.bct_s, 4), round(r.predicted.bct_s, 4)] for r in results}}


def tokens_per_forward(runs: list) -> dict[str, float]:
    """Per phased FFN ratio, the tokens its forwards carried on average (expert tokens per expert call) over the
    runs' records of that phase: where the table puts the ratio on the axis of call sizes."""
    out = {}
    for kind in ("ffn_decode", "ffn_prefill"):
        recs = [r for records in runs for r in records if r.phase in PHASES[kind]]
        calls = sum(r.expert_calls for r in recs)
        if calls:
            out[kind] = round(sum(r.expert_tokens for r in recs) / calls, 2)
    return out


def _key(kind: str) -> str:
    """Validation names the per-forward and per-boundary remainder `rest`."""
    return "rest" if kind == "step" else kind


def _total(records, kind: str, side) -> float:
    """Seconds of a module kind over one run: attention and the FFN by phase from its step records (a prefill
    record's decode queries, where a forward has both, count as prefill), any kind else from the run's module
    totals (`side`: its `compare.Side`)."""
    phases = PHASES.get(kind)
    if phases is None:
        return side.modules.get(_key(kind), 0.0)
    module = kind.split("_")[0]
    return float(sum(r.modules.get(module, 0.0) for r in records if r.phase in phases))
