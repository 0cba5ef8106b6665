"""What the state prices a move of KV at: the tokens whose KV exists (prompt and generated, but the newest
generated token's, which the next forward writes), as the executor's caches hold them."""

import numpy as np
import pytest

from batchgen.core.state import Moves
from batchgen.job import prepare
from conftest import make_job


def test_a_yield_after_decoding_moves_every_token_but_the_newest():
    job = make_job("coroutine", model="qwen3_30b_a3b", n=2, inputs=np.full(2, 100), outputs=np.full(2, 50))
    state = prepare(job).state
    ids = np.arange(2)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, np.array([0, 1]), lookahead_tokens=1)
    state.advance(ids, np.array([1, 5]), host_sync=False)  # the prefill's token, and four more for sequence 1
    assert state.table.context(ids).tolist() == [101, 105]
    moves = Moves.zeros(state.topo.num_gpus)
    state.yield_(0, ids, moves)
    kv = state.kv_bytes_per_token
    assert moves.d2h[:2].tolist() == pytest.approx([100 * kv, 104 * kv])
    state.check()
