"""What the state prices a move of KV at: the tokens whose KV exists (prompt and generated, but the newest
generated token's, which the next forward writes), as the executor's caches hold them; and the order it carries a
boundary's MIGRATEs out in, one at a time as the executors do."""

import numpy as np
import pytest

from batchgen.core.ops import KVLedger, KVOps
from batchgen.core.sequences import InvariantError
from batchgen.engine import InstanceProgress, apply_decision
from batchgen.job import prepare
from batchgen.policy.base import Decision
from conftest import make_job, priced


def test_a_yield_after_decoding_moves_every_token_but_the_newest():
    job = make_job("coroutine", model="qwen3_30b_a3b", n=2, inputs=np.full(2, 100), outputs=np.full(2, 50))
    state = prepare(job).state
    ids = np.arange(2)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, np.array([0, 1]), lookahead_tokens=1)
    state.advance(ids, np.array([1, 5]), host_sync=False)  # the prefill's token, and four more for sequence 1
    assert state.table.context(ids).tolist() == [101, 105]
    state.yield_(0, ids)
    moves = priced(state)
    kv = state.kv_bytes_per_token
    assert moves.d2h[:2].tolist() == pytest.approx([100 * kv, 104 * kv])
    state.check()



def two_tight_gpus(prompts, gpus, pages=12):
    """Prompts prefilled on 2 GPUs of one node with `pages` KV pages each (and a token made), and a KV ledger that
    has their KV where the prefills wrote it."""
    job = make_job("coroutine", n=len(prompts), inputs=np.asarray(prompts), outputs=np.full(len(prompts), 4),
                   page_tokens=8, cluster_overrides={"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": 2})
    state = prepare(job, kv_pages_per_gpu=pages).state
    ids, gpus = np.arange(len(prompts)), np.asarray(gpus)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, gpus, lookahead_tokens=1)
    state.advance(ids, np.ones(ids.size, np.int64), host_sync=False)
    ledger = KVLedger(len(state.table), state.topo.gpu_node)
    ledger.apply(KVOps(state.instance_gpus(0)), ids, gpus)
    return state, ledger

def test_moves_that_fit_only_one_at_a_time_are_planned_in_an_order_each_destination_can_take():
    """GPU 0 holds 0 (6 pages), GPU 1 holds 1 (4) and 2 (3) of 12: swapping 0 and 1 fits at the end, and one move
    at a time only with 1 into GPU 0 first (GPU 1 has room for 5 pages, not 6, until 1 has left)."""
    state, ledger = two_tight_gpus([47, 31, 23], [0, 1, 1])
    assert state.table.pages[:3].tolist() == [6, 4, 3] and state.pages_used.tolist() == [6, 7]
    plan = apply_decision(state, 0, Decision(move_ids=np.array([0, 1]), move_ranks=np.array([1, 0]), steps=1),
                          InstanceProgress(2), ledger=ledger)
    assert [m[:3] for m in plan.ops.migrations()] == [(1, 1, 0), (0, 0, 1)]
    assert state.table.where[:3].tolist() == [1, 0, 1]
    state.check()


def test_moves_that_fit_in_no_order_one_at_a_time_are_refused():
    """GPUs 0 and 1 each hold 9 of 12 pages in one sequence: a swap fits at the end but never on the way (each
    arrival lands before its source lets go), so the state refuses it and changes nothing."""
    state, _ = two_tight_gpus([70, 70], [0, 1])
    before = (state.table.where.copy(), state.pages_used.copy())
    with pytest.raises(InvariantError, match=r"sequences \[0, 1\] cannot MIGRATE"):
        state.move_running(0, np.array([0, 1]), np.array([1, 0]))
    assert np.array_equal(state.table.where, before[0]) and np.array_equal(state.pages_used, before[1])
    state.check()
