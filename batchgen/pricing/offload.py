"""A decode run under an offloading system's schedule (an FFN per attention micro-batch, weights loaded once
per layer and reused by the block's micro-batches), priced on `batchgen.pricing.microbatch`'s DAG."""

from __future__ import annotations

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.plan.decode import DecodeGrid, device_attention, host_attention
from batchgen.pricing.microbatch import _costs, _host_micro_batches, price_microbatched
from batchgen.pricing.cost import RunCost, module_split
from batchgen.pricing.scalar_offload import chain_applies, price_offload_one_rank


def price_offload(lat: LatencyModel, grid: DecodeGrid, micro_batch: int, *, cpu_attention: bool, pipelined: bool,
                  prefetch_bytes: float) -> tuple[RunCost, float, float, np.ndarray]:
    """(cost, h2d bytes, d2h bytes, expert calls per iteration) of the run; `rank_comm` holds the all-to-all
    and the host traffic / CPU time the GPU could not hide. One rank with device KV, a dense model: priced as a
    chain without the DAG object (batchgen.pricing.scalar_offload, the same values bit for bit)."""
    if grid.shards:
        raise ValueError("an offloading system's schedule with PARTITIONed sequences is not priced")
    out = price_offload_one_rank(lat, grid, micro_batch, pipelined) if chain_applies(lat) else None
    if out is not None:  # the chain's time; the module split's FFN per micro-batch, as below
        active = out[0].expert_tokens > 0
        out[0].modules["ffn"] = float(np.where(active, ffn_per_micro_batch(lat, grid, micro_batch), 0.0).sum())
        return out
    p, calls = price_microbatched(lat, grid, micro_batch, cpu_attention=cpu_attention, pipelined=pipelined,
                                  prefetch_bytes=prefetch_bytes)
    gate = grid.gate_tokens
    active = gate.sum(axis=0) > 0
    rank_comm = np.full(gate.shape[0], float(p.comm_s.sum()))
    attn = device_attention(lat, grid)
    if grid.host_tokens.any():  # else the host part is 0 everywhere: adding it changes nothing
        attn = attn + host_attention(lat, grid, micro_batch)
    modules = module_split(lat, attn, gate, gate, active)
    # the FFN as the DAG runs it, once per micro-batch (module_split's is one expert batch of the whole block)
    modules["ffn"] = float(np.where(active, ffn_per_micro_batch(lat, grid, micro_batch), 0.0).sum())
    cost = RunCost(p.iteration_s, p.rank_busy, rank_comm, np.where(active, gate.sum(axis=0), 0.0), modules)
    return cost, p.h2d_bytes, p.d2h_bytes, calls


def ffn_per_micro_batch(lat: LatencyModel, grid: DecodeGrid, micro_batch: int) -> np.ndarray:
    """FFN seconds per iteration (K,) of every layer when each attention micro-batch runs its own FFN: the DAG's
    own FFN nodes (`_costs`), a dense layer's FFN or a MoE layer's shared experts and router (the slowest rank)
    then its calls of all-to-all + routed experts, summed over the micro-batches."""
    hosted = bool(np.any(grid.host_tokens))
    tokens_in, ctx_in = (grid.host_tokens, grid.host_context) if hosted else (grid.dev_tokens, grid.dev_context)
    tokens, context, launches = _host_micro_batches(np.asarray(tokens_in, float), np.asarray(ctx_in, float),
                                                    micro_batch)
    out = np.zeros(np.shape(grid.gate_tokens)[1])
    for count, is_moe in zip(lat.layer_counts(), (False, True)):
        if count and tokens.shape[0]:
            c, _ = _costs(lat, tokens, context, launches, "device", is_moe, 1, 0.0)
            for ffn, moe in zip(c.ffn, c.moe):
                out = out + count * (np.max(np.asarray(ffn, float), axis=0) + moe)
    return out
