"""Decode priced as the offloading systems schedule it: every micro-batch runs its own FFN.

FlexGen, MoE-Lightning and ZeRO-Inference run a layer over a *block* of micro-batches: the layer's weights are
copied to the GPU once (while the previous layer computes: a ring of two layers) and reused by every micro-batch
of the block (FlexGen's zig-zag order), but each micro-batch goes through attention *and* the MoE on its own,
so the experts see one micro-batch at a time: that, not the block, is their expert batch. Module-based batching
(`batchgen.plan.layer`) instead combines all micro-batches into one expert batch. The per-layer DAG here
(same `Dag`, same latency model; costs broadcast over a ranks x iterations grid):

- GPU stream, per micro-batch i: its attention (over device KV, over KV restored into a staging buffer, or
  with CPU attention only the projections), then its FFN work (shared experts + router, or a dense FFN), then
  its routed experts (all-to-all + experts, lockstep over ranks: a sync node). The experts of layer l wait
  for layer l's weights.
- `pipelined` (MoE-Lightning's CGOPipe): the GPU issues the attention of micro-batch i + 1 before the FFN of
  micro-batch i, so the CPU attends micro-batch i + 1 while the GPU runs the experts of i. Without it
  (FlexGen's CPU delegation, ZeRO-Inference) each micro-batch's attention waits for the previous one's FFN.
- h2d link: KV restores (double-buffered: restore i may start once attention i - 2 has finished), CPU
  attention's outputs coming back, and the next layer's weights after this layer's restores (a ring of two
  layers: the copy for layer l + 1 starts once the experts of layer l - 1 have freed their slot). With CPU
  attention the weights use a link of their own ("weights"): the outputs coming back are a few KB per
  sequence and would otherwise queue behind a whole layer's weights (a real engine copies them on another
  stream; their bandwidth share is negligible).
- d2h link: new KV appended to host (restore path) or queries + new KV going down to the CPU.
- CPU: attention beside the host KV.

A layer's steady-state time is the end of layer 2 minus the end of layer 1 of a two-layer unroll, as in
`batchgen.plan.layer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.plan.dag import Dag
from batchgen.plan.decode import (DecodeGrid, DecodePrice, _host_micro_batches, device_attention, host_bytes,
                                  staged_attention)
from batchgen.pricing.scalar_offload import chain_applies, microbatched_one_rank

GPU, H2D, D2H, CPU, WEIGHTS = "gpu", "h2d", "d2h", "cpu", "weights"


@dataclass
class MicroBatchCosts:
    """Seconds of one layer's nodes, one entry per micro-batch (floats or ranks x iterations arrays)."""

    kind: str            # device (KV in GPU pages), staged (KV restored from host), cpu (CPU attention)
    attn: list           # GPU: attention (device / staged) or projections (cpu)
    ffn: list            # GPU: per-rank FFN work before the experts
    moe: list            # GPU, lockstep: all-to-all + routed experts of this micro-batch (0 for a dense layer)
    restore: list        # h2d: staged KV of this layer
    append: list         # d2h: new KV (staged) / queries + new KV (cpu)
    cpu: list            # CPU: attention beside host KV
    back: list           # h2d: attention outputs (cpu)
    prefetch: object = 0.0  # h2d: the next layer's weights


