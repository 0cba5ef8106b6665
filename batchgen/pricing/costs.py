"""Turn one run of an instance (a fixed batch for up to N iterations) into time, without a per-token loop.

Between two boundaries a batch only changes when sequences end, so the per-iteration load of every rank is a
step function of the iteration index: built with one bincount and a reversed cumulative sum, then priced on a
(ranks x iterations) grid by the latency model. The instance runs in lockstep: at every MoE layer each rank
waits for the slowest one (the all-to-all), which is where stragglers cost time; `rank_busy` keeps each rank's
own compute so the idle share is visible.

Decode runs with host-resident sequences (KV restored per layer and micro-batch, or attention on the host CPU)
or with streamed expert weights are priced layer by layer on the per-layer DAG of batchgen.plan, where
transfers overlap compute only as far as their dependencies allow (`price_host`); every other run is a chain
of modules and keeps the plain sum (batchgen.pricing.price), which the DAG reduces to when nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.plan.decode import (DecodeGrid, Shards, attention_calls, device_attention, host_attention,
                                  micro_batch_layout,
                                  price_decode, shard_attention)
from batchgen.pricing.cost import RunCost, module_split


@dataclass
class CascadeLoad:
    """Cascade attention's prefix kernels on each rank and iteration: (ranks x iterations) arrays."""

    pairs: np.ndarray    # prefix tokens the cascaded queries attend (their own pages are in attn_context)
    kv: np.ndarray       # prefix tokens whose KV the calls read: each prefix once per call
    calls: np.ndarray    # prefix kernel calls
    members: np.ndarray  # cascaded queries (called apart from the others)


@dataclass
class RankLoad:
    """What each rank computes in each iteration: (ranks x iterations) arrays."""

    attn_tokens: np.ndarray     # decode queries in whole-head attention (PARTITIONed ones are in `shards`)
    attn_context: np.ndarray    # summed context those decode queries attend to
    gate_tokens: np.ndarray     # tokens that enter this rank's FFN / router
    prefill_sq: np.ndarray      # sum of squared prompt lengths (prefill attention), else 0
    prefill_tokens: np.ndarray  # prompt tokens prefilled
    micro_batches: np.ndarray   # attention launches (B_attn micro-batches)
    attn_max: np.ndarray        # longest context among the decode queries (padded kernels pay it per query)
    prefill_max: np.ndarray     # longest prompt prefilled, else 0
    prefill_seqs: np.ndarray    # prompts prefilled
    sequences: np.ndarray       # sequences in the forward (the engine's per-forward overhead grows with them)
    head_rows: np.ndarray | None = None  # rows through the LM head and sampling (None: one per sequence)
    shards: tuple[Shards, ...] = ()      # PARTITIONed sequences' head shards (batchgen.plan.decode.Shards)
    cascade: CascadeLoad | None = None   # cascaded decode queries' prefix kernels (out of attn_context)


def cascade_load(rank: np.ndarray, group: np.ndarray, shared: np.ndarray, alive_for: np.ndarray, micro_batch: int,
                 R: int, K: int) -> CascadeLoad | None:
    """The prefix kernels of a run's cascades (batchgen.core.cascade; `group` and `shared` per decode query, as the
    plan gives them): on each rank and iteration, a cascade's members still running are called in calls of at
    most B_attn, and each call reads the prefix once. None where nothing is cascaded."""
    on = group >= 0
    if not on.any():
        return None
    r, g, tokens, alive = rank[on], group[on], shared[on].astype(float), alive_for[on]
    key = r * (int(g.max()) + 1) + g
    cascades, member = np.unique(key, return_inverse=True)
    running = _alive(member, alive, np.ones(member.size), cascades.size, K)  # (cascades, K) members running
    calls_each = attention_calls(running, micro_batch)
    prefix = np.zeros(cascades.size)
    prefix[member] = tokens  # one prefix per cascade: its members hold the same one
    where = cascades // (int(g.max()) + 1)
    calls, kv = np.zeros((R, K)), np.zeros((R, K))
    np.add.at(calls, where, calls_each)
    np.add.at(kv, where, calls_each * prefix[:, None])
    return CascadeLoad(_alive(r, alive, tokens, R, K), kv, calls, _alive(r, alive, np.ones(r.size), R, K))


