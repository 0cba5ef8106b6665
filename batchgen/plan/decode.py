"""Price decode iterations with host-resident KV (or streamed expert weights) on the per-layer DAG.

Shared by the simulator (a run's ranks x iterations grid) and the planner (one typical iteration): the same
latency model, the same DAG, the same numbers. Per rank, device-resident and host-resident sequences form
separate attention micro-batches of B_attn; micro-batch i of the host-resident ones holds
min(B_attn, n - i * B_attn) of them and its share of their summed context. Iterations stay lockstep over the
ranks at every layer's MoE (and at every dense layer's end, as in the plain pricing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.latency.tp_attention import partition_attention_decode
from batchgen.plan.layer import LayerCosts, compute_time, layer_time

# At most this many host-resident micro-batches get their own DAG nodes per layer; beyond it (a B_attn tiny
# next to the host-resident count) consecutive micro-batches are priced as one node each, with a launch per
# original micro-batch: a coarser pipeline than the real one, so a little less overlap is credited.
MAX_DAG_MICRO_BATCHES = 128


@dataclass
class Shards:
    """PARTITIONed sequences of one degree, as head shards on each rank and iteration: every rank of a group
    computes one query row of each sequence it serves with 1/degree of the heads
    (`tp_attention.partition_attention_decode`)."""

    degree: int
    tokens: np.ndarray    # (R, K) shard rows
    context: np.ndarray   # (R, K) their summed context
    launches: np.ndarray  # (R, K) attention calls: one per group of shards a lead rank sends (the executor's pieces)
    longest: np.ndarray   # (R, K) longest context among them


def shard_attention(lat: LatencyModel, shards: tuple[Shards, ...]) -> np.ndarray | float:
    """Seconds per layer of the head shards' attention on each rank and iteration (0.0 without shards)."""
    total = 0.0
    for s in shards:
        total = total + partition_attention_decode(lat, s.degree, s.tokens, s.context, s.launches, s.longest)
    return total


@dataclass
class DecodeGrid:
    """What each rank computes in each decode iteration: (ranks x iterations) arrays."""

    dev_tokens: np.ndarray         # device-resident decode queries in attention
    dev_context: np.ndarray        # their summed context
    dev_micro_batches: np.ndarray  # their attention launches
    host_tokens: np.ndarray        # host-resident decode queries in attention
    host_context: np.ndarray       # their summed context (KV restored per layer, or read by the CPU)
    gate_tokens: np.ndarray        # tokens entering this rank's gate (every running sequence)
    tp_join: np.ndarray | float = 0.0  # seconds per layer joining PARTITIONed attention shards (all-reduce)
    shards: tuple[Shards, ...] = ()    # PARTITIONed sequences' head shards (device-resident; not in dev_tokens)
    # where padded kernels are called on runs of similar contexts (pricing.costs.padded_runs): the device
    # queries' padded work / queries, the longest context each query is priced at; None: their summed context
    dev_longest: np.ndarray | None = None
    # where padded kernels attend restored KV: each host-resident micro-batch's padded work (M, R, K), its calls
    # cut in ascending context as the executor stages them (pricing.costs.staged_padded_work); None: summed
    host_work: np.ndarray | None = None
    # cascaded device queries' prefix kernels (batchgen.pricing.costs.CascadeLoad); their own pages: dev_context
    cascade: Any = None
    # cascaded host-resident queries' (a CascadeLoad): each call restores its prefix's KV once and attends it once;
    # their own pages: host_context
    host_cascade: Any = None


def attention_calls(queries, micro_batch: int):
    """Attention calls over `queries` in micro-batches of B_attn (0: one call where any query runs)."""
    if micro_batch > 0:
        return np.ceil(np.asarray(queries, float) / micro_batch)
    return (np.asarray(queries) > 0).astype(float)


def device_attention(lat: LatencyModel, grid: DecodeGrid):
    """Seconds per layer of the device-resident queries' attention on each rank and iteration."""
    own = lat.attention_decode(grid.dev_tokens, grid.dev_context, grid.dev_micro_batches, grid.dev_longest)
    c = grid.cascade
    return own if c is None else own + lat.attention_prefix(c.pairs, c.kv, c.calls)