def build_dag(c: MicroBatchCosts, pipelined: bool, layers: int = 2, serial: bool = False) -> tuple[Dag, list[int]]:
    """`layers` identical layers; returns the DAG and each layer's end node. `serial`: one set of cores runs every
    node (a CPU device: the executor restores, appends and attends on the thread that computes), so every link
    and the CPU are the compute stream and nothing overlaps."""
    dag = Dag()
    m = len(c.attn)
    h2d, d2h, cpu = (GPU, GPU, GPU) if serial else (H2D, D2H, CPU)
    weight_link = GPU if serial else WEIGHTS if c.kind == "cpu" else H2D
    weights_for = dag.add("weights L1", c.prefetch, resource=weight_link)
    ends, last_moes, staged_attn = [], [], []
    for layer in range(1, layers + 1):
        tag = f"L{layer}"
        attn_done: dict[int, int] = {}
        restores: dict[int, int] = {}
        last_d2h = None

        def restore(i: int) -> None:
            g = (layer - 1) * m + i
            free = staged_attn[g - 2] if g >= 2 else None
            restores[i] = dag.add(f"restore {tag}.{i}", c.restore[i], after=[free], resource=h2d)

        def attention(i: int) -> None:
            nonlocal last_d2h
            if c.kind == "staged":
                a = dag.add(f"attn {tag}.{i}", c.attn[i], after=[restores[i]], resource=GPU)
                staged_attn.append(a)
                last_d2h = dag.add(f"append {tag}.{i}", c.append[i], after=[a], resource=d2h)
                if i + 2 < m:
                    restore(i + 2)
                attn_done[i] = a
            elif c.kind == "cpu":
                p = dag.add(f"proj {tag}.{i}", c.attn[i], resource=GPU)
                last_d2h = dag.add(f"ship q,kv {tag}.{i}", c.append[i], after=[p], resource=d2h)
                a = dag.add(f"cpu attn {tag}.{i}", c.cpu[i], after=[last_d2h], resource=cpu)
                attn_done[i] = dag.add(f"ship out {tag}.{i}", c.back[i], after=[a], resource=h2d)
            else:
                attn_done[i] = dag.add(f"attn {tag}.{i}", c.attn[i], resource=GPU)

        if c.kind == "staged":
            for i in range(min(2, m)):
                restore(i)
        moe = None
        if m:
            attention(0)
        for i in range(m):
            if pipelined and i + 1 < m:
                attention(i + 1)  # CGOPipe: the next micro-batch's attention is issued before this FFN
            f = dag.add(f"ffn {tag}.{i}", c.ffn[i], after=[attn_done[i], weights_for], resource=GPU)
            moe = dag.add(f"moe {tag}.{i}", c.moe[i], after=[f], resource=GPU, sync=True)
            if not pipelined and i + 1 < m:
                attention(i + 1)
        ring_free = last_moes[-1] if last_moes else None
        last_moes.append(moe)
        weights_for = dag.add(f"weights L{layer + 1}", c.prefetch, after=[ring_free], resource=weight_link)
        ends.append(dag.add(f"end {tag}", 0.0, after=[moe, last_d2h], sync=True))
    return dag, ends


def _row(x):
    return x[0] if isinstance(x, np.ndarray) and x.ndim == 2 else x


def _costs(lat: LatencyModel, tokens, context, launches, kind: str, moe: bool, replicas: int,
           prefetch, attention=None) -> tuple[MicroBatchCosts, list]:
    """Node costs of one layer for micro-batches given as (M, R, K) arrays; also each micro-batch's expert
    calls per iteration (K,) (a grouped node stands for several micro-batches, each its own expert call).
    `attention`: each device or staged micro-batch's attention seconds (M, R, K) where they are priced apart.
    Each module is priced once over every micro-batch (the latency model's formulas are elementwise); a node's
    cost is its micro-batch's (R, K) slice, or a Python float for one rank and one iteration (the DAG then
    compares floats)."""
    one = tokens.shape[1:] == (1, 1)
    split = (lambda a: np.asarray(a, float)[:, 0, 0].tolist()) if one else list

    def each(a):
        return split(np.broadcast_to(np.asarray(a, float), tokens.shape))

    c = MicroBatchCosts(kind, [], [], [], [], [], [], [], prefetch if moe else 0.0)
    if kind == "cpu":
        down, back = lat.cpu_attention_ship(tokens, launches)
        c.attn, c.append, c.back = each(lat.attention_decode(tokens, 0.0, launches)), each(down), each(back)
        c.cpu = each(lat.cpu_attention(tokens, context, launches))
    else:
        c.attn = each(lat.attention_decode(tokens, context, launches) if attention is None else attention)
        if kind == "staged":
            c.restore, c.append = each(lat.kv_restore(context, launches)), each(lat.kv_append(tokens, launches))
    calls = []
    if not moe:
        c.ffn, c.moe = each(lat.dense_ffn(tokens)), [0.0] * tokens.shape[0]
        return c, calls
    c.ffn = each(lat.shared_experts(tokens) + lat.router(tokens))
    for t, n in zip(tokens, launches):  # the routed experts see the instance's tokens: one call per micro-batch
        per_rank_calls = np.asarray(n, float).max(axis=0)
        total = t.sum(axis=0) * replicas / np.maximum(per_rank_calls, 1.0)
        slowest, _ = lat.experts(total)
        c.moe.append(per_rank_calls * (lat.all_to_all(total) + slowest))
        calls.append(per_rank_calls)
    return c, calls


