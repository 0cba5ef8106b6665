"""Headline numbers of a finished run, and the per-GPU accounting they come from.

A run can hold a million sequences and 100K+ step records, so everything here works on columns: the step
records are turned into arrays once (`step_arrays`) and every metric is a numpy reduction over them.

Definitions decided here (the brief leaves them open):
- Every request is present at t=0, so a sequence's completion time (SCT) is its finish time and the batch
  completion time (BCT) is the largest one.
- GPU-time fractions are taken over `num_gpus * span`, where span is the BCT, or the end of the last step if
  that is later (float rounding can put it a hair past the last finish); so busy + comm + idle == 1 exactly.
- idle is everything that is neither compute nor communication: ranks waiting for the slowest rank inside a
  step, gaps between steps, and the tail after an instance drained. `tail_idle_frac` is that last part alone.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any

import numpy as np

SIG_DIGITS = 6


@dataclass
class StepArrays:
    """The step records as columns; busy/comm are (records x ranks) since every instance has the same size."""

    instance: np.ndarray
    start: np.ndarray
    duration: np.ndarray
    phase: np.ndarray
    iterations: np.ndarray
    tokens: np.ndarray
    running: np.ndarray
    expert_tokens: np.ndarray
    expert_calls: np.ndarray
    busy: np.ndarray
    comm: np.ndarray

    @property
    def end(self) -> np.ndarray:
        return self.start + self.duration

    def __len__(self) -> int:
        return self.instance.size


def step_arrays(out) -> StepArrays:
    recs = out.records
    ranks = int(out.prepared.cluster.instance_size)

    def col(name: str, dtype) -> np.ndarray:
        return np.fromiter((getattr(r, name) for r in recs), dtype, count=len(recs))

    def mat(name: str) -> np.ndarray:
        return np.vstack([getattr(r, name) for r in recs]) if recs else np.zeros((0, ranks))

    return StepArrays(
        instance=col("instance", np.int64), start=col("start", float), duration=col("duration", float),
        phase=np.array([r.phase for r in recs], dtype=object), iterations=col("iterations", np.int64),
        tokens=col("tokens", np.int64), running=col("running", np.int64),
        expert_tokens=col("expert_tokens", float), expert_calls=col("expert_calls", np.int64),
        busy=mat("rank_busy"), comm=mat("rank_comm"),
    )


def _round(x: float | None) -> float | None:
    """Six significant digits: enough to compare runs, short enough to read in results.json."""
    if x is None or not np.isfinite(x):
        return None
    return float(f"{float(x):.{SIG_DIGITS}g}")


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den > 0 else 0.0


def bct(out) -> float:
    finish = out.prepared.state.table.finish_time
    return float(np.nanmax(finish)) if finish.size and not np.all(np.isnan(finish)) else 0.0


def span(out, steps: StepArrays) -> float:
    return max(bct(out), float(steps.end.max(initial=0.0)))


def per_gpu_seconds(out, steps: StepArrays) -> tuple[np.ndarray, np.ndarray]:
    """Busy and comm seconds of every global GPU, mapping each instance's ranks through the topology."""
    topo = out.prepared.state.topo
    busy, comm = np.zeros(topo.num_gpus), np.zeros(topo.num_gpus)
    for inst in range(topo.num_instances):
        gpus, mine = topo.instance_gpus(inst), steps.instance == inst
        busy[gpus] = steps.busy[mine].sum(axis=0)
        comm[gpus] = steps.comm[mine].sum(axis=0)
    return busy, comm


def tail_gpu_seconds(out, steps: StepArrays, horizon: float) -> float:
    """GPU-seconds between each instance's last step and the end of the run: the cost of uneven draining."""
    topo = out.prepared.state.topo
    total = 0.0
    for inst in range(topo.num_instances):
        last = float(steps.end[steps.instance == inst].max(initial=0.0))
        total += max(horizon - last, 0.0) * topo.instance_gpus(inst).size
    return total


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _expert_numbers(out, steps: StepArrays) -> tuple[float | None, float | None]:
    """Tokens at the gate per MoE call, and per routed expert (the batch each expert GEMM actually sees)."""
    m = out.job.model
    calls = int(steps.expert_calls.sum())
    if not m.is_moe or calls == 0:
        return None, None
    gate = float(steps.expert_tokens.sum()) / calls
    return gate, gate * m.top_k / m.num_experts


def _decode_expert_batch(out, steps: StepArrays) -> float | None:
    """Mean tokens per routed expert over decode iterations only: what module-based batching exists to grow
    (prefill forwards have huge expert batches in every policy and would hide the difference)."""
    m = out.job.model
    decode = steps.phase == "decode"
    calls = int(steps.expert_calls[decode].sum())
    if not m.is_moe or calls == 0:
        return None
    return float(steps.expert_tokens[decode].sum()) / calls * m.top_k / m.num_experts