@dataclass(frozen=True)
class cascade_pays:  # noqa: N801 - used as a function of the latency model; a class so that a state pickles
    """The `groups` rule's test (batchgen.core.cascade.CascadeRule.pays), for one rank: its `queries` device decode
    queries over `context` tokens, and candidate cascades of `members` over prefixes of `prefix` tokens. The rank's
    decode attention is priced as `with_cascade` prices it (own pages in calls of B_attn, the cascaded members
    apart; each cascade call reading its prefix once); candidates join, most saved reads first, while each
    lowers that price. Returns which join."""

    lat: LatencyModel

    def __call__(self, queries: int, context: float, members: np.ndarray, prefix: np.ndarray,
                 micro_batch: int) -> np.ndarray:
        calls = attention_calls(members, micro_batch)

        def price(chosen: list[int]) -> float:
            n, p, c = members[chosen], prefix[chosen], calls[chosen]
            rest = queries - float(n.sum())
            own = float(attention_calls(rest, micro_batch)) + float(c.sum())
            seconds = self.lat.attention_decode(float(queries), context - float(n @ p), max(own, 1.0))
            if chosen:
                seconds += self.lat.attention_prefix(float(n @ p), float(p @ c), float(c.sum()))
            return float(seconds)

        chosen: list[int] = []
        best = price(chosen)
        for k in np.argsort(-(members - 1) * prefix, kind="stable").tolist():
            trial = price(chosen + [k])
            if trial < best:
                chosen, best = chosen + [k], trial
        out = np.zeros(members.size, bool)
        out[chosen] = True
        return out


def with_cascade(load, cascade: CascadeLoad | None, micro_batch: int, over: np.ndarray):
    """`load` (a RankLoad or DecodeGrid whose decode contexts are their own pages) with its cascades: their
    prefix kernels, and their members called apart from the other queries (`over`: the queries its calls are
    counted over), in micro-batches of B_attn (under padded kernels too: their runs of similar contexts are not
    formed again without the members)."""
    if cascade is None:
        return load
    load.cascade = cascade
    rest = over - cascade.members
    calls = attention_calls(rest, micro_batch) + cascade.calls
    if isinstance(load, RankLoad):
        load.micro_batches = np.maximum(calls, 1.0)
    else:
        load.dev_micro_batches = calls
    return load


def decode_participation(remaining: np.ndarray, steps: int, stop: str, rank: np.ndarray,
                         num_ranks: int) -> tuple[int, np.ndarray]:
    """How many iterations the run lasts and how many tokens each sequence makes in it. A run ends when its last
    sequence does, whatever its stop rule: an executor decodes no iteration with nobody left."""
    if remaining.size == 0:
        return max(steps, 1), remaining
    k = min(steps, int(remaining.max()))
    if stop == "first_finish":
        k = min(k, int(remaining.min()))
    elif stop == "rank_drains":
        longest = np.zeros(num_ranks, np.int64)
        np.maximum.at(longest, rank, remaining)
        k = min(k, int(longest[longest > 0].min()))
    k = max(k, 1)
    return k, np.minimum(remaining, k)


