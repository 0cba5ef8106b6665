"""Two-batch overlap (TBO, SGLang's --enable-two-batch-overlap): each forward split into two micro-batches so
that one's expert all-to-all (and TP-attention all-reduce) runs while the other computes.

Priced from the same latency model as `price.price`, on each micro-batch's load (the split is by sequences:
the first takes ceil(S/2) of a rank's S sequences and their share of its tokens, context and prompt work, the
second the rest, nothing on a rank that runs one sequence):

- each half's GEMMs are half as large, so they run lower on the efficiency curve, and every module launches
  twice (the per-micro-batch launch overhead comes with the kernel time of each call, and the engine's
  per-forward overhead is paid per micro-batch);
- per MoE layer the two halves share one compute stream (c_A + c_B: attention, router, shared and routed
  experts of each half, slowest rank) and one communication stream (m_A + m_B: each half's all-to-all and
  join), and each half's own chain (c + m) must fit too: the layer takes max(c_A + c_B, m_A + m_B, c_A + m_A,
  c_B + m_B), and the second half's last all-to-all is exposed once per forward: communication is hidden only
  behind the other half's compute;
- dense layers have no all-to-all to hide: the halves run one after the other.
Where there is no communication (one GPU, a dense model) it is strictly slower than the whole forward.
The decision is the same; the executor runs the two micro-batches one after the other (batchgen.exec.backend),
without the overlap, which needs two streams and several processes: the overlap exists only in this price.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from batchgen.core.sequences import InvariantError

from batchgen.latency import LatencyModel
from batchgen.latency.arrays import rint
from batchgen.pricing.cost import itself, slowest_rank


def split(load):
    """The two micro-batches of a rank load (a grid, or one rank's iteration as floats), split by sequences: the
    first takes ceil(S/2) of each rank's S sequences, the second the rest (none where a rank runs one); every
    amount of work goes with its share of the sequences (token counts rounded to whole rows), the longest lengths
    stay with both."""
    seqs = load.sequences
    if type(seqs) is float:
        share = math.ceil(seqs / 2.0) / seqs if seqs > 0 else 0.0
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(seqs > 0, np.ceil(seqs / 2.0) / seqs, 0.0)
    first, second = {}, {}
    for name in ("attn_tokens", "gate_tokens", "prefill_tokens", "prefill_seqs", "sequences", "head_rows"):
        total = getattr(load, name)
        if total is None:  # head_rows: one per sequence, split with them
            first[name] = second[name] = None
            continue
        first[name] = rint(total * share)
        second[name] = total - first[name]
    for name in ("attn_context", "prefill_sq"):
        first[name] = getattr(load, name) * share
        second[name] = getattr(load, name) * (1.0 - share)
    return [dataclasses.replace(load, **first), dataclasses.replace(load, **second)]


def forward_tbo(lat: LatencyModel, load, join, one: bool) -> tuple:
    """`price.forward`'s per-iteration parts for a run whose every forward is split in two overlapped
    micro-batches (see the module docstring); with `one`, of one rank's one iteration on floats."""
    over = itself if one else slowest_rank
    n_dense, n_moe = lat.layer_counts()
    shape = () if one else load.gate_tokens.shape
    zero = 0.0 if one else np.zeros(shape[1])
    iteration, busy = zero, (0.0 if one else np.zeros(shape))
    comm = ffn = attention = head_s = zero
    c_moe, m_moe = [], []
    if load.cascade is not None:
        raise InvariantError("two-batch overlap splits a forward in halves; cascades are not priced so (the policy "
                             "refuses policy.cascade_attention with it)")
    for h in split(load):
        if one:
            join_h = join * (h.sequences / load.sequences if load.sequences > 0 else 0.0) if np.ndim(join) else join
        else:
            share = np.divide(h.sequences, load.sequences, out=np.zeros(shape), where=load.sequences > 0)
            join_h = np.broadcast_to(np.asarray(join, float) * (share if np.ndim(join) else 1.0), shape)
        attn = (lat.attention_decode(h.attn_tokens, h.attn_context, h.micro_batches, h.attn_max)
                + lat.attention_prefill(h.prefill_tokens, h.prefill_sq, 1.0, h.prefill_max, h.prefill_seqs))
        if getattr(lat, "attention_tp", 1) > 1:
            join_h = join_h + lat.attention_join(h.attn_tokens + h.prefill_tokens)
        gate = h.gate_tokens
        head = lat.lm_head(h.sequences if h.head_rows is None else h.head_rows)
        overhead = lat.step_overhead(h.sequences)
        busy = busy + head
        iteration = iteration + over(head + overhead)
        head_s = head_s + over(head)
        attention = attention + (n_dense + n_moe) * over(attn if one else np.broadcast_to(attn, shape))
        if n_dense:
            dense_ffn = lat.dense_ffn(gate)
            iteration = iteration + n_dense * over(attn + dense_ffn + join_h)  # nothing to overlap: one, then the other
            busy = busy + n_dense * (attn + dense_ffn)
            ffn = ffn + n_dense * over(dense_ffn)
            comm = comm + n_dense * over(join_h)
        if n_moe:
            total = gate if one else gate.sum(axis=0)
            local_ffn = lat.shared_experts(gate) + lat.router(gate)
            slowest, mean = lat.experts(total)
            c_moe.append(over(attn + local_ffn) + slowest)  # the half's compute, slowest rank
            m_moe.append(lat.all_to_all(total) + over(join_h))  # the half's communication
            busy = busy + n_moe * (attn + local_ffn + mean)
            ffn = ffn + n_moe * (over(local_ffn) + slowest)
    if n_moe:
        (c_a, c_b), (m_a, m_b) = c_moe, m_moe
        # per layer: one compute stream (both halves), one communication stream, and each half's own chain
        streams = (c_a + c_b, m_a + m_b, c_a + m_a, c_b + m_b)
        layer = (max(streams) if all(type(x) is float for x in streams)
                 else np.maximum(np.maximum(streams[0], streams[1]), np.maximum(streams[2], streams[3])))
        exposed = n_moe * (layer - c_a - c_b) + m_b  # the last half's last all-to-all has nothing left to hide it
        iteration = iteration + (n_moe * layer + m_b)
        comm = comm + exposed
        ffn = ffn + exposed
    # every rank waits for the instance's communication (no join of its own beyond it)
    comm_rank = 0.0 if one else np.zeros(shape)
    return (iteration, busy, comm, comm_rank, attention, ffn, head_s,
            load.gate_tokens if one else load.gate_tokens.sum(axis=0))
