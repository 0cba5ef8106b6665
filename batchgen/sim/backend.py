"""The SimPy backend: each expert-parallel instance is one process that jumps from boundary to boundary.

Events are scheduling decisions, not tokens: a run of up to `steps` iterations is priced in one vectorised
call (sim/costs.py) and becomes one timeout. Instances share the clock, the host pools and the links' owners,
so migration between instances sees a consistent state.
"""

from __future__ import annotations

from typing import Any, Generator

import numpy as np
import simpy

from batchgen.core.sequences import InvariantError
from batchgen.core.state import ClusterState
from batchgen.engine import StepPlan, StepResult
from batchgen.latency import LatencyModel
from batchgen.policy.base import Capabilities
from batchgen.sim.costs import decode_load, decode_participation, prefill_load, price


class SimBackend:
    def __init__(self, env: simpy.Environment, state: ClusterState, lat: LatencyModel,
                 weight_stream_s: float = 0.0):
        self.env = env
        self.capabilities = Capabilities()  # layer-by-layer prefill offload, host-resident decode, CPU attention
        self.state = state
        self.lat = lat
        self.weight_stream_s = weight_stream_s
        self.events = 0
        self._live = set(range(state.topo.num_instances))
        self._waiting: set[int] = set()
        self._changed = env.event()

    def wait_for_change(self, instance: int, policy_name: str) -> Generator[Any, Any, None]:
        self._waiting.add(instance)
        if self._live <= self._waiting:
            raise InvariantError(f"policy {policy_name!r} made no progress on instances {sorted(self._waiting)} "
                                 "although they still have queued sequences, and no instance is running")
        yield self._changed
        self._waiting.discard(instance)

    def notify_change(self) -> None:
        if self._waiting:
            changed, self._changed = self._changed, self.env.event()
            changed.succeed()

    def instance_done(self, instance: int) -> None:
        self._live.discard(instance)
        self.notify_change()  # waiting instances look again (and report a deadlock if all are stuck)

    def now(self) -> float:
        return float(self.env.now)

    def execute(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        t = self.state.table
        R = plan.gpus.size
        ids = plan.decode_ids
        remaining = t.remaining(ids)
        if plan.prefill_ids.size:
            prompts = t.context(plan.prefill_ids)
            if plan.padded:
                prompts = _padded(prompts, plan.prefill_rank, R)
            load = prefill_load(plan.prefill_rank, prompts, plan.decode_rank, t.context(ids), R, plan.micro_batch)
            iterations, produced = 1, np.ones(ids.size, np.int64)
        else:
            iterations, produced = decode_participation(remaining, plan.steps, plan.stop, plan.decode_rank, R)
            context = t.context(ids)
            if plan.padded:  # a static batch: every row runs every iteration over the longest row's context
                context = _padded(context, plan.decode_rank, R)
            alive = np.full(ids.size, iterations) if plan.padded else produced
            load = decode_load(plan.decode_rank, context, alive, plan.decode_tp, R, iterations,
                               plan.micro_batch, plan.pad_rows, plan.pad_context)
        cost = price(self.lat, load, self.weight_stream_s)
        compute = cost.compute_s
        transfer = self._transfer_seconds(plan, produced)
        duration = max(compute, float(transfer.max(initial=0.0)))
        scale = duration / compute if compute > 0 else 0.0
        finished = produced == remaining
        offsets = np.full(ids.size, np.nan)
        if finished.any():
            clock = np.cumsum(cost.iteration_s) * scale
            offsets[finished] = clock[produced[finished] - 1] if compute > 0 else duration
        prefill_finished = t.remaining(plan.prefill_ids) == 1
        self.events += 1
        yield self.env.timeout(duration)
        rank_comm = cost.rank_comm + np.maximum(transfer - compute, 0.0)
        return StepResult(duration, iterations, produced, finished, offsets, prefill_finished, cost.rank_busy,
                          rank_comm, float(cost.expert_tokens.sum()),
                          int((cost.expert_tokens > 0).sum()) if self.lat.model.is_moe else 0,
                          int(load.gate_tokens.sum() - plan.pad_rows.sum() * iterations))

    def _transfer_seconds(self, plan: StepPlan, produced: np.ndarray) -> np.ndarray:
        """Copies of KV per rank, overlapped with the run's compute (async checkpoint and restore)."""
        g = plan.gpus
        kv = self.state.kv_bytes_per_token
        t = self.state.table
        R = g.size
        d2h = plan.moves.d2h[g].copy()
        if plan.host_sync and plan.decode_ids.size:
            d2h += np.bincount(plan.decode_rank, weights=produced * kv, minlength=R)
        if plan.prefill_to_host and plan.prefill_ids.size:
            d2h += np.bincount(plan.prefill_rank, weights=t.context(plan.prefill_ids) * kv, minlength=R)
        lat = self.lat
        seconds = np.zeros(R)
        for arr, fn in ((plan.moves.h2d[g], lat.h2d), (d2h, lat.d2h)):
            seconds += np.where(arr > 0, fn(arr), 0.0)
        for arr, cross in ((plan.moves.network[g], True), (plan.moves.peer[g], False)):
            seconds += np.where(arr > 0, lat.network(arr, cross), 0.0)
        return seconds


def _padded(lengths: np.ndarray, rank: np.ndarray, num_ranks: int) -> np.ndarray:
    """Each row's length raised to the longest of its rank's batch (left padding, as `generate` does)."""
    longest = np.zeros(num_ranks, np.int64)
    np.maximum.at(longest, rank, lengths)
    return longest[rank]