def _mean_running(out, steps: StepArrays) -> float:
    """Running sequences per instance, weighted by time over the whole batch (idle time counts as zero)."""
    horizon = span(out, steps) * out.prepared.cluster.num_instances
    return _ratio(float((steps.running * steps.duration).sum()), horizon)


def _time_fractions(out, steps: StepArrays) -> dict[str, float]:
    horizon = span(out, steps)
    gpu_time = out.prepared.state.topo.num_gpus * horizon
    busy, comm = per_gpu_seconds(out, steps)
    busy_f, comm_f = _ratio(busy.sum(), gpu_time), _ratio(comm.sum(), gpu_time)
    return {"gpu_busy_frac": busy_f, "gpu_comm_frac": comm_f, "gpu_idle_frac": max(1.0 - busy_f - comm_f, 0.0),
            "tail_idle_frac": _ratio(tail_gpu_seconds(out, steps, horizon), gpu_time)}


def _memory_peaks(out) -> dict[str, float]:
    s = out.prepared.state
    kv = s.peak_pages / np.maximum(s.gpu_pages, 1)
    host = np.where(s.host_kv_tokens > 0, s.peak_host / np.maximum(s.host_kv_tokens, 1), 0.0)
    return {"peak_kv_frac": float(kv.max(initial=0.0)), "peak_host_frac": float(host.max(initial=0.0))}


def where_it_ran(out) -> tuple[str, str]:
    """(cluster, gpu) labels: the simulated cluster's, or for the executor the device it measured on (its
    job's cluster is only the topology of its ranks, never hardware that ran anything)."""
    job = out.job
    if out.backend in ("exec", "dist"):
        ranks = int(job.cluster.num_gpus)
        if out.backend == "dist":
            return f"executor: {ranks} process{'es' if ranks > 1 else ''} on {out.device}", out.device
        return f"executor: {ranks} rank{'s' if ranks > 1 else ''} on {out.device}", out.device
    return job.cluster.name, job.cluster.gpu.name


def _identity(out) -> dict[str, Any]:
    job = out.job
    cluster, gpu = where_it_ran(out)
    return {"policy": job.policy.name, "backend": out.backend, "model": job.model.name,
            "cluster": cluster, "gpu": gpu, "workload": job.workload.name,
            "num_sequences": len(out.prepared.state.table), "num_gpus": int(job.cluster.num_gpus),
            "num_instances": int(out.prepared.cluster.num_instances)}


def _measurement(out) -> dict[str, Any]:
    """An executor run: what it ran on (resolved, never "auto") and how much its BCT moved between repeats.
    bct_s is the median run's (with backend.clock=cpu, the fastest run's, on the working thread's CPU time: clock,
    and bct_wall_runs_s beside it); bct_spread = (max - min) / bct_s; a sweep compares them. cpu_share (CPU
    seconds / (wall x threads)) well under 1 says other processes took the cores during the run."""
    if out.backend not in ("exec", "dist"):
        return {}
    import torch
    runs = [float(b) for b in (getattr(out, "repeat_bcts", None) or [bct(out)])]
    median = bct(out)
    return {"device": out.device, "dtype": out.dtype, "threads": int(out.threads),
            "interop_threads": int(out.interop_threads), "torch": torch.__version__, "repeats": len(runs),
            "bct_runs_s": [_round(b) for b in runs], "bct_min_s": min(runs), "bct_max_s": max(runs),
            "bct_spread": _ratio(max(runs) - min(runs), median), "cpu_share": float(getattr(out, "cpu_share", 0.0)),
            "repeats_same_decisions": bool(getattr(out, "repeats_same_decisions", True)),
            "clock": getattr(out, "clock", "wall"),
            **({"bct_wall_runs_s": [_round(b) for b in out.repeat_wall_bcts], "load": out.load}
               if getattr(out, "clock", "wall") == "cpu" else {}),
            **({"procs": int(out.procs), "rank_busy_s": [_round(x) for x in out.rank_busy_s],
                "rank_comm_s": [_round(x) for x in out.rank_comm_s],
                "rank_idle_s": [_round(x) for x in out.rank_idle_s],
                # lost workers the run went on without (the rank_* lists are then the survivors', in this order)
                "recoveries": [dataclasses.asdict(r) for r in getattr(out, "recoveries", [])],
                "rank_ids": list(out.recoveries[-1].survivors) if getattr(out, "recoveries", None)
                else list(range(int(out.procs)))} if out.backend == "dist" else {})}


