"""Small decisions several policies share, each a pure function over snapshot arrays."""

from __future__ import annotations

import numpy as np


def check_attention_tp(value) -> None:
    """policy.attention_tp: GPUs per tensor-parallel attention group (a whole number >= 1) or auto."""
    if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"policy.attention_tp must be a whole number >= 1 or auto, got {value!r}")


def pages_for(tokens: np.ndarray, page_tokens: int) -> np.ndarray:
    return -(-np.asarray(tokens, dtype=np.int64) // page_tokens)


def per_rank(rank: np.ndarray, values: np.ndarray, num_ranks: int) -> np.ndarray:
    return np.bincount(rank, weights=values, minlength=num_ranks).astype(np.int64)


def shed_to_fit(rank: np.ndarray, need: np.ndarray, order_key: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Indices to remove so that each rank's summed `need` fits its capacity, removing the highest
    `order_key` first. Vectorised: sort by (rank, key descending), and on each rank drop the prefix whose
    removal brings the total under capacity."""
    R = capacity.size
    total = per_rank(rank, need, R)
    excess = total - capacity
    if not (excess > 0).any():
        return np.empty(0, np.int64)
    order = np.lexsort((-order_key, rank))
    r_sorted, n_sorted = rank[order], need[order]
    start = np.searchsorted(r_sorted, np.arange(R))
    cum = np.cumsum(n_sorted)
    cum_before_rank = np.where(start > 0, cum[np.maximum(start - 1, 0)], 0)
    freed = cum - cum_before_rank[r_sorted]          # freed on its rank if we drop up to and including this one
    prev_freed = freed - n_sorted
    drop = prev_freed < excess[r_sorted]             # still short before dropping this one
    return order[drop]


def fill_ranks(candidate_need: np.ndarray, slots: np.ndarray, free: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Assign a FIFO run of candidates to `ranks` in turn, each taking up to its slots within its free pages.

    Returns the rank of each assigned candidate: a prefix of the candidates, cut at the first one that does
    not fit, so that FIFO order holds."""
    caps = np.maximum(slots[ranks], 0) * (free[ranks] > 0)
    n = min(int(caps.sum()), candidate_need.size)
    if n == 0:
        return np.empty(0, np.int64)
    owner = np.repeat(ranks, caps)[:n]
    need = candidate_need[:n]
    cum = np.cumsum(need)
    # pages the candidates before each one's run (on the same rank) took: 0 for the first of each run
    run_start = np.ones(n, bool)
    np.not_equal(owner[1:], owner[:-1], out=run_start[1:])
    before = np.maximum.accumulate(np.where(run_start, cum - need, 0))
    fits = cum - before <= free[owner]
    cut = n if fits.all() else int(np.argmin(fits))
    return owner[:cut]


def level_slots(count: np.ndarray, slots: np.ndarray, n: int) -> np.ndarray:
    """Slots per rank that spread n newcomers evenly: fill the emptiest ranks up to a common level first
    (water-filling), never beyond each rank's own slots.

    The level is the smallest L in [min(count), max(count) + n] whose room, sum(min(slots, max(L - count, 0))),
    holds n (the top of that range if none does). A refill brings a few sequences at a time, so the level is
    nearly always within n of the emptiest rank: try those levels in one array operation, and bisect (a numpy
    pass per step) only past them. A refill that offers as many newcomers as there are slots (the usual case) fills
    every rank to its slots: no level to search."""
    if n >= slots.sum() and slots.min(initial=0) >= 0:
        return slots.copy()
    lo, hi = int(count.min(initial=0)), int(count.max(initial=0)) + n
    window = np.arange(lo, min(lo + n, lo + _LEVEL_WINDOW, hi) + 1)
    room = np.minimum(slots, np.maximum(window[:, None] - count, 0)).sum(axis=1)
    k = int(np.searchsorted(room, n))  # room never shrinks as the level rises
    if k < window.size:
        lo = hi = int(window[k])
    else:
        lo = min(int(window[-1]) + 1, hi)
    while lo < hi:  # smallest level whose room holds all n
        mid = (lo + hi) // 2
        if np.minimum(slots, np.maximum(mid - count, 0)).sum() >= n:
            hi = mid
        else:
            lo = mid + 1
    return np.minimum(slots, np.maximum(lo - count, 0))


_LEVEL_WINDOW = 64  # levels level_slots tries at once before it bisects


def split_by_budget(tokens: np.ndarray, budget_per_rank: np.ndarray) -> np.ndarray:
    """Give FIFO candidates to ranks in order so that each rank's token sum stays within its budget (each rank
    with budget takes at least one candidate). Returns the rank of each taken candidate (a prefix)."""
    cum = np.cumsum(tokens)
    n = tokens.size
    counts: list[int] = []
    pos = base = 0
    for budget in np.asarray(budget_per_rank).tolist():
        if pos >= n:
            break
        if budget <= 0:
            counts.append(0)
            continue
        end = max(pos + 1, int(cum.searchsorted(base + budget, side="right")))
        counts.append(end - pos)
        pos, base = end, int(cum[end - 1])
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def among(ids: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """np.isin(ids, chosen), without its sort when nothing is chosen (the common case)."""
    return np.isin(ids, chosen) if chosen.size else np.zeros(ids.size, bool)
