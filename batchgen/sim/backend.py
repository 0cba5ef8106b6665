"""The SimPy backend: each expert-parallel instance is one process that jumps from boundary to boundary.

Events are scheduling decisions, not tokens: a run of up to `steps` iterations is priced in one vectorised
call (pricing/costs.py) and becomes one timeout. Instances share the clock, the host pools and the links' owners,
so migration between instances sees a consistent state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generator

import numpy as np
import simpy

from batchgen.core.reshard import pieces
from batchgen.core.state import ClusterState
from batchgen.engine import StepPlan, StepResult, filled
from batchgen.engine.apply import _FEW_CHUNKS
from batchgen.latency import LatencyModel
from batchgen.memory import dp_prefill_copy
from batchgen.policy.base import Capabilities
from batchgen.sim import repeated
from batchgen.sim.finishes import few_chunks_finished, finish_offsets
from batchgen.pricing.offload import price_offload
from batchgen.pricing import one_rank
from batchgen.pricing.costs import (cascade_load, decode_grid, decode_load, decode_participation, mixed_load,
                                    partition_join, prefill_load, price_host, with_cascade)
from batchgen.pricing.price import CELL_ITERATIONS, price, price_cells, price_steady


class SimBackend:
    """`stream_bytes_per_iter`: expert weights each rank copies host -> device per iteration (weights that do
    not stay resident); decode prices them per MoE layer on the DAG, prefill as a floor of `weight_stream_s`.

    Bytes moved between host and device are counted for the results: `host_bytes` (everything, both
    directions), `decode_host_bytes` and `decode_iterations` (the decode runs' share: KV restores and appends,
    CPU attention's copies, streamed experts), and `host_bytes_per_iteration` (their ratio).
    """

    def __init__(self, env: simpy.Environment, state: ClusterState, lat: LatencyModel,
                 weight_stream_s: float | None = None, stream_bytes_per_iter: float = 0.0,
                 capabilities: Capabilities | None = None, two_batch_overlap: bool = False,
                 overlap_copies: bool = True, comm_overlap: bool = False, dp_prefill: bool = False):
        """`two_batch_overlap`: every forward priced as two overlapped micro-batches (batchgen.pricing.tbo), the
        policy's choice (sglang_opt). `comm_overlap`: each attention micro-batch's expert all-to-all beside the
        next one's compute (`plan.decode.overlapped_all_to_all`), the policy's choice (coroutine's comm_overlap; device-
        resident runs only: `batchgen.job.prepare` refuses it with host-resident KV). `overlap_copies` false: the KV a
        run copies (migrations, shipped KV, checkpoints) is paid after its compute instead of beside it, for every
        policy alike, to measure what the overlap is worth. `capabilities`: what the simulated engine can do; default
        everything the simulator prices (layer-by-layer prefill offload, host-resident decode, CPU attention unless MLA,
        every partition degree the heads allow). A validation run passes the executor's, so both see the same
        snapshots. `dp_prefill`: forwards that prefill run data parallel (the policy's prefill_parallel=dp):
        each rank runs its own tokens through every expert, streaming in the experts it does not hold, layer by
        layer (`prefill_stream_bytes_per_layer`, with any streamed decode weights), and no all-to-all."""
        self.env = env
        self.capabilities = capabilities or Capabilities(cpu_attention=lat.model.attention != "mla",
                                                         partition_degrees=lat.model.partition_degrees())
        self.state = state
        self.lat = lat
        self.tbo = bool(two_batch_overlap)
        # one rank's runs are built and priced on floats where the latency model takes them cheaply
        self.cells = bool(getattr(lat, "prices_floats", False))
        self.comm_overlap = bool(comm_overlap)
        # padded attention kernels are called on runs of similar contexts, as the executor calls them
        self.similar_calls = lat.attention_padding > 0
        # a CPU "device" is the host's own cores: copies do not overlap its compute
        self._serial = lat.gpu.kind == "cpu" or not overlap_copies
        self.stream_bytes_per_iter = float(stream_bytes_per_iter)
        if weight_stream_s is None:
            weight_stream_s = float(lat.h2d(stream_bytes_per_iter)) if stream_bytes_per_iter else 0.0
        self.weight_stream_s = weight_stream_s
        n_moe = lat.layer_counts()[1]
        self._prefetch_per_layer = self.stream_bytes_per_iter / n_moe if n_moe else 0.0
        # a data-parallel prefill forward's copy per rank: every MoE layer's missing experts, and the streamed ones
        self._dp_stream_bytes, self._dp_stream_s = (dp_prefill_copy(lat.model, lat, self.stream_bytes_per_iter)
                                                    if dp_prefill else (0.0, None))
        self.dp_prefill = self._dp_stream_s is not None
        self.host_bytes = 0.0
        self.h2d_bytes = 0.0  # the host -> device share of host_bytes (weights streamed, KV restored, outputs back)
        self.decode_host_bytes = 0.0
        self.decode_iterations = 0
        self.events = 0
        self._boundary_s: dict[int, float] = {}  # boundary_overhead by sequences in play
        self._changed = env.event()

    kv_ops = False  # prices the bytes of each plan's `moves`; moves no KV (batchgen.engine.Backend)

    def idle(self) -> Generator[Any, Any, None]:
        yield self._changed

    def wake(self) -> None:
        changed, self._changed = self._changed, self.env.event()
        changed.succeed()

    def move_kv(self, ops) -> None:  # pragma: no cover - never asked (kv_ops is False)
        pass

    def now(self) -> float:
        return float(self.env.now)

    def execute(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        t = self.state.table
        R = plan.gpus.size
        ids = plan.decode_ids
        decoded = t.decoded[ids]
        remaining = t.output_len[ids] - decoded  # t.remaining(ids) and t.context(ids), sharing the gather
        decode_context = t.input_len[ids] + decoded
        cascaded = plan.decode_cascade.size > 0  # cascades: the queries' own pages, and the prefix kernels apart
        attend = decode_context - plan.decode_shared if cascaded else decode_context
        if plan.padded and not self.capabilities.padded_batches:
            # finished rows dropped, prompts unpadded (the batch's slots still held: that is the policy's)
            plan = dataclasses.replace(plan, padded=False, pad_rows=np.zeros_like(plan.pad_rows),
                                       pad_context=np.zeros_like(plan.pad_context))
        calls = None  # expert calls per iteration, where an FFN runs per micro-batch or per rank (dp prefill)
        if plan.prefill_ids.size:
            prompts = t.context(plan.prefill_ids)
            if plan.padded:
                prompts = _padded(prompts, plan.prefill_rank, R)
            if plan.prefill_start.size:  # past shared prefixes: each prompt's rest, over its prefix's KV
                load = mixed_load(plan.prefill_rank, plan.prefill_start, prompts - plan.prefill_start,
                                  np.ones(prompts.size, bool), plan.decode_rank, attend, R, plan.micro_batch,
                                  self.similar_calls)
            else:
                load = prefill_load(plan.prefill_rank, prompts, plan.decode_rank, attend, R,
                                    plan.micro_batch, self.similar_calls)
            if cascaded:
                with_cascade(load, self._cascade(plan, np.ones(ids.size, np.int64), 1), plan.micro_batch,
                             load.sequences)
            iterations, produced = 1, np.ones(ids.size, np.int64)
            if self.dp_prefill:  # each rank's experts run on its own tokens: one expert batch per rank
                cost = price(self.lat, load, dp_stream_s=self._dp_stream_s)
                streamed = self._dp_stream_bytes
                calls = np.array([np.count_nonzero(load.gate_tokens)])
            else:
                cost, streamed = self._price(load, self.weight_stream_s), self.stream_bytes_per_iter
            gate_total = load.gate_tokens.sum()
            self.host_bytes += streamed * R
            self.h2d_bytes += streamed * R
        elif plan.chunk_ids.size:  # chunked prefill: chunks and every decode in one forward
            iterations = 1
            produced = filled(ids.size, 1, np.int64)
            if R == 1 and self.cells and not cascaded:  # one rank: the forward's load built and priced on floats
                cells, heads = one_rank.mixed_cells(plan.chunk_start, plan.chunk_len, plan.chunk_completes,
                                                    decode_context, plan.micro_batch)
                cost = price_cells(self.lat, cells, heads, self.weight_stream_s, 0.0, self.tbo, self.comm_overlap)
                gate_total = cells[2][0]
            else:
                load = mixed_load(plan.chunk_rank, plan.chunk_start, plan.chunk_len, plan.chunk_completes,
                                  plan.decode_rank, attend, R, plan.micro_batch, self.similar_calls)
                if cascaded:
                    with_cascade(load, self._cascade(plan, np.ones(ids.size, np.int64), 1), plan.micro_batch,
                                 load.sequences)
                cost = self._price(load, self.weight_stream_s)
                gate_total = load.gate_tokens.sum()
            self.host_bytes += self.stream_bytes_per_iter * R
            self.h2d_bytes += self.stream_bytes_per_iter * R
        else:
            iterations, produced = decode_participation(remaining, plan.steps, plan.stop, plan.decode_rank, R)
            context = attend
            if plan.padded:  # a static batch: every row runs every iteration over the longest row's context
                context = _padded(context, plan.decode_rank, R)
            alive = np.full(ids.size, iterations) if plan.padded else produced
            hosted = np.asarray(plan.decode_host_resident, bool)
            # without a host copy anywhere none is host-resident; without a partition ever, every degree is 1
            plain = not self.state.has_host_copies() and not self.state.partitioned_ever
            calls = None
            # partitioned attention's join, where it is priced (the offloading schedules' DAG does not read it)
            join = (partition_join(self.lat, plan.decode_rank, alive, plan.decode_tp, R, iterations)
                    if not plain and plan.ffn_schedule == "combined" else 0.0)
            if plan.ffn_schedule != "combined":  # an offloading system's schedule: an FFN per micro-batch
                cost, calls, gate_total = self.offload_run(plan, plan.decode_rank, context, alive, plan.decode_tp,
                                                           hosted, iterations)
            elif (not plain and hosted.any()) or self._prefetch_per_layer > 0:
                load = decode_grid(plan.decode_rank, context, alive, plan.decode_tp, hosted, R, iterations,
                                   plan.micro_batch, plan.pad_rows, plan.pad_context,
                                   self.similar_calls and not plan.padded, bool(plan.cpu_attention),
                                   plan.decode_cascade)
                load.tp_join = join
                if cascaded:  # the device queries' cascades, and the host-resident ones' (restored once per call)
                    with_cascade(load, self._cascade(plan, alive, iterations, ~hosted), plan.micro_batch,
                                 load.dev_tokens)
                    load.host_cascade = self._cascade(plan, alive, iterations, hosted)
                cpu = bool(plan.cpu_attention and hosted.any())
                cost, h2d, d2h = price_host(self.lat, load, plan.micro_batch, cpu_attention=cpu,
                                            prefetch_bytes=self._prefetch_per_layer)
                gate_total = load.gate_tokens.sum()
                self.count_decode_traffic(h2d, d2h)
            else:
                cost = None
                one = (R == 1 and ids.size and type(join) is float and join == 0.0 and self.cells and not cascaded
                       and (plain or int(plan.decode_tp.max()) == 1))
                if one and iterations <= CELL_ITERATIONS and not plan.padded and not self.similar_calls:
                    # one rank, a short run: its load built and priced on floats
                    cells = one_rank.decode_cells(context, alive, iterations, plan.micro_batch)
                    cost = price_cells(self.lat, cells, None, self.weight_stream_s, 0.0, self.tbo,
                                       self.comm_overlap)
                    gate_total = sum(cells[2])
                elif (one and iterations > CELL_ITERATIONS and (plan.padded or not self.similar_calls)
                      and int(alive.min()) == iterations):
                    # one rank, every row through the whole run: its amounts in closed form
                    load = one_rank.all_alive(context, iterations, plan.micro_batch, int(plan.pad_rows[0]),
                                              int(plan.pad_context[0]))
                    cost = price_steady(self.lat, load, iterations, self.weight_stream_s, 0.0, self.tbo,
                                        self.comm_overlap)
                    gate_total = np.full((1, iterations), load.gate_tokens).sum()
                if cost is None:
                    load = decode_load(plan.decode_rank, context, alive, plan.decode_tp, R, iterations,
                                       plan.micro_batch, plan.pad_rows, plan.pad_context,
                                       self.similar_calls and not plan.padded)
                    if cascaded:
                        with_cascade(load, self._cascade(plan, alive, iterations), plan.micro_batch, load.attn_tokens)
                    cost = self._price(load, self.weight_stream_s, join)
                    gate_total = load.gate_tokens.sum()
            self.decode_iterations += int(np.count_nonzero(cost.iteration_s))  # seconds are >= 0
        still = not (plan.host_sync or plan.prefill_to_host) and not plan.moves.any()
        finished = produced == remaining
        host_held = _host_held(self.state, plan)
        transfer = None if still else self._transfer_seconds(plan, produced, finished, host_held)  # None: none moves
        exposed = 0.0 if still else float(transfer.max(initial=0.0))
        # copies within a GPU's memory (shared prefixes' tails) run on its compute stream: the slowest rank's add
        local = None if still or not plan.moves.local.any() else self.lat.local_copy(plan.moves.local[plan.gpus])
        compute, boundary, duration, scale = self.timing(cost, ids.size + plan.prefill_ids.size
                                                         + plan.chunk_ids.size, exposed,
                                                         0.0 if local is None else float(local.max()))
        offsets = finish_offsets(cost, produced, finished, compute, boundary, duration, scale)
        prefill_finished = t.remaining(plan.prefill_ids) == 1 if plan.prefill_ids.size else _NONE
        if 0 < plan.chunk_ids.size <= _FEW_CHUNKS:  # a forward's few chunks: each one's flag on scalars
            chunk_finished = few_chunks_finished(t, plan.chunk_ids, plan.chunk_completes)
        else:
            chunk_finished = (plan.chunk_completes & (t.remaining(plan.chunk_ids) == 1)
                              if plan.chunk_ids.size else _NONE)
        self.events += 1
        yield self.env.timeout(duration)
        # with nothing moved, the exposed copies add max(0 - compute, 0) = 0 on every rank
        rank_comm = cost.rank_comm + (0.0 if transfer is None else np.maximum(transfer - compute, 0.0))
        if local is not None:
            rank_comm = rank_comm + local
        return StepResult(duration, iterations, produced, finished, offsets, prefill_finished, cost.rank_busy,
                          rank_comm, float(cost.expert_tokens[0] if cost.expert_tokens.size == 1
                                           else cost.expert_tokens.sum()),
                          (int((cost.expert_tokens > 0).sum()) if calls is None else int(calls.sum()))
                          if self.lat.model.is_moe else 0,
                          # padding rows only in a padded plan (apply_decision zeroes them otherwise)
                          int(gate_total - (plan.pad_rows.sum() if plan.padded else 0) * iterations),
                          modules=cost.modules,
                          chunk_finished=chunk_finished, prefill_host_held=host_held[0])

    def _cascade(self, plan: StepPlan, alive: np.ndarray, iterations: int, among: np.ndarray | None = None):
        """The run's cascades (the plan's, batchgen.core.cascade; those of the decodes `among`, a mask) as prefix
        kernels per rank and iteration."""
        group = plan.decode_cascade if among is None else np.where(among, plan.decode_cascade, -1)
        return cascade_load(plan.decode_rank, group, plan.decode_shared, alive, plan.micro_batch, plan.gpus.size,
                            iterations)

    def timing(self, cost, in_play: int, exposed: float = 0.0, local: float = 0.0) -> tuple[float, float, float, float]:
        """(compute, boundary overhead, duration, scale) of a run: its iterations' compute, copies that `exposed`
        seconds leave unhidden, copies within a GPU (`local` seconds, beside the compute), the boundary's overhead
        for `in_play` sequences; `scale` stretches each iteration's compute to the run's share of the duration (for
        the finish times within it)."""
        # one iteration: its seconds are the sum (numpy's sum of one element is the element; none is -0.0)
        compute = float(cost.iteration_s[0]) if cost.iteration_s.size == 1 else cost.compute_s
        run = (compute + exposed if self._serial else max(compute, exposed)) + local
        boundary = self._boundary_s.get(in_play)
        if boundary is None:  # a pure function of the count: priced once per count
            boundary = self._boundary_s[in_play] = float(self.lat.boundary_overhead(in_play))
        return compute, boundary, boundary + run, run / compute if compute > 0 else 0.0

    def offload_run(self, plan: StepPlan, rank, context, alive, tp, hosted, iterations: int):
        """(cost, expert calls per iteration, gate tokens) of a decode run under an offloading system's schedule
        (an FFN per micro-batch), priced on its DAG; its host traffic counted."""
        load = decode_grid(rank, context, alive, tp, hosted, plan.gpus.size, iterations, plan.micro_batch,
                           plan.pad_rows, plan.pad_context, self.similar_calls and not plan.padded,
                           bool(plan.cpu_attention))
        cost, h2d, d2h, calls = price_offload(self.lat, load, plan.micro_batch,
                                              cpu_attention=bool(plan.cpu_attention and hosted.any()),
                                              pipelined=plan.ffn_schedule == "pipelined",
                                              prefetch_bytes=self._prefetch_per_layer)
        self.count_decode_traffic(h2d, d2h)
        return cost, calls, load.gate_tokens.sum()

    def count_decode_traffic(self, h2d: float, d2h: float) -> None:
        self.decode_host_bytes += h2d + d2h
        self.host_bytes += h2d + d2h
        self.h2d_bytes += h2d

    def can_repeat(self, plan: StepPlan) -> bool:
        """Whether `execute_repeated` can run this plan's decode again and again as one event."""
        return repeated.can_repeat(self, plan)

    def execute_repeated(self, plan: StepPlan, n: int):
        """`plan`'s run and the n identical runs after it, one event ((ids, result) per run; batchgen.engine.repeat)."""
        return repeated.execute_repeated(self, plan, n)

    def _price(self, load, weight_stream_s: float, join=0.0):
        return price(self.lat, load, weight_stream_s, join, tbo=self.tbo, overlap=self.comm_overlap)

    @property
    def host_bytes_per_iteration(self) -> float:
        """Bytes moved between host and device per decode iteration (whole cluster), on average."""
        return self.decode_host_bytes / self.decode_iterations if self.decode_iterations else 0.0

    def _transfer_seconds(self, plan: StepPlan, produced: np.ndarray, finished: np.ndarray,
                          host_held: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Copies of KV per rank, overlapped with the run's compute (async checkpoint and restore)."""
        g = plan.gpus
        R = g.size
        if not (plan.host_sync or plan.prefill_to_host) and not plan.moves.any():
            return np.zeros(R)  # nothing moves (most runs): what the sums below give, without them
        d2h = plan.moves.d2h[g] + synced_bytes(self.state, plan, produced, finished) + prefill_to_host_bytes(
            self.state, plan, *host_held)
        lat = self.lat
        seconds = np.zeros(R)
        self.host_bytes += float(plan.moves.h2d[g].sum() + d2h.sum())
        self.h2d_bytes += float(plan.moves.h2d[g].sum())
        for arr, fn in ((plan.moves.h2d[g], lat.h2d), (d2h, lat.d2h)):
            seconds += np.where(arr > 0, fn(arr), 0.0)
        peer, network = plan.moves.peer[g], plan.moves.network[g]
        if plan.host_sync and self.state.partitioned_ever:
            gathered_peer, gathered_network = synced_gather_bytes(self.state, plan, produced, finished)
            peer, network = peer + gathered_peer, network + gathered_network
        for arr, cross in ((network, True), (peer, False)):
            seconds += np.where(arr > 0, lat.network(arr, cross), 0.0)
        return seconds


_NONE = np.empty(0, bool)
_NONE.flags.writeable = False
_NO_HELD = np.empty(0, np.int64)
_NO_HELD.flags.writeable = False


def _host_held(state: ClusterState, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, creates) per prompt the run writes to host: what its copy holds of its node's host prefix
    (batchgen.core.host_prefixes; 0 for a prompt that ends at its one token, never written), decided now."""
    if not (state.host_sharing and plan.prefill_to_host and plan.prefill_ids.size):
        return _NO_HELD, _NONE
    bound = state.table.remaining(plan.prefill_ids) > 1
    held, creates = np.zeros(bound.size, np.int64), np.zeros(bound.size, bool)
    held[bound], creates[bound] = state.host_plan(plan.prefill_ids[bound],
                                                  state.topo.gpu_node[plan.gpus[plan.prefill_rank[bound]]])
    return held, creates


def prefill_to_host_bytes(state: ClusterState, plan: StepPlan, held: np.ndarray = None,
                          creates: np.ndarray = None) -> np.ndarray:
    """The run's own write-down of the prompts it prefills to host, per rank, read before the run: each prompt's
    whole context (a recompute's generated tokens too; past its node's host prefix where it takes one: `held`,
    `creates`, per prompt), as the executors copy it after the forward. A prompt whose
    one token is its last finishes there and is never written."""
    R = plan.gpus.size
    if not (plan.prefill_to_host and plan.prefill_ids.size):
        return np.zeros(R)
    t = state.table
    bound = t.remaining(plan.prefill_ids) > 1
    tokens = t.context(plan.prefill_ids[bound])
    if held is None:
        held, creates = _host_held(state, plan)
    if held.size:  # past the node's host prefix each takes
        tokens = tokens - np.where(creates, 0, held)[bound]
    return np.bincount(plan.prefill_rank[bound], weights=tokens * state.kv_bytes_per_token, minlength=R)


def synced_bytes(state: ClusterState, plan: StepPlan, produced: np.ndarray, finished: np.ndarray) -> np.ndarray:
    """host_sync's checkpoint after a run, per rank: the new tokens' KV of each device-resident sequence that has a
    host copy and runs on (a host-resident one appends on the DAG, layer by layer; a finished one's copy is
    dropped), as the executors copy it."""
    R = plan.gpus.size
    if not (plan.host_sync and plan.decode_ids.size):
        return np.zeros(R)
    t = state.table
    synced = ~np.asarray(plan.decode_host_resident, bool) & (t.host_node[plan.decode_ids] >= 0) & ~finished
    return np.bincount(plan.decode_rank[synced], weights=produced[synced] * state.kv_bytes_per_token, minlength=R)


def synced_gather_bytes(state: ClusterState, plan: StepPlan, produced: np.ndarray,
                        finished: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(peer, network) bytes per rank that host_sync's checkpoint gathers before it writes (`synced_bytes`): a
    PARTITIONed sequence's new tokens are written down by its lead, which first takes the other GPUs' shards of
    them (batchgen.core.reshard: a join of the new tokens to the lead; MLA's lead holds the whole latent, so none
    move), each charged to the lead: peer from a GPU of its node, network from another."""
    R = plan.gpus.size
    peer, network = np.zeros(R), np.zeros(R)
    if not (plan.host_sync and plan.decode_ids.size and state.partitioned_ever):
        return peer, network
    t = state.table
    tp = np.asarray(plan.decode_tp)
    rows = np.flatnonzero((tp > 1) & ~np.asarray(plan.decode_host_resident, bool)
                          & (t.host_node[plan.decode_ids] >= 0) & ~finished)
    node = state.topo.gpu_node
    for i in rows.tolist():
        r = int(plan.decode_rank[i])
        lead = int(plan.gpus[r])
        kv = float(produced[i]) * state.kv_bytes_per_token
        for p in pieces(state.group_of(lead, int(tp[i])), (lead,), state.kv_split_by_heads):
            (peer if node[p.src] == node[p.dst] else network)[r] += p.nbytes(kv)
    return peer, network


def _padded(lengths: np.ndarray, rank: np.ndarray, num_ranks: int) -> np.ndarray:
    """Each row's length raised to the longest of its rank's batch (left padding, as `generate` does)."""
    longest = np.zeros(num_ranks, np.int64)
    np.maximum.at(longest, rank, lengths)
    return longest[rank]
