"""How many decode iterations a rank runs at each running-set size over its share of a batch.

A steady-state prediction (one iteration with the running set full) misjudges a batch job whose outputs are
long-tailed: once the queue is empty the running set drains, and the last sequences decode almost alone for
thousands of iterations. Each of those iterations still pays the iteration's fixed costs (expert weights
streamed from host above all), so a plan that streams more weights to hold a few more sequences can win in the
steady state and lose over the batch. `occupancy` replays one rank's share as the engine runs it (a full running
set, refilled at the end of each run of a page of tokens, prefill not modelled) on the workload's output lengths and
returns, per running-set size, the iterations spent there; the planner prices a few sizes and weighs them.
"""

from __future__ import annotations

import functools
import heapq
import math

import numpy as np

QUANTILES = 101  # the sketch of the workload's output lengths the planner keeps (percentiles 0..100)


def output_sketch(output_lens: np.ndarray) -> tuple[float, ...]:
    """Percentiles 0..100 of the output lengths: enough to replay a rank's share of any size."""
    out = np.asarray(output_lens, float)
    return tuple(float(x) for x in np.percentile(out, np.linspace(0, 100, QUANTILES))) if out.size else ()


def share_outputs(sketch: tuple[float, ...], share: int, mean_output: float) -> np.ndarray:
    """`share` output lengths spread over the sketch's distribution, in an arrival order unrelated to length
    (a fixed shuffle: the planner is deterministic). Without a sketch every output is the mean."""
    if not sketch:
        return np.full(share, max(round(mean_output), 1), np.int64)
    q = (np.arange(share) + 0.5) / share
    lens = np.maximum(np.rint(np.interp(q, np.linspace(0, 1, len(sketch)), sketch)), 1).astype(np.int64)
    return np.random.default_rng(0).permutation(lens)


def occupancy(outputs: np.ndarray, running: int, steps: int | None = None) -> dict[int, int]:
    """Iterations at each running-set size while one rank decodes `outputs` (in arrival order) with at most
    `running` at a time. `steps`: the engine decides every `steps` iterations (coroutine's runs, a page of
    tokens), so a finished sequence's slot is refilled at the next run, and a run ends early only when its last
    sequence does; None: refilled at once."""
    if running < 1:
        raise ValueError(f"occupancy: running must be >= 1, got {running}")
    if steps is not None:
        return _run_occupancy(np.asarray(outputs, np.int64), running, max(int(steps), 1))
    outs = [int(x) for x in outputs]
    heap = [outs[i] for i in range(min(running, len(outs)))]
    heapq.heapify(heap)
    nxt, now, hist = len(heap), 0, {}
    while heap:
        size, end = len(heap), heap[0]
        hist[size] = hist.get(size, 0) + end - now
        now = end
        while heap and heap[0] == end:
            heapq.heappop(heap)
        while nxt < len(outs) and len(heap) < running:
            heapq.heappush(heap, now + outs[nxt])
            nxt += 1
    return {m: k for m, k in hist.items() if k > 0}


def _run_occupancy(outs: np.ndarray, running: int, steps: int) -> dict[int, int]:
    """`occupancy` refilled only at run boundaries: each run lasts `steps` iterations or until its longest
    sequence ends; within it, a sequence leaves the set after its last token.

    Counted per sequence rather than replayed run by run (a rank's share of a million-sequence batch decodes tens
    of thousands of runs, and a plan replays several shares): a sequence of `o` tokens admitted at the start of
    run `a` stays ceil(o / steps) runs (any run it outlives is a whole `steps` long: a shorter run ends with its
    longest sequence) and leaves `o - steps * (ceil(o / steps) - 1)` iterations into its last one. The slots freed
    in a run are taken at the next boundary by the next sequences in arrival order, so the admissions follow from
    counting the finishes."""
    n = outs.size
    if not n:
        return {}
    stays = (outs + steps - 1) // steps
    leaves = outs - steps * (stays - 1)           # iterations into its last run, 1..steps
    start = _admissions(stays, running)
    end = start + stays - 1                       # the run it leaves in
    runs = int(end.max()) + 1
    alive = np.cumsum(np.bincount(start, minlength=runs) - np.bincount(end + 1, minlength=runs + 1)[:runs])
    # each run's leavers in the order they leave: the set is at `alive - gone` until the next one's last token
    order = np.lexsort((leaves, end))
    run, at = end[order], leaves[order]
    first = np.ones(n, bool)
    np.not_equal(run[1:], run[:-1], out=first[1:])
    heads = np.flatnonzero(first)
    gone = np.arange(n) - np.repeat(heads, np.diff(np.append(heads, n)))  # leavers of its run before it
    iters = np.zeros(running + 1, np.int64)
    np.add.at(iters, alive[run] - gone, at - np.where(first, 0, np.roll(at, 1)))
    # a run that someone outlives lasts `steps`: the rest of it at the size its leavers leave
    left = np.bincount(end, minlength=runs)
    last = np.zeros(runs, np.int64)
    tails = np.append(heads[1:], n) - 1
    last[run[tails]] = at[tails]
    full = np.flatnonzero(alive > left)
    np.add.at(iters, alive[full] - left[full], steps - last[full])
    return {int(m): int(k) for m, k in enumerate(iters) if k > 0}


def _admissions(stays: np.ndarray, running: int) -> np.ndarray:
    """The run each sequence starts in, when `running` slots are filled in arrival order at every run boundary
    and a sequence holds its slot for `stays` runs."""
    n = stays.size
    start = np.zeros(n, np.int64)
    admitted = min(running, n)
    leaving = np.zeros(2 * int(stays.max()) + 1, np.int64)  # sequences leaving in each run so far (grown as needed)
    np.add.at(leaving, stays[:admitted] - 1, 1)
    longest = stays.tolist()
    finished, run = 0, 0
    while admitted < n:
        finished += int(leaving[run])
        run += 1
        total = min(n, running + finished)
        if total == admitted:
            continue
        start[admitted:total] = run
        top = run + max(longest[admitted:total])
        if top >= leaving.size:
            leaving = np.concatenate([leaving, np.zeros(top + 1, np.int64)])
        np.add.at(leaving, run + stays[admitted:total] - 1, 1)
        admitted = total
    return start


@functools.lru_cache(maxsize=256)
def share_occupancy(sketch: tuple[float, ...], share: int, mean_output: float, running: int,
                    steps: int | None = None) -> dict[int, int]:
    """`occupancy` of a rank's share (`share_outputs`), kept: every plan of a job replays the same share (each
    prefill chunk, attention degree and instance size plans again), at the same few running-set caps. The dict
    is shared: read it, never change it."""
    return occupancy(share_outputs(sketch, share, mean_output), running, steps)


def price_points(running: int) -> list[int]:
    """Running-set sizes to price: the full set and halvings down to one (an iteration's time is close to
    affine in the set between them, and interpolated so)."""
    points, m = {running}, running
    while m > 1:
        m = math.ceil(m / 2)
        points.add(m)
    return sorted(points)


def weighted_seconds(hist: dict[int, int], points: list[int], seconds: list[float]) -> float:
    """Seconds of the iterations in `hist`, each size's iteration time interpolated between priced points."""
    sizes = np.fromiter(hist, float, len(hist))
    iters = np.fromiter(hist.values(), float, len(hist))
    return float((np.interp(sizes, points, seconds) * iters).sum())
