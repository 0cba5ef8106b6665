"""What a priced run costs (`RunCost`), and its seconds per module kind: shared by every pricer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgen.latency import LatencyModel


@dataclass
class RunCost:
    iteration_s: np.ndarray      # duration of each iteration (compute, lockstep), length K
    rank_busy: np.ndarray        # compute seconds of each rank over the run
    rank_comm: np.ndarray        # collective seconds of each rank over the run
    expert_tokens: np.ndarray    # tokens at the gate per iteration (whole instance)
    modules: dict[str, float] = field(default_factory=dict)  # seconds of attention, ffn, head over the run
                                 # (slowest rank per iteration), to set beside the executor's module timers

    @property
    def compute_s(self) -> float:
        return float(self.iteration_s.sum())


def module_totals(per_iteration: dict[str, np.ndarray], active: np.ndarray | None) -> dict[str, float]:
    """Seconds of each module kind over the run's iterations (each the slowest rank's): attention (every
    layer), ffn (dense FFN, router, shared and routed experts, all-to-all) and head (LM head and sampling,
    once per forward). What else a run lasts (engine overheads, exposed copies) is the rest. `active`: the
    iterations that ran (None: all of them)."""
    if active is None:
        return {k: float(v.sum()) for k, v in per_iteration.items()}
    return {k: float(np.where(active, v, 0.0).sum()) for k, v in per_iteration.items()}


def module_split(lat: LatencyModel, attn, sequences, gate, active) -> dict[str, float]:
    """`module_totals` of a run priced elsewhere (the DAG of `price_host`), from the same latency model."""
    n_dense, n_moe = lat.layer_counts()
    ffn = np.zeros(gate.shape[1])
    if n_dense:
        ffn = ffn + n_dense * np.max(lat.dense_ffn(gate), axis=0)
    if n_moe:
        total = gate.sum(axis=0)
        local = lat.shared_experts(gate) + lat.router(gate)
        ffn = ffn + n_moe * (np.max(local, axis=0) + lat.all_to_all(total) + lat.experts(total)[0])
    return module_totals({"attention": (n_dense + n_moe) * np.max(np.broadcast_to(attn, gate.shape), axis=0),
                           "ffn": ffn, "head": np.max(lat.lm_head(sequences), axis=0)}, active)


def itself(x):
    """A reduction over ranks on one rank: the value itself."""
    return x


def slowest_rank(x):
    """The slowest rank's value per iteration of a (ranks x iterations) grid (a number is every rank's)."""
    return x if type(x) is float else x.max(axis=0)