def staged_attention(lat: LatencyModel, grid: DecodeGrid, tokens, context, launches):
    """Seconds per layer of each host-resident micro-batch's attention over its restored KV (`_host_micro_batches`'
    (M, R, K) arrays), padded as the executor's calls are where the grid says so; the cascades' prefix kernels
    beside it, each micro-batch its share of them."""
    longest = None
    if grid.host_work is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            longest = np.where(tokens > 0, grid.host_work / tokens, 0.0)
    seconds = lat.attention_decode(tokens, context, launches, longest)
    c = grid.host_cascade
    if c is None:
        return seconds
    share = _share(tokens, grid.host_tokens)
    return seconds + lat.attention_prefix(c.pairs * share, c.kv * share, c.calls * share)


def host_attention(lat: LatencyModel, grid: DecodeGrid, micro_batch: int):
    """Seconds per layer of the host-resident queries' attention on each rank and iteration (the module split's)."""
    if grid.host_work is None and grid.host_cascade is None:
        launches = np.ceil(grid.host_tokens / max(micro_batch, 1))
        return lat.attention_decode(grid.host_tokens, grid.host_context, launches)
    return np.sum(staged_attention(lat, grid, *staged_micro_batches(grid, micro_batch)[:3]), axis=0)


@dataclass
class DecodePrice:
    iteration_s: np.ndarray   # (K,) seconds of each iteration, lockstep (0 where nothing runs)
    rank_busy: np.ndarray     # (R,) GPU compute seconds of each rank over the run
    comm_s: np.ndarray        # (K,) all-to-all + host traffic / CPU time the GPU could not hide
    exposed_s: np.ndarray     # (K,) host traffic / CPU time the GPU could not hide (part of comm_s)
    moe_layer_s: np.ndarray   # (K,) steady-state seconds of one MoE layer (0 for a dense model)
    h2d_bytes: float          # host -> device bytes over the run, all ranks (restores, outputs, experts)
    d2h_bytes: float          # device -> host bytes over the run, all ranks (appends, queries)


def micro_batch_layout(peak: float, micro_batch: int) -> tuple[float, int, int]:
    """(sequences per DAG node, micro-batches per node, nodes) for a rank of at most `peak` sequences."""
    size = float(micro_batch) if micro_batch > 0 else peak
    m = math.ceil(peak / size - 1e-9)
    group = max(1, math.ceil(m / MAX_DAG_MICRO_BATCHES))
    size *= group
    return size, group, math.ceil(peak / size - 1e-9)


def _host_micro_batches(host_tokens: np.ndarray, host_context: np.ndarray, micro_batch: int):
    """(tokens, context, launches) of each host-resident micro-batch: (M, R, K) arrays."""
    peak = float(host_tokens.max(initial=0.0))
    if peak <= 0:
        empty = np.zeros((0,) + host_tokens.shape)
        return empty, empty, empty
    size, group, m = micro_batch_layout(peak, micro_batch)
    starts = np.arange(m, dtype=float)[:, None, None] * size
    tokens = np.clip(host_tokens[None] - starts, 0.0, size)
    context = host_context[None] * _share(tokens, host_tokens)
    launches = np.ceil(tokens / (size / group)) if micro_batch > 0 else (tokens > 0).astype(float)
    return tokens, context, launches


