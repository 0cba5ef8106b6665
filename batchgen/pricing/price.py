"""Seconds of a run that is a chain of modules: each iteration's forward in lockstep over the instance's ranks.

One code prices both shapes a run comes in. A run over many ranks is a (ranks x iterations) grid of numpy arrays;
a run on one rank of a few iterations (a serving engine's forward, a decode run to the next finish) is priced
one iteration at a time on Python floats, because numpy's per-call cost on one-element arrays would be most of
the work. The latency models take either (batchgen.latency.arrays); the only step that differs is a reduction
over ranks, which on one rank is the value itself. Both end in the same `_cost`, so a one-rank run's numbers are
the grid's, bit for bit.

Runs with host-resident sequences or streamed expert weights are priced on their layer DAG instead
(batchgen.pricing.costs.price_host).
"""

from __future__ import annotations

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.latency.arrays import maximum_for
from batchgen.plan.decode import overlapped_all_to_all, shard_attention
from batchgen.pricing import one_rank
from batchgen.pricing.cost import RunCost, itself, module_totals, slowest_rank
from batchgen.pricing.costs import RankLoad
from batchgen.pricing.tbo import forward_tbo

# a one-rank run of more iterations than this is priced as arrays (a Python loop per iteration would cost more)
CELL_ITERATIONS = 12


def price(lat: LatencyModel, load: RankLoad, weight_stream_s: float = 0.0, join=0.0, tbo: bool = False,
          overlap: bool = False, dp_stream_s: float | None = None) -> RunCost:
    """Seconds per iteration for an instance in lockstep, and each rank's own busy time. `join`: seconds per
    layer each rank spends in the collective that joins partitioned attention (`costs.partition_join`); it
    delays that layer's FFN and counts as communication. A latency model whose rank is a TP-attention group
    (`attention_tp` > 1) adds its all-reduce of the group's hidden states per layer to the join. `tbo`: every
    forward split in two overlapped micro-batches (batchgen.pricing.tbo; not with streamed weights). `overlap`:
    each attention micro-batch's all-to-all beside the next one's compute (plan.decode.overlapped_all_to_all).
    `dp_stream_s` (not None): the forward runs data parallel, every rank through every expert on its own tokens
    with no all-to-all, while the experts it does not hold stream in at that many seconds per MoE layer (a
    data-parallel prefill; `weight_stream_s` is then part of it)."""
    if dp_stream_s is not None:
        return _cost(*forward(lat, load, 0.0, join, False, one=False, dp_stream_s=dp_stream_s))
    tbo = tbo and weight_stream_s <= 0
    if tbo and (load.shards or overlap):
        raise ValueError("two-batch overlap with PARTITIONed sequences or with the micro-batches' overlap is not "
                         "priced: a policy runs one or the other")
    R, K = load.gate_tokens.shape
    if R == 1 and not load.shards and type(join) is float and getattr(lat, "prices_floats", False):
        if K <= CELL_ITERATIONS:
            fields = [getattr(load, f)[0].tolist() for f in CELL_FIELDS]
            heads = None if load.head_rows is None else load.head_rows[0].tolist()
            return price_cells(lat, fields, heads, weight_stream_s, join, tbo, overlap)
        constant = one_rank.steady(load)
        if constant is not None:
            return price_steady(lat, constant, K, weight_stream_s, join, tbo, overlap)
    if tbo:
        parts = forward_tbo(lat, load, join, one=False)
    else:
        parts = forward(lat, load, weight_stream_s, join, overlap, one=False)
    return _cost(*parts)


# the RankLoad fields of a one-rank run, in `price_cells`'s order (head_rows apart: None means one per sequence)
CELL_FIELDS = ("attn_tokens", "attn_context", "gate_tokens", "prefill_sq", "prefill_tokens", "micro_batches",
               "attn_max", "prefill_max", "prefill_seqs", "sequences")


def price_cells(lat: LatencyModel, fields: list[list[float]], head_rows: list[float] | None,
                weight_stream_s: float = 0.0, join: float = 0.0, tbo: bool = False, overlap: bool = False) -> RunCost:
    """`price` of a one-rank run given as per-iteration floats: `fields` in CELL_FIELDS order, each a list over
    the iterations (batchgen.pricing.one_rank builds them without a grid)."""
    tbo = tbo and weight_stream_s <= 0
    cells = [RankLoad(*amounts) for amounts in zip(*fields)]
    if head_rows is not None:
        for cell, rows in zip(cells, head_rows):
            cell.head_rows = rows
    columns = [forward_tbo(lat, cell, join, one=True) if tbo else forward(lat, cell, weight_stream_s, join, overlap,
                                                                          one=True) for cell in cells]
    if len(columns) == 1:
        return _cost_of_one(*columns[0])
    parts = np.array(columns).T.copy()  # one contiguous row per part (the grid's layout: the same sums)
    if np.minimum.reduce(parts[7]) > 0:  # every iteration ran: each row's total in one reduction (row by row)
        iteration, busy, comm, comm_rank, attention, ffn, head, _ = np.add.reduce(parts, axis=1).tolist()
        totals = np.array([busy, comm + comm_rank])
        return RunCost(parts[0], totals[0:1], totals[1:2], parts[7],
                       {"attention": attention, "ffn": ffn, "head": head})
    return _cost(parts[0], parts[1:2], parts[2], parts[3:4], parts[4], parts[5], parts[6], parts[7])


