"""The simulator's time split by module, to set beside the executor's timers (validation).

`costs.price` prices a run as a whole; this prices the same load module by module, with the same latency
model: attention (every layer), ffn (dense FFN, router, shared and routed experts, all-to-all), head (LM head
and sampling, once per forward). Whatever else the simulated run lasts (per-forward and per-boundary
overheads, copies not hidden by compute) is the rest, the run's duration minus these. In lockstep the slowest
rank sets each iteration, so each module takes its slowest rank per iteration.
"""

from __future__ import annotations

from typing import Any, Generator

import numpy as np

from batchgen.engine import StepPlan, StepResult
from batchgen.sim.backend import SimBackend
from batchgen.sim.costs import RankLoad, decode_load, decode_participation, prefill_load


def run_load(state, plan: StepPlan, similar_calls: bool = False) -> RankLoad:
    """The run's load per rank and iteration, built as SimBackend.execute builds it (host-resident sequences
    counted as device-resident: their restores are not a module of the executor's timers either).
    `similar_calls`: padded attention kernels called on runs of similar contexts (SimBackend._similar_calls)."""
    t, R = state.table, plan.gpus.size
    ids = plan.decode_ids
    if plan.prefill_ids.size:
        prompts = t.context(plan.prefill_ids)
        if plan.padded:
            prompts = _padded(prompts, plan.prefill_rank, R)
        return prefill_load(plan.prefill_rank, prompts, plan.decode_rank, t.context(ids), R, plan.micro_batch,
                            similar_calls)
    iterations, produced = decode_participation(t.remaining(ids), plan.steps, plan.stop, plan.decode_rank, R)
    context = t.context(ids)
    if plan.padded:
        context = _padded(context, plan.decode_rank, R)
    alive = np.full(ids.size, iterations) if plan.padded else produced
    return decode_load(plan.decode_rank, context, alive, plan.decode_tp, R, iterations, plan.micro_batch,
                       plan.pad_rows, plan.pad_context, state.kv_split_by_heads, similar_calls and not plan.padded)


def module_seconds(lat, load: RankLoad) -> dict[str, float]:
    """Seconds per module over the run (slowest rank per iteration, iterations that ran)."""
    n_dense, n_moe = lat.layer_counts()
    gate = load.gate_tokens
    active = gate.sum(axis=0) > 0
    attn = (lat.attention_decode(load.attn_tokens, load.attn_context, load.micro_batches, load.attn_max)
            + lat.attention_prefill(load.prefill_tokens, load.prefill_sq, 1, load.prefill_max, load.prefill_seqs))
    ffn = np.zeros(gate.shape[1])
    if n_dense:
        ffn = ffn + n_dense * np.max(lat.dense_ffn(gate), axis=0)
    if n_moe:
        total = gate.sum(axis=0)
        slowest, _ = lat.experts(total)
        local = lat.shared_experts(gate) + lat.router(gate)
        ffn = ffn + n_moe * (np.max(local, axis=0) + lat.all_to_all(total) + slowest)
    head = np.max(lat.lm_head(load.sequences), axis=0)
    per_iteration = {"attention": (n_dense + n_moe) * np.max(attn, axis=0), "ffn": ffn, "head": head}
    return {k: float(np.where(active, v, 0.0).sum()) for k, v in per_iteration.items()}


class ModuleTimedSimBackend(SimBackend):
    """A SimBackend whose step results carry the module split of what it priced."""

    def execute(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        # the state as at the boundary
        modules = module_seconds(self.lat, run_load(self.state, plan, self.lat.attention_padding > 0))
        result = yield from super().execute(plan)
        result.modules = modules
        return result


def _padded(lengths: np.ndarray, rank: np.ndarray, num_ranks: int) -> np.ndarray:
    longest = np.zeros(num_ranks, np.int64)
    np.maximum.at(longest, rank, lengths)
    return longest[rank]
