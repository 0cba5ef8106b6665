"""Two-batch overlap (TBO, SGLang's --enable-two-batch-overlap): each forward split into two micro-batches so
that one's expert all-to-all (and TP-attention all-reduce) runs while the other computes.

Priced from the same latency model as `costs.price`, on half of each rank's load (the split is by sequences,
so each half carries about half the tokens, queries, context and prompt work of every rank):

- each half's GEMMs are half as large, so they run lower on the efficiency curve, and every module launches
  twice (the per-micro-batch launch overhead comes with the kernel time of each call, and the engine's
  per-forward overhead is paid per micro-batch);
- per MoE layer the two halves share one compute stream (2 c: attention, router, shared and routed experts of
  a half, slowest rank) and one communication stream (2 m: a half's all-to-all and join); with A's
  communication overlapping B's compute the layer takes max(2 c, 2 m) in steady state, plus min(c, m) once to
  fill the pipeline: communication is hidden only behind the other half's compute;
- dense layers have no all-to-all to hide: the halves run one after the other.
Where there is no communication (one GPU, a dense model) it is strictly slower than the whole forward.
The decision is the same; the executor runs the two micro-batches one after the other (batchgen.exec.backend),
without the overlap, which needs two streams and several processes: the overlap exists only in this price.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from batchgen.latency import LatencyModel


def halve(load):
    """Half of a rank load: the work of one of two micro-batches split by sequences (longest lengths kept)."""
    half = {f: getattr(load, f) / 2.0 for f in ("attn_tokens", "attn_context", "gate_tokens", "prefill_sq",
                                                 "prefill_tokens", "prefill_seqs", "sequences")}
    half["head_rows"] = None if load.head_rows is None else load.head_rows / 2.0
    return dataclasses.replace(load, **half)


def _whole(x):
    """Token counts of a half, as whole numbers (the latency model prices whole rows)."""
    return np.ceil(x)


def price_tbo(lat: LatencyModel, load, join=0.0):
    """RunCost of a run whose every forward is split in two overlapped micro-batches (see module docstring)."""
    from batchgen.sim.costs import RunCost, _module_totals

    n_dense, n_moe = lat.layer_counts()
    h = halve(load)
    gate = _whole(h.gate_tokens)
    attn = (lat.attention_decode(_whole(h.attn_tokens), h.attn_context, load.micro_batches, h.attn_max)
            + lat.attention_prefill(_whole(h.prefill_tokens), h.prefill_sq, 1, h.prefill_max, h.prefill_seqs))
    join_h = np.broadcast_to(np.asarray(join, float) / 2.0 if np.ndim(join) else join, gate.shape)
    if getattr(lat, "attention_tp", 1) > 1:
        join_h = join_h + lat.attention_join(_whole(h.attn_tokens) + _whole(h.prefill_tokens))
    rows = _whole(h.sequences if h.head_rows is None else h.head_rows)
    head = 2.0 * lat.lm_head(rows)
    busy = np.zeros(gate.shape) + head
    iteration = (head + 2.0 * lat.step_overhead(_whole(h.sequences))).max(axis=0)
    comm = np.zeros(gate.shape[1])
    ffn = np.zeros(gate.shape[1])
    if n_dense:
        dense_ffn = lat.dense_ffn(gate)
        dense = attn + dense_ffn
        iteration += n_dense * 2.0 * (dense + join_h).max(axis=0)  # nothing to overlap: one half, then the other
        busy += n_dense * 2.0 * dense
        ffn += n_dense * 2.0 * np.max(dense_ffn, axis=0)
        comm += n_dense * 2.0 * join_h.max(axis=0)
    if n_moe:
        total = _whole(load.gate_tokens.sum(axis=0) / 2.0)
        local_ffn = lat.shared_experts(gate) + lat.router(gate)
        slowest, mean = lat.experts(total)
        c = (attn + local_ffn).max(axis=0) + slowest          # one half's compute, slowest rank
        m = lat.all_to_all(total) + join_h.max(axis=0)        # one half's communication
        layer = np.maximum(2.0 * c, 2.0 * m)
        iteration += n_moe * layer + np.minimum(c, m)         # the pipeline fills once per forward
        busy += n_moe * 2.0 * (attn + local_ffn + mean)
        comm += n_moe * (layer - 2.0 * c) + np.minimum(c, m)  # what compute did not hide
        ffn += n_moe * 2.0 * (np.max(local_ffn, axis=0) + slowest) + n_moe * (layer - 2.0 * c)
    active = load.gate_tokens.sum(axis=0) > 0
    iteration = np.where(active, iteration, 0.0)
    rank_comm = np.full(gate.shape[0], float(comm[active].sum()))
    attention = (n_dense + n_moe) * 2.0 * np.max(np.broadcast_to(attn, gate.shape), axis=0)
    modules = _module_totals({"attention": attention, "ffn": ffn, "head": np.max(head, axis=0)}, active)
    return RunCost(iteration, busy.sum(axis=1), rank_comm,
                   np.where(active, load.gate_tokens.sum(axis=0), 0.0), modules)
