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

Within decode the ratio moves with the batch as much: decode calls of 1-4 sequences took 0.70-0.80x the grid's time
inside the runs, of 25 or more 1.0-1.15x (benchmarks/results/validation.md), so a workload whose decode runs on few
sequences (a long tail) was priced high by every one-number ratio. So the stage also keeps ratios by call size
(`ratios_by_size`: decode attention and the LM head by sequences per forward, the FFN by tokens per call in every
phase), and the table takes a call's ratio at its size from them where the file has them.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from batchgen.compare import STATISTICS, Case, compare, measure_rounds, side_of

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


def in_run_scales(cases, rounds: list[list] | None = None, log=None, statistic: str = "mean") -> dict:
    """Per module kind, measured / predicted seconds summed over the cases (each case's measured seconds
    `statistic` over its runs, as validation summarises its cases: compare.STATISTICS), with what they were
    computed from. `rounds`: each case's executor runs, where they were taken already (validation interleaves them
    with the cases it checks); None: run them here."""
    rounds = rounds if rounds is not None else measure_rounds(cases)
    results = [compare(case, runs, statistic=statistic) for case, runs in zip(cases, rounds, strict=True)]
    predictions = [r.predicted_records for r in results]
    of = STATISTICS[statistic]
    measured = {k: sum(of([_total(run.records, k, side_of(run)) for run in runs]) for runs in rounds)
                for k in SCALED}
    predicted = {k: sum(_total(recs, k, r.predicted) for recs, r in zip(predictions, results)) for k in SCALED}
    scales = {k: round(measured[k] / predicted[k], 4) for k in SCALED if predicted[k] > 0 and measured[k] > 0}
    # by size record against record: only jobs whose runs took the predicted decisions line up
    same = [i for i, r in enumerate(results) if r.difference is None]
    by_size = ratios_by_size([rounds[i] for i in same], [predictions[i] for i in same], of)
    if log:
        for r in results:
            decisions = "equal" if r.difference is None else "differ"
            log(f"in-run {r.case.name}: measured {r.measured.bct_s:.3f} s ({statistic} of {len(r.runs_s)}), "
                f"grid-only prediction {r.predicted.bct_s:.3f} s, decisions {decisions}")
        log("in-run scales: " + ", ".join(f"{k} x{v:.2f}" for k, v in scales.items()))
        log("in-run scales by call size: " + "; ".join(
            f"{k} " + ", ".join(f"{n:g}: x{r:.2f}" for n, r in pts) for k, pts in by_size.items()))
    return {"workload": "calibration", "policies": [c.policy for c in cases], "statistic": statistic,
            "scales": scales, "tokens_per_forward": tokens_per_forward(predictions), "by_size": by_size,
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


# module kinds whose ratio is also kept by call size: (the size its table call is given, the phases measured):
# decode attention and the LM head by sequences per decode forward, the FFN by tokens per call in every phase
BY_SIZE = {"attention_decode": ("sequences", ("decode",)), "ffn": ("tokens", ("decode", "mixed", "prefill")),
           "head": ("sequences", ("decode",))}
MIN_SHARE = 0.02  # a size bin's share of the module's seconds (predicted) below which it is left out as noise


def ratios_by_size(rounds: list[list], predictions: list[list], of=statistics.mean) -> dict[str, list[list[float]]]:
    """Per module kind of BY_SIZE, measured / predicted in bins of the call's size (powers of two), each placed at
    its records' mean size (weighted by their predicted seconds): [[size, ratio], ...] ascending, where at least
    two bins hold MIN_SHARE of the kind's seconds. Inside a run a module's ratio to the grid moves with the size
    of its calls: a decode call of a few sequences finds part of its layer's weights still cached, which the grid
    (caches flushed before every call) never does, while larger calls pay for their activations
    (benchmarks/results/validation.md). `rounds`: each stage job's runs; `predictions`: its predicted records,
    one per run record (the same decisions); `of`: the statistic of a record's seconds over the runs."""
    bins: dict[str, dict[int, list[float]]] = {m: {} for m in BY_SIZE}  # bin -> [measured, predicted, size x pred]
    for runs, predicted in zip(rounds, predictions, strict=True):
        for i, rec in enumerate(predicted):
            if not rec.iterations:
                continue
            sizes = {"sequences": rec.tokens / rec.iterations,
                     "tokens": rec.expert_tokens / rec.expert_calls if rec.expert_calls else 0.0}
            for kind, (axis, phases) in BY_SIZE.items():
                module, size = kind.split("_")[0], sizes[axis]
                pred = rec.modules.get(module, 0.0)
                if rec.phase not in phases or size <= 0 or pred <= 0:
                    continue
                meas = of([run.records[i].modules.get(module, 0.0) for run in runs])
                acc = bins[kind].setdefault(int(np.log2(size)), [0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + meas, acc[1] + pred, acc[2] + size * pred
    out = {}
    for kind, by_bin in bins.items():
        total = sum(b[1] for b in by_bin.values())
        points = [[round(b[2] / b[1], 2), round(b[0] / b[1], 4)] for _, b in sorted(by_bin.items())
                  if b[1] >= MIN_SHARE * total and b[0] > 0]
        if len(points) >= 2:
            out[kind] = points
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