def price_microbatched(lat: LatencyModel, grid: DecodeGrid, micro_batch: int, *, cpu_attention: bool,
                       pipelined: bool, prefetch_bytes=0.0, replicas: int = 1) -> tuple[DecodePrice, np.ndarray]:
    """Lockstep decode iterations over the grid with an FFN per micro-batch of `micro_batch` sequences (0: the
    whole rank's batch as one). Sequences are all device-resident or all host-resident (the offloading
    systems place the whole block's KV one way). Returns the price and the expert calls per MoE layer in each
    iteration (K,), which the per-expert batch is measured by. One row of a dense model with device KV: priced
    as the chain this DAG reduces to (batchgen.pricing.scalar_offload, the same values bit for bit)."""
    if np.shape(grid.gate_tokens)[0] == 1:
        out = microbatched_one_rank(lat, grid, micro_batch, pipelined, replicas) if chain_applies(lat) else None
        if out is not None:
            return out
    n_dense, n_moe = lat.layer_counts()
    gate = grid.gate_tokens
    R, K = gate.shape
    hosted = bool(np.any(grid.host_tokens))
    if hosted and np.any(grid.dev_tokens):
        raise ValueError("price_microbatched: a block is all device-resident or all host-resident")
    tokens_in, ctx_in = (grid.host_tokens, grid.host_context) if hosted else (grid.dev_tokens, grid.dev_context)
    kind = ("cpu" if cpu_attention else "staged") if hosted else "device"
    tokens, context, launches = _host_micro_batches(np.asarray(tokens_in, float), np.asarray(ctx_in, float),
                                                    micro_batch)
    attention = None
    if kind == "staged" and grid.host_work is not None and tokens.shape[0]:  # restored on the executor's padded calls
        attention = staged_attention(lat, grid, tokens, context, launches)
    if not hosted and grid.dev_longest is not None and tokens.shape[0]:
        # the executor's calls of similar contexts, priced over the rank, spread over the FFN micro-batches by
        # their share of its queries (the calls do not line up with the micro-batches)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(tokens_in > 0, tokens / tokens_in, 0.0)
        attention = np.asarray(device_attention(lat, grid), float)[None] * share
    active = gate.sum(axis=0) > 0
    lm_head = lat.lm_head(gate)  # a pure function: priced once for both uses
    head = lm_head + lat.step_overhead(gate)
    iteration = np.asarray(head, float).max(axis=0)
    busy = np.broadcast_to(np.asarray(lm_head, float), (R, K)).copy()
    exposed, comm = np.zeros(K), np.zeros(K)
    calls = np.zeros(K)
    prefetch_s = lat.h2d(prefetch_bytes) if np.any(prefetch_bytes) else 0.0
    for count, is_moe in ((n_dense, False), (n_moe, True)):
        if not count or not tokens.shape[0]:
            continue
        c, layer_calls = _costs(lat, tokens, context, launches, kind, is_moe, replicas, prefetch_s, attention)
        dag, ends = build_dag(c, pipelined, serial=lat.gpu.kind == "cpu")
        lt = _row(dag.finish[ends[1]] - dag.finish[ends[0]])
        work = sum(c.attn) + sum(c.ffn)
        gpu = np.asarray(work, float).max(axis=0) if np.ndim(work) == 2 else work
        ct = gpu + sum(c.moe)
        iteration = iteration + count * lt
        exposed = exposed + count * np.maximum(lt - ct, 0.0)
        busy = busy + count * np.broadcast_to(work, (R, K))
        if is_moe:
            calls = calls + sum(layer_calls)
            for t, n in zip(tokens, launches):
                per_rank_calls = np.asarray(n, float).max(axis=0)
                each = t.sum(axis=0) * replicas / np.maximum(per_rank_calls, 1.0)
                _, mean = lat.experts(each)
                busy = busy + count * per_rank_calls * mean
                comm = comm + count * per_rank_calls * lat.all_to_all(each)
    iteration = np.where(active, iteration, 0.0)
    exposed = np.where(active, exposed, 0.0)
    comm = np.where(active, comm + exposed, 0.0)
    busy = np.where(active[None, :], busy, 0.0)
    h2d, d2h = host_bytes(lat, grid, cpu_attention=cpu_attention) if hosted else (0.0, 0.0)
    h2d += float((np.broadcast_to(prefetch_bytes, (K,)) * active).sum()) * n_moe * R
    price = DecodePrice(iteration, busy.sum(axis=1), comm, exposed, np.zeros(K), h2d * replicas, d2h * replicas)
    return price, np.where(active, calls, 0.0)
