"""The simulator must price the attention calls the executor makes: their number and their padded work.

The executor (batchgen.exec.runner._plan) cuts each forward's device decode queries, in ascending context, into
runs of similar contexts (`_chunks_similar`) anew at every forward, over the sequences still running. Its
padded kernel attends, per call, the call's queries x its longest context. On the tiny CPU model a small call
costs ~0.6-1 ms whatever its size, so a call priced that the executor never makes is most of a call's time.

The same holds for an offloading system's block (`decode_grid` with `similar_calls`), whose FFN runs per micro-batch
of B_attn rows while its attention is called on runs of similar contexts of at most B_attn sequences, and for
host-resident queries whose KV is restored per micro-batch of B_attn, in ascending context, each call padded too.
"""
import numpy as np
import pytest

from batchgen.exec.runner import _chunks_similar, _chunks_within
from batchgen.pricing.costs import decode_grid, padded_runs


def executor_calls(context, alive_for, micro_batch, K):
    """(calls, padded work) per iteration of one rank's decode run, as the executor's forwards cut it."""
    order = np.argsort(context, kind="stable")
    c, a = np.asarray(context)[order], np.asarray(alive_for)[order]
    calls, work = [], []
    for k in range(K):
        live = [int(x) + k for x in c[a > k]]
        runs = list(_chunks_similar(live, micro_batch))
        calls.append(len(runs))
        work.append(sum((hi - lo) * live[hi - 1] for lo, hi in runs))
    return calls, work


# 40 and 100 share a call (100 <= 1.25 x 40 + 64), 150 does not; once 40 has finished, 100 and 150 do
CONTEXT, ALIVE, K = np.array([40, 100, 150]), np.array([2, 5, 5]), 5


def test_the_first_iteration_is_priced_as_the_executor_calls_it():
    calls, work = padded_runs(np.zeros(3, np.int64), CONTEXT, ALIVE, 0, 1, K)
    exec_calls, exec_work = executor_calls(CONTEXT, ALIVE, 0, K)
    assert calls[0, :2].tolist() == exec_calls[:2] == [2, 2]
    assert work[0, :2].tolist() == exec_work[:2]


def test_the_runs_are_recut_as_sequences_finish():
    calls, work = padded_runs(np.zeros(3, np.int64), CONTEXT, ALIVE, 0, 1, K)
    exec_calls, exec_work = executor_calls(CONTEXT, ALIVE, 0, K)
    assert exec_calls == [2, 2, 1, 1, 1]
    assert calls[0].tolist() == exec_calls
    assert work[0].tolist() == exec_work


def test_an_offloading_block_is_priced_on_the_executors_calls():
    rank = np.zeros(3, np.int64)
    grid = decode_grid(rank, CONTEXT, ALIVE, np.ones(3, np.int64), np.zeros(3, bool), 1, K, 8,
                       np.zeros(1), np.zeros(1), similar_calls=True)
    exec_calls, exec_work = executor_calls(CONTEXT, ALIVE, 8, K)
    assert grid.dev_micro_batches[0].tolist() == exec_calls
    assert (grid.dev_tokens * grid.dev_longest)[0].tolist() == exec_work
    # without padded kernels: launches of B_attn over the summed contexts, as before
    plain = decode_grid(rank, CONTEXT, ALIVE, np.ones(3, np.int64), np.zeros(3, bool), 1, K, 8,
                        np.zeros(1), np.zeros(1))
    assert plain.dev_longest is None and plain.dev_micro_batches[0].tolist() == [1, 1, 1, 1, 1]


def executor_staged_work(context, alive_for, micro_batch, K):
    """Padded work per iteration of one rank's host-resident decode queries, restored and attended in calls of
    `micro_batch` sequences in ascending context (the executor's `_chunks_within`, its staging area not binding)."""
    order = np.argsort(context, kind="stable")
    c, a = np.asarray(context)[order], np.asarray(alive_for)[order]
    work = []
    for k in range(K):
        live = [int(x) + k for x in c[a > k]]
        work.append(sum((hi - lo) * live[hi - 1] for lo, hi in _chunks_within([1] * len(live), micro_batch, None)))
    return work


def test_restored_micro_batches_are_priced_on_the_executors_padded_calls():
    context, alive = np.array([300, 40, 100, 150, 41]), np.array([5, 2, 5, 3, 1])
    rank = np.zeros(5, np.int64)
    grid = decode_grid(rank, context, alive, np.ones(5, np.int64), np.ones(5, bool), 1, K, 2,
                       np.zeros(1), np.zeros(1), similar_calls=True)
    assert grid.host_work.sum(axis=0)[0].tolist() == executor_staged_work(context, alive, 2, K)
    # the DAG's nodes hold the calls in order: the first node the shortest contexts, two of them at iteration 0
    assert grid.host_work[0, 0, 0] == 2 * 41 and grid.host_work[2, 0, 0] == 300
    # CPU attention reads the host KV in place: nothing restored, nothing padded here
    cpu = decode_grid(rank, context, alive, np.ones(5, np.int64), np.ones(5, bool), 1, K, 2,
                      np.zeros(1), np.zeros(1), similar_calls=True, cpu_attention=True)
    assert cpu.host_work is None


def test_restored_micro_batches_keep_their_copies_when_their_attention_is_priced_on_padded_calls():
    from batchgen.latency.roofline import Roofline
    from batchgen.plan.decode import _host_micro_batches, staged_attention
    from batchgen.pricing.microbatch import _costs
    from batchgen.specs.catalog import load_hardware, load_model

    lat = Roofline(load_model("tiny_moe"), load_hardware("cpu_epyc_milan_2c"))
    context, alive = np.array([300, 40, 100, 150, 41]), np.array([5, 2, 5, 3, 1])
    grid = decode_grid(np.zeros(5, np.int64), context, alive, np.ones(5, np.int64), np.ones(5, bool), 1, K, 2,
                       np.zeros(1), np.zeros(1), similar_calls=True)
    t, ctx, n = _host_micro_batches(grid.host_tokens, grid.host_context, 2)
    padded = staged_attention(lat, grid, t, ctx, n)
    priced, _ = _costs(lat, t, ctx, n, "staged", False, 1, 0.0, padded)
    summed, _ = _costs(lat, t, ctx, n, "staged", False, 1, 0.0)
    assert len(priced.restore) == len(priced.append) == t.shape[0] == 3
    for a, b in zip(priced.restore + priced.append, summed.restore + summed.append):
        np.testing.assert_array_equal(a, b)  # the copies as before: only the attention is priced apart
    for a, b in zip(priced.attn, padded):
        np.testing.assert_array_equal(a, b)
