"""An offloading system's decode run on one rank with its KV on the GPU, priced without the per-layer DAG object.

Why. FlexGen and ZeRO-Inference with device KV on one GPU (Vidur's workload) price every run through
`pricing.microbatch.price_microbatched`: a dozen roofline calls on (1 x K) grids, a `Dag` of a dozen nodes per layer
and the module split priced again; about half of those policies' simulation time. On one rank with every
sequence's KV on the device, that DAG is a chain: every node with a cost sits on the GPU stream (attention, FFN,
the dense model's 0-second expert node), the weight ring costs nothing (a dense model streams no experts), and a
sync node waits for one rank only. A layer's steady-state time is then the second layer's chain minus the first's.

Same results, bit for bit: the chain adds the same costs in the DAG's order (a max over predecessors picks a value
without rounding), every cost is the roofline's own (elementwise on (K,) vectors instead of (1, K) grids), and every sum
over iterations is numpy's on arrays of the same layout. It applies where `chain_applies` (a plain `Roofline`, a dense
model) with one rank, no host-resident sequence and attention priced on summed contexts (no similar-context calls);
elsewhere `price_offload_one_rank` returns None and the DAG prices. `price_microbatched` takes the same chain for any
one-row device-KV grid (the planner's typical iteration too: `microbatched_one_rank`). tests/test_sim_paths.py checks
both against the DAG on random grids.
"""

from __future__ import annotations

import numpy as np

from batchgen.latency.roofline import Roofline
from batchgen.plan.decode import DecodeGrid, DecodePrice, _host_micro_batches
from batchgen.pricing.cost import RunCost


def chain_applies(lat) -> bool:
    """Whether a one-rank device-KV run of `lat` is priced as its chain: a plain `Roofline` of a dense model."""
    return type(lat) is Roofline and lat.layer_counts()[1] == 0 and not lat.model.is_moe


def price_offload_one_rank(lat: Roofline, grid: DecodeGrid, micro_batch: int, pipelined: bool):
    """`pricing.offload.price_offload` of a one-rank run with device KV: (cost, h2d bytes, d2h bytes, expert
    calls per iteration), or None where this path does not mirror it (see the module docstring)."""

    if grid.gate_tokens.shape[0] != 1 or grid.host_tokens.any() or grid.dev_longest is not None:
        return None
    out = _one_micro_batch(lat, grid, micro_batch, RunCost)
    return out if out is not None else _price(lat, grid, micro_batch, pipelined, RunCost)


def _one_micro_batch(lat: Roofline, grid: DecodeGrid, micro_batch: int, RunCost):
    """`_price` where the run is one micro-batch of every query, each sequence one gate token (the usual run:
    ZeRO-Inference's whole batch, a FlexGen block of one micro-batch); None where that does not hold
    (`chain_vectors`)."""
    chain = chain_vectors(lat, grid, micro_batch)
    return None if chain is None else chain.cost(slice(None), RunCost)


class Chain:
    """A one-micro-batch run's per-iteration amounts (see `chain_vectors`), reduced over any range of its
    iterations by `cost`: a run priced once and cut into consecutive runs (batchgen.sim.repeated) gives each
    the values of pricing it alone, since every amount is elementwise in the iteration and every reduction is
    numpy's on a contiguous range of the same values."""

    __slots__ = ("iteration", "busy", "exposed", "gate", "attention", "ffn", "head")

    def __init__(self, iteration, busy, exposed, gate, attention, ffn, head):
        self.iteration, self.busy, self.exposed, self.gate = iteration, busy, exposed, gate
        self.attention, self.ffn, self.head = attention, ffn, head

    def cost(self, part: slice, RunCost):
        """(cost, h2d bytes, d2h bytes, expert calls per iteration) of iterations `part`, as `price_offload`."""
        iteration = self.iteration[part]
        modules = {"attention": float(self.attention[part].sum()), "ffn": float(self.ffn[part].sum()),
                   "head": float(self.head[part].sum())}
        cost = RunCost(iteration, self.busy[part][None, :].sum(axis=1),
                       np.full(1, float(self.exposed[part].sum())), self.gate[part], modules)
        return cost, 0.0, 0.0, np.zeros(iteration.size)


def chain_vectors(lat: Roofline, grid: DecodeGrid, micro_batch: int) -> Chain | None:
    """Per-iteration amounts of a one-rank device-KV run that is one micro-batch of every query, with the
    operations that provably change no value left out: x + 0.0 and 0 + x are x for x >= +0 (every cost here),
    1.0 x kernel_s is kernel_s, and a mask is the identity where the masked cells are 0 already. Per iteration
    k with t_k queries (on: t_k > 0): the micro-batch is the queries themselves with their context and one
    launch (t_k <= micro_batch), so its attention is the module split's too; a layer's chain is attention then
    FFN, end1 = a + f and end2 = (end1 + a) + f. None where any of that does not hold."""
    n_dense = lat.layer_counts()[0]
    g = grid.gate_tokens[0]
    dev_t = grid.dev_tokens[0]
    top = float(g.max(initial=0.0))
    if (not n_dense or top <= 0 or (micro_batch > 0 and top > micro_batch) or g.dtype != np.float64
            or not (dev_t == g).all()):
        return None
    on = g > 0
    launches = on.astype(float)  # one per iteration with queries: ceil(t / micro_batch) = 1 for 0 < t <= micro_batch
    if not (grid.dev_micro_batches[0] == launches).all():
        return None
    a = lat.attention_decode(g, grid.dev_context[0], 1.0)
    f = lat.dense_ffn(g)
    head = lat.lm_head(g)
    step = lat.step_overhead(g)
    end1 = a + f  # also the micro-batch's GPU work (attention + FFN)
    lt = ((end1 + a) + f) - end1
    iteration = np.where(on, (head + step) + n_dense * lt, 0.0)
    exposed = np.where(on, 0.0 + n_dense * np.maximum(lt - end1, 0.0), 0.0)
    busy = np.where(on, head + n_dense * end1, 0.0)
    return Chain(iteration, busy, exposed, np.where(on, g, 0.0), n_dense * a, n_dense * f, head)


