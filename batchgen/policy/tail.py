"""Coroutine's long tail: where the last running sequences MIGRATE so that the ranks' loads even out, and whether
the moves fit the pages the executors carry them out on, one at a time (batchgen.policy.coroutine's `_tail`)."""

from __future__ import annotations

import numpy as np

from batchgen.core.move_order import one_at_a_time
from batchgen.policy.base import Snapshot
from batchgen.policy.common import among, pages_for


def moves_fit(snap: Snapshot, ids: np.ndarray, target: np.ndarray, rank: np.ndarray) -> bool:
    """Whether the running sequences `ids` can MIGRATE from `rank` to `target`: the executors carry moves out one
    at a time, each landing before its source lets go, so they must fit one at a time in some order (the one the
    state takes, `one_at_a_time`) on the pages each rank holds once this decision's yields and evictions have
    left (a decision that offloads does not migrate). Full ranks swapping sequences may not: the state would
    refuse the moves."""
    R = snap.num_ranks
    pos = np.flatnonzero(among(snap.active_ids, ids))  # ids are the kept running sequences, in snapshot order
    pages = snap.active_pages.astype(np.int64)
    tp = snap.active_tp.astype(np.int64)
    gone = np.ones(pages.size, bool)
    gone[pos] = False
    used = np.array(snap.pages_used, np.int64)
    for j in np.flatnonzero(gone & (pages > 0)):  # a few sequences, at the tail
        np.subtract.at(used, group_of(int(snap.active_rank[j]), int(tp[j]), R), pages[j])
    # a holder of a shared prefix leaves its own pages and arrives whole (the prefix's pages as its own)
    whole = pages if snap.prefixes is None else pages + snap.active_shared // snap.page_tokens
    moves = [(group_of(int(r), int(g), R), np.full(g, p), group_of(int(t), int(g), R), np.full(g, w))
             for r, t, g, p, w in zip(rank, target, tp[pos], pages[pos], whole[pos]) if r != t]
    return len(one_at_a_time(used, snap.pages_capacity, moves)) == len(moves)


def growth_fits(snap: Snapshot, ids: np.ndarray, target: np.ndarray) -> bool:
    """Whether, once the running sequences `ids` run on `target` (the others where they are), every rank has the
    pages for its device-resident sequences to grow by the run's page of tokens: the moves land whole, then the
    run grows them where they landed."""
    R, P = snap.num_ranks, snap.page_tokens
    final = snap.active_rank.astype(np.int64)
    kept = among(snap.active_ids, ids)
    final[kept] = target  # ids are the kept running sequences, in snapshot order
    device = kept & ~snap.active_host_resident
    grown = pages_for(snap.active_context + P, P)
    tp = snap.active_tp.astype(np.int64)
    need = np.bincount(final[device & (tp <= 1)], weights=grown[device & (tp <= 1)], minlength=R)
    for j in np.flatnonzero(device & (tp > 1)):  # a few partitioned sequences, at the tail
        np.add.at(need, group_of(int(final[j]), int(tp[j]), R), grown[j])
    return bool(np.all(need <= snap.pages_capacity))


def group_of(rank: int, tp: int, num_ranks: int) -> np.ndarray:
    """The ranks a sequence of degree `tp` led from `rank` holds pages on (the next tp - 1 ranks, wrapping)."""
    return (rank + np.arange(tp)) % num_ranks


def rebalance(ctx: np.ndarray, rank: np.ndarray, R: int) -> np.ndarray:
    """Targets from where the sequences run: while the most loaded rank (summed context) is over the mean, move
    one of its sequences to the least loaded rank, the one that leaves the two most even, as long as that lowers
    the larger of their loads. Each move lowers the loads' sum of squares, so sequences only go toward less
    loaded ranks and never back and forth; an assignment made from scratch (longest first) would move most of
    them at every rebalance as contexts grow."""
    target = rank.astype(np.int64)
    load = np.bincount(target, weights=ctx, minlength=R).astype(float)
    level = max(load.mean(), 1.0)
    for _ in range(4 * ctx.size):  # runs only in the tail, when at most a few sequences per rank remain
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        if load[hi] <= level:
            break
        on_hi = np.flatnonzero(target == hi)
        movable = on_hi[ctx[on_hi] < gap]
        if movable.size == 0:
            break
        i = int(movable[np.argmin(np.abs(ctx[movable] - gap / 2))])
        target[i] = lo
        load[hi] -= ctx[i]
        load[lo] += ctx[i]
    return target