def price_steady(lat: LatencyModel, load: RankLoad, iterations: int, weight_stream_s: float = 0.0, join: float = 0.0,
                 tbo: bool = False, overlap: bool = False) -> RunCost:
    """`price` of a one-rank run of many iterations whose amounts are numbers but for the context and the longest
    context, vectors over the iterations (one_rank.steady, one_rank.all_alive): what stays the same is priced
    once, on floats."""
    tbo = tbo and weight_stream_s <= 0
    parts = (forward_tbo(lat, load, join, one=True) if tbo
             else forward(lat, load, weight_stream_s, join, overlap, one=True))
    iteration, busy, comm, comm_rank, attention, ffn, head, gate = (
        p if type(p) is np.ndarray else np.full(iterations, float(p)) for p in parts)
    return _cost(iteration, busy[None, :], comm, comm_rank[None, :], attention, ffn, head, gate)


def forward(lat: LatencyModel, load: RankLoad, weight_stream_s: float, join, overlap: bool, one: bool,
            dp_stream_s: float | None = None) -> tuple:
    """Per iteration: (seconds, each rank's busy seconds, collective seconds every rank waits, each rank's own
    collective seconds, attention, FFN and head seconds of the slowest rank, gate tokens of the instance), as
    arrays over a grid or, with `one`, as floats of one rank's one iteration. `dp_stream_s`: see `price`; each MoE
    layer then takes the longer of its compute and its experts' copy (a two-layer ring: the next layer's experts
    load while this one computes), and the slowest rank sets the forward's end."""
    over = itself if one else slowest_rank
    n_dense, n_moe = lat.layer_counts()
    layers = n_dense + n_moe
    if getattr(lat, "attention_tp", 1) > 1:
        join = join + lat.attention_join(load.attn_tokens + load.prefill_tokens)
    attn = (lat.attention_decode(load.attn_tokens, load.attn_context, load.micro_batches, load.attn_max)
            + lat.attention_prefill(load.prefill_tokens, load.prefill_sq, 1.0, load.prefill_max, load.prefill_seqs))
    if load.shards:
        attn = attn + shard_attention(lat, load.shards)
    if load.cascade is not None:
        attn = attn + lat.attention_prefix(load.cascade.pairs, load.cascade.kv, load.cascade.calls)
    gate = load.gate_tokens
    head = lat.lm_head(load.sequences if load.head_rows is None else load.head_rows)
    zero = 0.0 if one else np.zeros(gate.shape)
    busy = zero + head
    iteration = over(head + lat.step_overhead(load.sequences))
    comm = 0.0 if one else np.zeros(gate.shape[1])
    comm_rank = zero + join * layers
    ffn = 0.0 if one else np.zeros(gate.shape[1])  # slowest rank's FFN work per iteration, all layers
    if n_dense:
        dense_ffn = lat.dense_ffn(gate)
        dense = attn + dense_ffn
        iteration += n_dense * over(dense + join)
        busy += n_dense * dense
        ffn += n_dense * over(dense_ffn)
    total = gate if one else gate.sum(axis=0)
    if n_moe and dp_stream_s is not None:
        local_ffn = lat.shared_experts(gate) + lat.router(gate) + lat.local_experts(gate)
        layer = np.maximum(attn + local_ffn + join, dp_stream_s)
        iteration += n_moe * over(layer)
        busy += n_moe * (attn + local_ffn)
        ffn += n_moe * over(layer - attn)
    elif n_moe:
        local_ffn = lat.shared_experts(gate) + lat.router(gate)
        local = attn + local_ffn
        slowest, mean = lat.experts(total)
        lead = over(local + join)
        a2a = (overlapped_all_to_all(lat, total, lead, slowest, over(load.micro_batches)) if overlap
               else lat.all_to_all(total))  # what the compute does not hide
        iteration += n_moe * (lead + a2a + slowest)
        busy += n_moe * (local + mean)
        comm = n_moe * a2a
        ffn += n_moe * (over(local_ffn) + a2a + slowest)
    if weight_stream_s > 0:  # streamed weights overlap compute layer by layer
        iteration = maximum_for(iteration)(iteration, weight_stream_s)
    per_rank_attn = attn if one or np.shape(attn) == gate.shape else np.broadcast_to(attn, gate.shape)
    return (iteration, busy, comm, comm_rank, layers * over(per_rank_attn), ffn, over(head), total)


def _cost_of_one(iteration, busy, comm, comm_rank, attention, ffn, head, gate) -> RunCost:
    """`_cost` of one iteration on floats: numpy's sum of one value v >= +0 is v, so each total is its value
    (the run's four arrays are views of one)."""
    if not gate > 0:
        iteration = comm = comm_rank = attention = ffn = head = gate = 0.0
    v = np.array([iteration, busy, gate, comm + comm_rank])
    return RunCost(v[0:1], v[1:2], v[3:4], v[2:3],
                   {"attention": float(attention), "ffn": float(ffn), "head": float(head)})


def _cost(iteration, busy, comm, comm_rank, attention, ffn, head, gate) -> RunCost:
    """The run's cost from its per-iteration parts (`forward`; busy and comm_rank per rank and iteration): the
    iterations in which no token reached the gate did not run."""
    if np.minimum.reduce(gate) > 0:  # the usual run: nothing to mask (every part a contiguous row: the same sums)
        add = np.add.reduce  # ndarray.sum's own reduction, without its Python wrapper
        return RunCost(iteration, add(busy, axis=1), float(add(comm)) + add(comm_rank, axis=1), gate,
                       {"attention": float(add(attention)), "ffn": float(add(ffn)), "head": float(add(head))})
    active = gate > 0
    rank_comm = float(comm[active].sum()) + comm_rank[:, active].sum(axis=1)
    modules = module_totals({"attention": attention, "ffn": ffn, "head": head}, active)
    return RunCost(np.where(active, iteration, 0.0), busy.sum(axis=1), rank_comm, np.where(active, gate, 0.0),
                   modules)