def microbatched_one_rank(lat: Roofline, grid: DecodeGrid, micro_batch: int, pipelined: bool,
                          replicas: int = 1):
    """`pricing.microbatch.price_microbatched` (DecodePrice, expert calls) of a one-row grid with device KV (the
    simulator's one-rank runs, the planner's typical iteration), or None where this path does not mirror it."""
    if grid.gate_tokens.shape[0] != 1 or grid.host_tokens.any() or grid.dev_longest is not None:
        return None
    price, calls, _ = _microbatched(lat, grid, micro_batch, pipelined, replicas)
    return price, calls


def _microbatched(lat: Roofline, grid: DecodeGrid, micro_batch: int, pipelined: bool, replicas: int = 1):
    """(DecodePrice, calls, LM head seconds per iteration): every micro-batch's attention and FFN priced in one
    vector call each (the roofline's formulas are elementwise), the chain added node by node in the DAG's order:
    on Python floats for a one-iteration grid (the planner's), on (K,) vectors otherwise."""
    n_dense = lat.layer_counts()[0]
    g = np.asarray(grid.gate_tokens, float)[0]
    K = g.size
    dev_t = np.asarray(grid.dev_tokens, float)[0]
    dev_c = np.asarray(grid.dev_context, float)[0]
    tokens, context, launches = _host_micro_batches(dev_t[None], dev_c[None], micro_batch)  # (M, 1, K)
    active = g > 0
    lm_head = lat.lm_head(g)
    step = lat.step_overhead(g)
    iteration = lm_head + step
    busy = lm_head.copy()
    exposed = np.zeros(K)
    m = tokens.shape[0]
    if n_dense and m:
        t = tokens[:, 0, :].ravel()
        attn = lat.attention_decode(t, context[:, 0, :].ravel(), launches[:, 0, :].ravel()).reshape(m, K)
        ffn = lat.dense_ffn(t).reshape(m, K)
        attn, ffn = (attn[:, 0].tolist(), ffn[:, 0].tolist()) if K == 1 else (list(attn), list(ffn))
        order = []  # the GPU stream's nodes in the DAG's order of issue (moe: the dense layer's 0-second node)
        if pipelined:
            order.append(attn[0])
            for i in range(m):
                if i + 1 < m:
                    order.append(attn[i + 1])
                order += [ffn[i], 0.0]
        else:
            for i in range(m):
                order += [attn[i], ffn[i], 0.0]
        ends = []
        x = 0.0
        for _layer in (1, 2):
            for cost in order:
                x = x + cost
            x = x + 0.0  # the layer's end node
            ends.append(x)
        lt = ends[1] - ends[0]
        work = sum(attn) + sum(ffn)
        ct = work + sum([0.0] * m)
        if K == 1:
            lt, work, ct = np.array([lt]), np.array([work]), np.array([ct])
        iteration = iteration + n_dense * lt
        exposed = exposed + n_dense * np.maximum(lt - ct, 0.0)
        busy = busy + n_dense * work
    iteration = np.where(active, iteration, 0.0)
    exposed = np.where(active, exposed, 0.0)
    comm = np.where(active, np.zeros(K) + exposed, 0.0)
    busy = np.where(active, busy, 0.0)
    # no expert weights to prefetch and no host KV: no bytes (0.0 x replicas, as the DAG's path gives)
    price = DecodePrice(iteration, busy[None, :].sum(axis=1), comm, exposed, np.zeros(K), 0.0 * replicas,
                        0.0 * replicas)
    return price, np.zeros(K), lm_head


def _price(lat: Roofline, grid: DecodeGrid, micro_batch: int, pipelined: bool, RunCost):
    """`price_offload` from `_microbatched`: the module split from the same latency model (device attention)."""
    n_dense = lat.layer_counts()[0]
    p, calls, lm_head = _microbatched(lat, grid, micro_batch, pipelined)
    g = np.asarray(grid.gate_tokens, float)[0]
    active = g > 0
    dev_attn = lat.attention_decode(np.asarray(grid.dev_tokens, float)[0], np.asarray(grid.dev_context, float)[0],
                                 np.asarray(grid.dev_micro_batches, float)[0])
    per_iteration = {"attention": n_dense * dev_attn, "ffn": np.zeros(g.size) + n_dense * lat.dense_ffn(g),
                     "head": lm_head}
    modules = {k: float(np.where(active, v, 0.0).sum()) for k, v in per_iteration.items()}
    cost = RunCost(p.iteration_s, p.rank_busy, np.full(1, float(p.comm_s.sum())), np.where(active, g, 0.0), modules)
    return cost, p.h2d_bytes, p.d2h_bytes, calls