def _share(tokens, host_tokens):
    """Each micro-batch's share of its rank's host-resident queries in each iteration."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(host_tokens > 0, tokens / host_tokens, 0.0)


def staged_micro_batches(grid: DecodeGrid, micro_batch: int):
    """(tokens, context, launches, restored) of each host-resident micro-batch of the grid: (M, R, K) arrays;
    `restored`: the tokens whose KV it restores. A cascade's members are called apart from the others, in calls of
    B_attn, each restoring its prefix once: every micro-batch its share of those calls and prefixes."""
    tokens, context, launches = _host_micro_batches(grid.host_tokens, grid.host_context, micro_batch)
    c = grid.host_cascade
    if c is None or not tokens.shape[0]:
        return tokens, context, launches, context
    share = _share(tokens, grid.host_tokens)
    calls = attention_calls(grid.host_tokens - c.members, micro_batch) + c.calls
    return tokens, context, calls[None] * share, context + c.kv[None] * share


def layer_costs(lat: LatencyModel, grid: DecodeGrid, micro_batch: int, *, cpu_attention: bool, moe: bool,
                prefetch_s=0.0, replicas: int = 1, overlap: bool = False) -> LayerCosts:
    """Node costs of one decode layer (an MoE layer if `moe`, else a dense one) over the grid. `overlap`: each
    device-resident micro-batch's all-to-all beside the next one's compute (`overlapped_all_to_all`; a grid with
    host-resident sequences is refused: their DAG does not model it)."""
    t, ctx, launches, restored = staged_micro_batches(grid, micro_batch)
    dev_attn = device_attention(lat, grid)
    if grid.shards:
        dev_attn = dev_attn + shard_attention(lat, grid.shards)
    gate = grid.gate_tokens
    if moe:
        ffn = lat.shared_experts(gate) + lat.router(gate)
        total = gate.sum(axis=0) * replicas
        slowest, _ = lat.experts(total)
        moe_s = exposed_all_to_all(lat, grid, total, dev_attn + ffn + grid.tp_join, slowest, overlap) + slowest
    else:
        ffn, moe_s, prefetch_s = lat.dense_ffn(gate), 0.0, 0.0
    ffn = ffn + grid.tp_join  # partitioned attention's all-reduce, on the GPU stream before the FFN
    kw = {}
    if t.shape[0] and cpu_attention:
        down, back = lat.cpu_attention_ship(t, launches)
        kw = dict(host_attn=list(lat.attention_decode(t, 0.0, launches)), append=list(down),
                  cpu_attn=list(lat.cpu_attention(t, ctx, launches)), ship_back=list(back))
    elif t.shape[0]:
        kw = dict(host_attn=list(staged_attention(lat, grid, t, ctx, launches)),
                  restore=list(lat.kv_restore(restored, launches)),
                  append=list(lat.kv_append(t, launches)))
    return LayerCosts(dev_attn=dev_attn, ffn=ffn, moe=moe_s, prefetch=prefetch_s, cpu_attention=cpu_attention,
                      serial=lat.gpu.kind == "cpu", **kw)


def overlapped_all_to_all(lat: LatencyModel, total, lead, experts, micro_batches):
    """The expert all-to-all of one MoE layer that its compute does not hide, per iteration, when each attention
    micro-batch's dispatch is sent as soon as it is computed (while the next micro-batch's attention runs) and
    each combine as soon as the experts end (the next layer's first micro-batch waits for its own only).

    With M micro-batches of equal share, a = lead / M of attention each (`lead`: the slowest rank's work before
    the barrier), d = one phase of one micro-batch's all-to-all (M of them cost more than one whole: each pays
    the collective's latency), the layer takes the longer of its chain, max(lead + d, a + M d) + experts + d,
    and of its communication stream, 2 M d; less the compute, lead + experts. M = 1 leaves it serial."""
    m = np.maximum(micro_batches, 1.0)
    d = lat.all_to_all(total / m) / 2.0
    chain = np.maximum(lead + d, lead / m + m * d) + experts + d
    return np.maximum(chain, 2.0 * m * d) - lead - experts


def exposed_all_to_all(lat: LatencyModel, grid: DecodeGrid, total, work, experts, overlap: bool):
    """A MoE layer's all-to-all that compute does not hide: all of it, or with `overlap` what
    `overlapped_all_to_all` leaves of it behind `work` (each rank's compute before the barrier)."""
    if not overlap:
        return lat.all_to_all(total)
    if np.any(grid.host_tokens):
        raise ValueError("the micro-batches' all-to-all overlap is priced for device-resident decode only")
    lead = work.max(axis=0) if np.ndim(work) == 2 else work
    return overlapped_all_to_all(lat, total, lead, experts, np.max(grid.dev_micro_batches, axis=0))


def price_decode(lat: LatencyModel, grid: DecodeGrid, micro_batch: int, *, cpu_attention: bool = False,
                 prefetch_bytes=0.0, replicas: int = 1, overlap: bool = False) -> DecodePrice:
    """Lockstep decode iterations over the grid, each layer priced on its DAG.

    prefetch_bytes: expert weights each rank streams host -> device per MoE layer (0: resident weights); a
    float, or one value per iteration (column). replicas: each row of the grid stands for this many identical
    ranks (the planner prices one row for a whole instance); the bytes count all of them.
    """
    n_dense, n_moe = lat.layer_counts()
    gate = grid.gate_tokens
    R, K = gate.shape
    active = gate.sum(axis=0) > 0
    head = lat.lm_head(gate) + lat.step_overhead(gate)  # decode: one row per sequence
    iteration = np.asarray(head, float).max(axis=0)
    busy = np.asarray(lat.lm_head(gate), float).copy()
    exposed = np.zeros(K)
    comm = np.zeros(K)
    moe_layer = np.zeros(K)
    prefetch_bytes = prefetch_bytes if np.ndim(prefetch_bytes) else float(prefetch_bytes)
    prefetch_s = lat.h2d(prefetch_bytes) if np.any(prefetch_bytes) else 0.0
    for count, is_moe in ((n_dense, False), (n_moe, True)):
        if not count:
            continue
        c = layer_costs(lat, grid, micro_batch, cpu_attention=cpu_attention, moe=is_moe, prefetch_s=prefetch_s,
                        replicas=replicas, overlap=overlap)
        lt, ct = layer_time(c), compute_time(c)
        iteration = iteration + count * lt
        hidden_not = np.maximum(lt - ct, 0.0)
        exposed = exposed + count * hidden_not
        busy = busy + count * (c.gpu_work() - grid.tp_join)  # the join is communication, not compute
        if is_moe:
            total = gate.sum(axis=0) * replicas
            _, mean = lat.experts(total)
            busy = busy + count * mean
            comm = comm + count * exposed_all_to_all(lat, grid, total, c.dev_attn + c.ffn, lat.experts(total)[0],
                                                     overlap)
            moe_layer = np.broadcast_to(lt, (K,)).astype(float)
    iteration = np.where(active, iteration, 0.0)
    exposed = np.where(active, exposed, 0.0)
    comm = np.where(active, comm + exposed, 0.0)
    busy = np.where(active[None, :], np.broadcast_to(busy, (R, K)), 0.0)
    h2d, d2h = host_bytes(lat, grid, cpu_attention=cpu_attention)
    h2d += float((np.broadcast_to(prefetch_bytes, (K,)) * active).sum()) * n_moe * R
    return DecodePrice(iteration, busy.sum(axis=1), comm, exposed, np.where(active, moe_layer, 0.0),
                       h2d * replicas, d2h * replicas)


def host_bytes(lat: LatencyModel, grid: DecodeGrid, *, cpu_attention: bool) -> tuple[float, float]:
    """(h2d, d2h) bytes of host-resident decode over the grid, every layer: KV restored and appended, or (CPU
    attention) queries and new KV down, outputs back."""
    m = lat.model
    tokens = float(grid.host_tokens.sum())
    if tokens == 0:
        return 0.0, 0.0
    kv = m.kv_bytes_per_token_per_layer
    if cpu_attention:
        q = m.num_heads * m.head_dim * m.act_bytes
        return m.num_layers * tokens * q, m.num_layers * tokens * (q + kv)
    c = grid.host_cascade
    restored = float(grid.host_context.sum()) + (0.0 if c is None else float(c.kv.sum()))  # a prefix once per call
    return m.num_layers * restored * kv, m.num_layers * tokens * kv