def _prefix_hits(out) -> dict[str, Any]:
    """Prompt tokens a prefill took from a shared prefix instead of computing them, and their share of what a
    perfect prefix cache could take (the tokens submitted less the distinct ones); empty where nothing is shared."""
    state, w = out.prepared.state, out.job.workload
    if not state.sharing:
        return {}
    counts = w.prefill_tokens()
    shareable = counts["prefill_tokens_submitted"] - counts["prefill_tokens_distinct"]
    return {"prefill_tokens_shared": int(state.prefix_taken),
            "prefix_hit_rate": _ratio(state.prefix_taken, shareable)}


def _kv_read(state) -> float | None:
    """KV bytes that an instance's decode queries read per forward that decodes, every rank and layer together
    (cascades read a shared prefix once per call: batchgen.core.cascade)."""
    if not state.decode_forwards:
        return None
    return state.decode_kv_read * state.kv_bytes_per_token / state.decode_forwards


def summarize(out) -> dict[str, Any]:
    """One flat dict of plain types per run, so runs can be tabulated, compared and dumped to JSON."""
    t = out.prepared.state.table
    steps = step_arrays(out)
    total_bct = bct(out)
    finished = t.finish_time[~np.isnan(t.finish_time)]
    output_tokens = int(t.output_len.sum())
    gate, expert_batch = _expert_numbers(out, steps)
    res: dict[str, Any] = _identity(out)
    res.update(bct_s=total_bct, sct_p50_s=_percentile(finished, 50), sct_p99_s=_percentile(finished, 99),
               output_tokens=output_tokens, prompt_tokens=int(t.input_len.sum()),
               # what sharing could save, from the workload's prefix columns, and what the run's prefills computed
               **out.job.workload.prefill_tokens(), prefill_tokens_computed=int(out.prepared.state.prefill_computed),
               **_prefix_hits(out), kv_bytes_read_per_decode_iter=_kv_read(out.prepared.state),
               tokens_per_s=_ratio(output_tokens, total_bct),
               tokens_per_s_per_gpu=_ratio(output_tokens, total_bct * out.job.cluster.num_gpus))
    res.update(_time_fractions(out, steps))
    res.update(mean_gate_tokens=gate, mean_expert_batch=expert_batch,
               decode_expert_batch=_decode_expert_batch(out, steps), mean_running=_mean_running(out, steps),
               prefill_s=float(steps.duration[steps.phase == "prefill"].sum()),
               decode_s=float(steps.duration[steps.phase == "decode"].sum()),
               # chunked prefill's forwards of prompt chunks beside every decode (decode does not wait)
               mixed_s=float(steps.duration[steps.phase == "mixed"].sum()),
               partitions=int(t.partitions.sum()),
               yields=int(t.yields.sum()), migrations=int(t.migrations.sum()), recomputes=int(t.recomputes.sum()),
               host_bytes=float(getattr(out, "host_bytes", 0.0)) or None,
               host_bytes_per_decode_iter=float(getattr(out, "host_bytes_per_iteration", 0.0)) or None,
               steps=len(steps), events=int(out.events), wall_s=float(out.wall_s),
               seqs_per_wall_s=_ratio(len(t), out.wall_s))
    # Share of instance-time spent in forwards that prefill: in lockstep every rank of the instance waits
    # for them, so a high share means decode was stalled by prompts (serving engines' prefill-first rule).
    res["prefill_frac"] = _ratio(res["prefill_s"], total_bct * out.prepared.cluster.num_instances)
    res["mixed_frac"] = _ratio(res["mixed_s"], total_bct * out.prepared.cluster.num_instances)
    res.update(_memory_peaks(out))
    res.update(_measurement(out))
    res = {k: _round(v) if isinstance(v, float) else v for k, v in res.items()}
    plan = getattr(out.prepared, "plan", None)
    if plan is not None:  # the static plan that resolved the policy's "auto" knobs, as predicted
        res["plan"] = {k: _round(v) if isinstance(v, float) else v for k, v in plan.to_dict().items()}
    return res


def device_table(out, steps: StepArrays | None = None) -> list[dict[str, Any]]:
    """One row per GPU: where the time went and how full its KV cache got, to spot a straggler GPU."""
    s = out.prepared.state
    steps = step_arrays(out) if steps is None else steps
    horizon = span(out, steps)
    busy, comm = per_gpu_seconds(out, steps)
    return [{"gpu": g, "node": int(s.topo.gpu_node[g]), "instance": int(s.topo.gpu_instance[g]),
             "busy_s": _round(busy[g]), "comm_s": _round(comm[g]),
             "idle_s": _round(max(horizon - busy[g] - comm[g], 0.0)),
             "utilization": _round(_ratio(busy[g], horizon)),
             "peak_kv_pages": int(s.peak_pages[g]), "kv_pages_capacity": int(s.gpu_pages[g])}
            for g in range(s.topo.num_gpus)]
