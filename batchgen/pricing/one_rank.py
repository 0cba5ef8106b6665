"""The load of a run on one rank, built without the (ranks x iterations) grid that `costs.decode_load` and
`costs.mixed_load` build for many ranks: per-iteration numbers (`price.price_cells`), or numbers for what stays
the same through a long run and vectors for what does not (`price.price_steady`).

A serving engine's forward and a decode run to the next finish are most of a simulation's events, and on one
rank the grid's bincounts and cumulative sums cost more than the pricing. The amounts are the grid's: sums of
whole numbers below 2^53, exact in any order; the longest chunk's square root is numpy's (both IEEE).
"""

from __future__ import annotations

import math

import numpy as np

from batchgen.pricing.costs import RankLoad


def decode_cells(context: np.ndarray, alive_for: np.ndarray, iterations: int,
                 micro_batch: int) -> list[list[float]]:
    """`costs.decode_load`'s fields (price.CELL_FIELDS) for one rank, nothing partitioned, no padding rows, no
    similar-context calls: per iteration k, the sequences still running (alive_for > k), their contexts summed
    (+ k each) and the longest (+ k)."""
    K = iterations
    n = alive_for.size
    if n and int(alive_for.min()) >= K:  # every sequence runs the whole run (a run to the first finish)
        tokens = [float(n)] * K
        base, top = float(context.sum()), float(context.max())
        ctx = [base + tokens[0] * k for k in range(K)]
        longest = [top + k for k in range(K)]
    else:
        alive = np.minimum(alive_for, K)
        count = np.bincount(alive, minlength=K + 1).tolist()
        total = np.bincount(alive, weights=context, minlength=K + 1).tolist()
        most = np.full(K + 1, -1, np.int64)
        np.maximum.at(most, alive, context)
        most = most.tolist()
        tokens, ctx, longest = [0.0] * K, [0.0] * K, [0.0] * K
        c = s = 0.0
        m = -1
        for k in range(K - 1, -1, -1):  # alive at k: alive_for in k + 1 .. K
            c += count[k + 1]
            s += total[k + 1]
            m = max(m, most[k + 1])
            tokens[k], ctx[k], longest[k] = c, s + c * k, (m + k if m >= 0 else 0.0)
    if micro_batch > 0:
        mb = [max(float(math.ceil(g / micro_batch)), 1.0) for g in tokens]
    else:
        mb = [1.0] * K
    zeros = [0.0] * K
    return [tokens, ctx, tokens, zeros, zeros, mb, [float(x) for x in longest], zeros, zeros, tokens]


def mixed_cells(chunk_start: np.ndarray, chunk_len: np.ndarray, chunk_completes: np.ndarray,
                decode_context: np.ndarray, micro_batch: int) -> tuple[list[list[float]], list[float]]:
    """`costs.mixed_load`'s fields (price.CELL_FIELDS) and head rows for one rank without similar-context
    calls: one forward's chunks beside its decodes."""
    p_tok = p_sq = p_seq = d_single = single_ctx = 0
    p_max = 0.0
    d_max = float(decode_context.max()) if decode_context.size else 0.0
    for s, n in zip(chunk_start.tolist(), chunk_len.tolist()):
        if n > 1:
            p_tok += n
            p_sq += n * n + 2 * s * n
            p_seq += 1
            p_max = max(p_max, math.sqrt(float(n * (s + n))))
        else:  # a one-token chunk attends like a decode query over start + 1
            d_single += 1
            single_ctx += s + 1
            d_max = max(d_max, float(s + 1))
    d_tok = float(decode_context.size + d_single)
    d_ctx = float(int(decode_context.sum()) + single_ctx)
    seqs = p_seq + d_tok
    mb = math.ceil(seqs / micro_batch) if micro_batch > 0 else (1.0 if seqs > 0 else 0.0)
    head = float(decode_context.size + int(np.count_nonzero(chunk_completes)))
    p_tok = float(p_tok)
    return ([[d_tok], [d_ctx], [p_tok + d_tok], [float(p_sq)], [p_tok], [max(float(mb), 1.0)], [d_max], [p_max],
             [float(p_seq)], [seqs]], [head])


def all_alive(context: np.ndarray, iterations: int, micro_batch: int, pad_rows: int,
              pad_context: int) -> RankLoad:
    """`costs.decode_load` of a one-rank run in which every one of the n sequences runs all K iterations (a
    static batch, whose finished rows are padding rows of the rank; a run to the first finish), nothing
    partitioned, no similar-context calls, in `price.price_steady`'s form: n + pad_rows queries and gate tokens
    each iteration, context (sum + n k) + (pad_context + pad_rows k), longest max + k (or the padding rows'
    mean + k where that is longer)."""
    n, K = context.size, iterations
    ks = np.arange(K)
    tokens = float(n) + pad_rows
    ctx = (float(context.sum()) + float(n) * ks) + (pad_context + pad_rows * ks)
    longest = float(context.max()) + ks
    if pad_rows > 0:
        longest = np.maximum(longest, np.float64(pad_context) / np.float64(pad_rows) + ks)
    mb = max(float(math.ceil(tokens / micro_batch)) if micro_batch > 0 else float(tokens > 0), 1.0)
    return RankLoad(tokens, ctx, tokens, 0.0, 0.0, mb, longest, 0.0, 0.0, tokens)


def steady(load: RankLoad) -> RankLoad | None:
    """A one-rank grid load in `price.price_steady`'s form (numbers for the fields that stay the same every
    iteration, vectors for the context and the longest), or None where another field changes within the run."""
    fields = {}
    for name in ("attn_tokens", "gate_tokens", "micro_batches", "sequences", "prefill_tokens", "prefill_sq",
                 "prefill_max", "prefill_seqs", "head_rows"):
        grid = getattr(load, name)
        if grid is None:
            fields[name] = None
            continue
        row = grid[0]
        first = row[0]
        if not (row == first).all():
            return None
        fields[name] = float(first)
    return RankLoad(attn_context=load.attn_context[0], attn_max=load.attn_max[0], **fields)