def _attention(rank: np.ndarray, context: np.ndarray, alive_for: np.ndarray, tp: np.ndarray, R: int,
               K: int, longest: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(queries, summed context, longest context) in whole-head attention per rank and iteration: every
    sequence that is not PARTITIONed, on its own rank (the partitioned ones are `_shards`)."""
    if tp.size and tp.max() > 1:
        whole = tp == 1
        rank, context, alive_for = rank[whole], context[whole], alive_for[whole]
    ones, ctx = np.ones(rank.size), context.astype(float)
    attn_tokens = _alive(rank, alive_for, ones, R, K)
    attn_ctx0 = _alive(rank, alive_for, ctx, R, K)
    top = _longest_alive(rank, alive_for, ctx, R, K) if longest else None  # None: the caller does not use it
    return attn_tokens, attn_ctx0 + attn_tokens * np.arange(K), top


def _shards(rank: np.ndarray, context: np.ndarray, alive_for: np.ndarray, tp: np.ndarray, R: int,
            K: int) -> tuple[Shards, ...]:
    """PARTITIONed sequences as head shards, one `Shards` per degree: a sequence of degree d led by rank r runs
    a shard on ranks r..r+d-1 (mod R), each a query row over the whole context (the shard's shapes set what of
    its KV and weights a rank reads); its token enters the gate once, on the lead (`decode_load`). A lead's
    sequences of one degree form one call per member rank, as the executor groups them."""
    out = []
    for degree in np.unique(tp[tp > 1]):
        d = int(degree)
        sel = np.flatnonzero(tp == d)
        rep = np.repeat(sel, d)
        member = (rank[rep] + np.tile(np.arange(d), sel.size)) % R
        ctx = context[rep].astype(float)
        tokens = _alive(member, alive_for[rep], np.ones(rep.size), R, K)
        summed = _alive(member, alive_for[rep], ctx, R, K) + tokens * np.arange(K)
        leads, group = np.unique(rank[sel], return_inverse=True)
        group_alive = np.zeros(leads.size, np.int64)
        np.maximum.at(group_alive, group, alive_for[sel])
        lead_rep = np.repeat(np.arange(leads.size), d)
        lead_member = (leads[lead_rep] + np.tile(np.arange(d), leads.size)) % R
        launches = _alive(lead_member, group_alive[lead_rep], np.ones(lead_rep.size), R, K)
        out.append(Shards(d, tokens, summed, launches, _longest_alive(member, alive_for[rep], ctx, R, K)))
    return tuple(out)


def _longest_alive(rank: np.ndarray, alive_for: np.ndarray, context: np.ndarray, R: int, K: int) -> np.ndarray:
    """Longest context among the sequences on each rank still running at each iteration: (R, K), 0 where
    none runs. A sequence's context grows by one per iteration, so it is the longest starting context among
    those alive for more than k iterations, plus k."""
    start = np.full((R, K + 1), -np.inf)
    np.maximum.at(start, (rank, np.minimum(alive_for, K)), context)
    alive_max = np.maximum.accumulate(start[:, ::-1], axis=1)[:, ::-1][:, 1:]  # alive_for > k
    return np.where(np.isfinite(alive_max), alive_max + np.arange(K), 0.0)


def partition_join(lat: LatencyModel, rank: np.ndarray, alive_for: np.ndarray, tp: np.ndarray, R: int,
                   K: int) -> np.ndarray | float:
    """Seconds per layer each rank spends joining PARTITIONed sequences' head shards: one all-reduce per
    iteration over its group of the shards' o_proj outputs (a hidden row per partitioned token). 0 when nothing
    is partitioned. Groups of a run share one degree (the policy partitions the tail uniformly); the largest
    is used."""
    split = tp > 1
    if not split.any():
        return 0.0
    rep = np.repeat(np.flatnonzero(split), tp[split])
    offset = np.arange(rep.size) - np.repeat(np.cumsum(tp[split]) - tp[split], tp[split])
    tokens = _alive((rank[rep] + offset) % R, alive_for[rep], np.ones(rep.size), R, K)
    return lat.all_reduce(tokens * lat.model.hidden_size * lat.model.act_bytes, int(tp.max()))


# Padded attention kernels are called on runs of similar contexts (the executor's calls, batchgen.exec.runner,
# which imports these): a run's longest context is at most SIMILAR x its shortest + SIMILAR_SLACK tokens (short
# contexts need not be split finely), and a run holds at most B_attn sequences; so the padded work is per run,
# and every run is a call (a launch, the projections).
SIMILAR, SIMILAR_SLACK = 1.25, 64


def similar_runs(rank: np.ndarray, context: np.ndarray, micro_batch: int) -> np.ndarray:
    """Run index of each sequence when each rank's sequences, in ascending context, are cut into runs of
    similar contexts (see SIMILAR); runs of one rank are numbered consecutively and never mix ranks."""
    order = np.lexsort((context, rank))
    r, c = rank[order], context[order].astype(float)
    run = np.empty(rank.size, np.int64)
    start, n, k = 0, rank.size, 0
    while start < n:
        stop = np.searchsorted(r, r[start], side="right")  # this rank's block
        end = start + np.searchsorted(c[start:stop], SIMILAR * c[start] + SIMILAR_SLACK, side="right")
        if micro_batch > 0:
            end = min(end, start + micro_batch)
        run[order[start:end]] = k
        start, k = end, k + 1
    return run


def padded_runs(rank: np.ndarray, context: np.ndarray, alive_for: np.ndarray, micro_batch: int, R: int,
                K: int) -> tuple[np.ndarray, np.ndarray]:
    """(calls, padded work) per rank and iteration of decode attention called on runs of similar contexts, cut
    as the executor cuts them (batchgen.exec.runner) at every forward: over the sequences still running, at
    their contexts then; each run pays its sequences x its longest context, and work / queries is the
    effective longest context the latency model sees."""
    calls, work = np.zeros((R, K)), np.zeros((R, K))
    grown = context.astype(float)
    for k in range(K):
        live = alive_for > k
        if not live.any():
            break  # nobody runs from here on
        r, c = rank[live], grown[live] + k
        run = similar_runs(r, c, micro_batch)
        runs = int(run.max()) + 1
        longest = np.zeros(runs)
        np.maximum.at(longest, run, c)
        run_rank = np.zeros(runs, np.int64)
        run_rank[run] = r
        calls[:, k] = np.bincount(run_rank, minlength=R)
        work[:, k] = np.bincount(run_rank, weights=np.bincount(run, minlength=runs) * longest, minlength=R)
    return calls, work


def decode_grid(rank: np.ndarray, context: np.ndarray, alive_for: np.ndarray, tp: np.ndarray,
                host_resident: np.ndarray, num_ranks: int, iterations: int, micro_batch: int,
                pad_rows: np.ndarray, pad_context: np.ndarray, similar_calls: bool = False,
                cpu_attention: bool = False, cascade: np.ndarray | None = None) -> DecodeGrid:
    """Per-iteration load of a decode run with device- and host-resident sequences kept apart (they form
    separate attention micro-batches); padding rows are device-resident. `similar_calls`: padded kernels,
    called as the executor calls them: the device-resident queries in runs of similar contexts (as in
    `decode_load`), the host-resident ones, restored unless `cpu_attention`, in micro-batches of ascending
    context (`staged_padded_work`; `cascade`: each sequence's cascade, whose members are called apart)."""
    K, R = iterations, num_ranks
    partitioned = tp.size > 0 and tp.max() > 1
    if partitioned and (host_resident & (tp > 1)).any():
        raise ValueError("a PARTITIONed sequence is host-resident: its shards' KV would have to be restored on "
                         "every rank of its group, which no backend does (partition device-resident sequences)")
    hosted = bool(host_resident.any())
    dev = ~host_resident
    d_rank, d_context, d_alive, d_tp = ((rank[dev], context[dev], alive_for[dev], tp[dev]) if hosted
                                        else (rank, context, alive_for, tp))
    dev_tokens, dev_ctx, _ = _attention(d_rank, d_context, d_alive, d_tp, R, K, longest=False)
    if pad_rows.any():
        dev_tokens = dev_tokens + pad_rows[:, None]
        dev_ctx = dev_ctx + (pad_context[:, None] + pad_rows[:, None] * np.arange(K))
    # a gate token per device query (a partitioned sequence's on its lead) and per padding row
    gate = (_alive(d_rank, d_alive, np.ones(d_rank.size), R, K) + pad_rows[:, None] if partitioned
            else dev_tokens + 0.0)
    if hosted:  # host-resident sequences are never partitioned: one query and one gate token each
        host_tokens, host_ctx, _ = _attention(rank[host_resident], context[host_resident], alive_for[host_resident],
                                              tp[host_resident], R, K, longest=False)
        gate = gate + host_tokens
    else:
        host_tokens = host_ctx = np.zeros((R, K))
    # attention calls over the whole-head queries (every device query and padding row when nothing is partitioned)
    mb = attention_calls(dev_tokens, micro_batch)
    longest = None
    if similar_calls and not partitioned and not pad_rows.any():
        mb, work = padded_runs(d_rank, d_context, d_alive, micro_batch, R, K)
        with np.errstate(divide="ignore", invalid="ignore"):
            longest = np.where(dev_tokens > 0, work / dev_tokens, 0.0)
    host_work = None
    if similar_calls and hosted and not cpu_attention:
        host_work = staged_padded_work(rank[host_resident], context[host_resident], alive_for[host_resident],
                                       micro_batch, R, K, float(host_tokens.max(initial=0.0)),
                                       None if cascade is None or not cascade.size else cascade[host_resident])
    shards = _shards(rank, context, alive_for, tp, R, K) if partitioned else ()
    return DecodeGrid(dev_tokens, dev_ctx, mb, host_tokens, host_ctx, gate, shards=shards, dev_longest=longest,
                      host_work=host_work)


def staged_padded_work(rank: np.ndarray, context: np.ndarray, alive_for: np.ndarray, micro_batch: int, R: int,
                       K: int, peak: float, cascade: np.ndarray | None = None) -> np.ndarray:
    """Padded work (M, R, K) of each host-resident micro-batch node of the DAG (`micro_batch_layout` for `peak`
    sequences on a rank): the executor restores each rank's host-resident sequences, in ascending context, in
    calls of `micro_batch` (batchgen.exec.runner._chunks_within; 0: one call), each cascade's members (`cascade`,
    -1: none) in calls of their own, and each call pays its sequences x its longest context; node i holds the
    calls of positions [i size, (i + 1) size)."""
    size, _, m = micro_batch_layout(peak, micro_batch)
    per_call = micro_batch if micro_batch > 0 else max(int(peak), 1)
    work = np.zeros((m, R, K))
    key = np.full(rank.size, -1, np.int64) if cascade is None else cascade
    for k in range(K):
        live = alive_for > k
        if not live.any():
            break
        order = np.lexsort((context[live], key[live], rank[live]))
        r, c = rank[live][order], context[live][order].astype(float) + k
        call = r * (int(key.max()) + 2) + key[live][order] + 1  # the calls' runs: a rank's, one per cascade
        first, end = np.searchsorted(call, call, side="left"), np.searchsorted(call, call, side="right")
        pos = np.arange(r.size) - np.searchsorted(r, r, side="left")
        place = np.arange(r.size) - first
        last = np.minimum(first + (place // per_call + 1) * per_call, end) - 1  # each call's longest: its last
        node = (pos // size).astype(np.int64)
        work[:, :, k] = np.bincount(node * R + r, weights=c[last], minlength=m * R).reshape(m, R)
    return work


def decode_load(rank: np.ndarray, context: np.ndarray, alive_for: np.ndarray, tp: np.ndarray,
                num_ranks: int, iterations: int, micro_batch: int,
                pad_rows: np.ndarray, pad_context: np.ndarray, similar_calls: bool = False) -> RankLoad:
    """Per-iteration load of a decode run; sequence i takes part in iterations 0..alive_for[i]-1.
    `similar_calls`: attention is called on runs of similar contexts (padded kernels; `padded_runs`) rather
    than in micro-batches of B_attn over the whole rank."""
    K, R = iterations, num_ranks
    attn_tokens, attn_ctx, longest = _attention(rank, context, alive_for, tp, R, K)
    all_whole = bool((tp == 1).all())
    # unpartitioned, each sequence's query is one gate token on its rank: the same sum as its attention tokens
    gate = attn_tokens if all_whole else _alive(rank, alive_for, np.ones(rank.size), R, K)
    padding = bool(pad_rows.any())
    if padding:  # (without padding rows these would add zeros)
        ks = np.arange(K)
        attn_tokens = attn_tokens + pad_rows[:, None]
        attn_ctx = attn_ctx + (pad_context[:, None] + pad_rows[:, None] * ks)
        with np.errstate(divide="ignore", invalid="ignore"):  # padding rows: as long as their mean
            pad_longest = np.where(pad_rows > 0, pad_context / pad_rows, 0.0)[:, None] + ks
        longest = np.where(pad_rows[:, None] > 0, np.maximum(longest, pad_longest), longest)
        gate = gate + pad_rows[:, None]
    # attention calls over the whole-head queries (the gate's tokens when nothing is partitioned)
    mb = attention_calls(attn_tokens, micro_batch)
    if similar_calls and all_whole and not pad_rows.any():
        mb, work = padded_runs(rank, context, alive_for, micro_batch, R, K)
        with np.errstate(divide="ignore", invalid="ignore"):
            longest = np.where(attn_tokens > 0, work / attn_tokens, 0.0)
    zeros = np.zeros((R, K))
    shards = () if all_whole else _shards(rank, context, alive_for, tp, R, K)
    return RankLoad(attn_tokens, attn_ctx, gate, zeros, zeros, np.maximum(mb, 1.0), longest, zeros, zeros, gate,
                    shards=shards)


def _alive(rank: np.ndarray, alive_for: np.ndarray, weight: np.ndarray, R: int, K: int) -> np.ndarray:
    """sum of weight over sequences on each rank still running at each iteration: (R, K)."""
    hist = np.bincount(rank * (K + 1) + alive_for, weights=weight, minlength=R * (K + 1)).reshape(R, K + 1)
    # alive at iteration k <=> alive_for > k: reversed cumulative sum over alive_for = k+1..K
    return np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]


def prefill_load(prefill_rank: np.ndarray, prefill_context: np.ndarray, decode_rank: np.ndarray,
                 decode_context: np.ndarray, num_ranks: int, micro_batch: int,
                 similar_calls: bool = False) -> RankLoad:
    """One forward pass in which some ranks prefill whole prompts and the others decode one token.
    `similar_calls`: as in `decode_load`; prompts and decode queries are called apart, each in runs of
    similar lengths (the effective longest prompt then gives sequences x longest^2 = the runs' padded work)."""
    R = num_ranks
    p_tok = np.bincount(prefill_rank, weights=prefill_context.astype(float), minlength=R)
    p_sq = np.bincount(prefill_rank, weights=prefill_context.astype(float) ** 2, minlength=R)
    p_seq = np.bincount(prefill_rank, minlength=R)
    d_tok = np.bincount(decode_rank, minlength=R).astype(float)
    d_ctx = np.bincount(decode_rank, weights=decode_context.astype(float), minlength=R)
    p_max, d_max = np.zeros(R), np.zeros(R)
    np.maximum.at(p_max, prefill_rank, prefill_context.astype(float))
    np.maximum.at(d_max, decode_rank, decode_context.astype(float))
    seqs = p_seq + d_tok
    mb = attention_calls(seqs, micro_batch)
    if similar_calls:
        p_calls, p_work = _static_runs(prefill_rank, prefill_context, micro_batch, R, square=True)
        d_calls, d_work = _static_runs(decode_rank, decode_context, micro_batch, R, square=False)
        mb = p_calls + d_calls
        with np.errstate(divide="ignore", invalid="ignore"):
            p_max = np.where(p_seq > 0, np.sqrt(p_work / np.maximum(p_seq, 1)), 0.0)
            d_max = np.where(d_tok > 0, d_work / np.maximum(d_tok, 1), 0.0)
    col = lambda a: a[:, None].astype(float)  # noqa: E731
    return RankLoad(col(d_tok), col(d_ctx), col(p_tok + d_tok), col(p_sq), col(p_tok), col(np.maximum(mb, 1)),
                    col(d_max), col(p_max), col(p_seq), col(seqs))


def mixed_load(chunk_rank: np.ndarray, chunk_start: np.ndarray, chunk_len: np.ndarray, chunk_completes: np.ndarray,
               decode_rank: np.ndarray, decode_context: np.ndarray, num_ranks: int, micro_batch: int,
               similar_calls: bool = False) -> RankLoad:
    """One forward of chunked prefill: on each rank, prompt chunks (chunk i writes context tokens
    [start, start + len) over the KV its earlier chunks wrote) beside one decode token for every running sequence.

    Every token goes through the weights once (projections, FFN, experts: the gate sees chunk + decode tokens).
    A chunk's queries attend causally over its prefix and themselves: start x len + len^2 / 2 score pairs, passed
    to `attention_prefill` as the squared length len^2 + 2 x start x len (a whole prompt's chunks add up to its
    prompt^2); a one-token chunk is a decode query over start + 1 tokens, as the executor calls it. Decode queries
    are priced as in `prefill_load`. The LM head and sampling run only for decodes and for chunks that complete
    their context; the per-forward overhead counts every sequence. `similar_calls`: calls of similar lengths, as
    in `prefill_load`; a chunk call pads to its longest chunk x its longest context."""
    R = num_ranks
    c_len, c_start = chunk_len.astype(float), chunk_start.astype(float)
    multi = chunk_len > 1
    single = ~multi
    m_rank, m_len, m_start = chunk_rank[multi], c_len[multi], c_start[multi]
    # one-token chunks attend like decode queries over their context (start + 1)
    q_rank = np.concatenate([decode_rank, chunk_rank[single]])
    q_ctx = np.concatenate([decode_context.astype(float), c_start[single] + 1.0])
    p_tok = np.bincount(m_rank, weights=m_len, minlength=R)
    p_sq = np.bincount(m_rank, weights=m_len ** 2 + 2.0 * m_start * m_len, minlength=R)
    p_seq = np.bincount(m_rank, minlength=R)
    d_tok = np.bincount(q_rank, minlength=R).astype(float)
    d_ctx = np.bincount(q_rank, weights=q_ctx, minlength=R)
    p_max, d_max = np.zeros(R), np.zeros(R)
    np.maximum.at(p_max, m_rank, np.sqrt(m_len * (m_start + m_len)))
    np.maximum.at(d_max, q_rank, q_ctx)
    seqs = p_seq + d_tok
    mb = attention_calls(seqs, micro_batch)
    if similar_calls:
        p_calls, p_work = _chunk_runs(m_rank, m_start, m_len, micro_batch, R)
        d_calls, d_work = _static_runs(q_rank, q_ctx, micro_batch, R, square=False)
        mb = p_calls + d_calls
        with np.errstate(divide="ignore", invalid="ignore"):
            p_max = np.where(p_seq > 0, np.sqrt(p_work / np.maximum(p_seq, 1)), 0.0)
            d_max = np.where(d_tok > 0, d_work / np.maximum(d_tok, 1), 0.0)
    head = (np.bincount(decode_rank, minlength=R)
            + np.bincount(chunk_rank[chunk_completes], minlength=R)).astype(float)
    col = lambda a: a[:, None].astype(float)  # noqa: E731
    return RankLoad(col(d_tok), col(d_ctx), col(p_tok + d_tok), col(p_sq), col(p_tok), col(np.maximum(mb, 1)),
                    col(d_max), col(p_max), col(p_seq), col(seqs), col(head))


def _chunk_runs(rank: np.ndarray, start: np.ndarray, length: np.ndarray, micro_batch: int, R: int):
    """(calls, padded work) per rank of one forward's prompt chunks called in runs of similar context ends (the
    executor's calls): work is members x longest chunk x longest context."""
    calls, work = np.zeros(R), np.zeros(R)
    if rank.size == 0:
        return calls, work
    end = start + length
    run = similar_runs(rank, end, micro_batch)
    runs = int(run.max()) + 1
    longest_q, longest_k = np.zeros(runs), np.zeros(runs)
    members = np.bincount(run, minlength=runs).astype(float)
    np.maximum.at(longest_q, run, length.astype(float))
    np.maximum.at(longest_k, run, end.astype(float))
    run_rank = np.zeros(runs, np.int64)
    run_rank[run] = rank
    np.add.at(calls, run_rank, 1.0)
    np.add.at(work, run_rank, members * longest_q * longest_k)
    return calls, work


def _static_runs(rank: np.ndarray, length: np.ndarray, micro_batch: int, R: int, square: bool):
    """(calls, padded work) per rank of one forward's runs of similar lengths: work is members x longest
    (decode queries) or members x longest^2 (prompts: queries and keys both padded)."""
    calls, work = np.zeros(R), np.zeros(R)
    if rank.size == 0:
        return calls, work
    run = similar_runs(rank, length, micro_batch)
    runs = int(run.max()) + 1
    longest, members = np.zeros(runs), np.bincount(run, minlength=runs).astype(float)
    np.maximum.at(longest, run, length.astype(float))
    run_rank = np.zeros(runs, np.int64)
    run_rank[run] = rank
    np.add.at(calls, run_rank, 1.0)
    np.add.at(work, run_rank, members * (longest ** 2 if square else longest))
    return calls, work


def price_host(lat: LatencyModel, grid: DecodeGrid, micro_batch: int, *, cpu_attention: bool,
               prefetch_bytes: float) -> tuple[RunCost, float, float]:
    """A decode run with host-resident sequences or streamed expert weights, each layer priced on its DAG
    (batchgen.plan): (cost, h2d bytes, d2h bytes) over the run. `rank_comm` holds the all-to-all and the host
    traffic (or CPU attention) the GPU could not hide."""
    p = price_decode(lat, grid, micro_batch, cpu_attention=cpu_attention, prefetch_bytes=prefetch_bytes)
    gate = grid.gate_tokens
    active = gate.sum(axis=0) > 0
    joins = np.broadcast_to(grid.tp_join, gate.shape) * sum(lat.layer_counts())
    rank_comm = float(p.comm_s.sum()) + joins[:, active].sum(axis=1)
    # the module split counts attention as computed where the KV is read (the DAG's overlap aside)
    attn = device_attention(lat, grid) + host_attention(lat, grid, micro_batch)
    if grid.shards:
        attn = attn + shard_attention(lat, grid.shards)
    modules = module_split(lat, attn, gate, gate, active)
    return (RunCost(p.iteration_s, p.rank_busy, rank_comm, np.where(active, gate.sum(axis=0), 0.0), modules),
            p.h2d_bytes, p.d2h_bytes)
