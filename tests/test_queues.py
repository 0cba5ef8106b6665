"""IdQueue against a plain list: peeks that span chunks store the head back as one chunk, which must never
change what the queue holds or in which order."""

import numpy as np
import pytest

from batchgen.core.queues import IdQueue


def test_queue_matches_a_list_under_random_pushes_peeks_pops_and_removals():
    rng = np.random.default_rng(0)
    for _ in range(100):
        q, model, nxt = IdQueue(), [], 0
        for _ in range(150):
            op, k = int(rng.integers(5)), int(rng.integers(0, 8))
            if op == 0:  # many small chunks, as prefills and yields push them
                q.push(np.arange(nxt, nxt + k))
                model, nxt = model + list(range(nxt, nxt + k)), nxt + k
            elif op == 1:
                q.push_front(np.arange(nxt, nxt + k))
                model, nxt = list(range(nxt, nxt + k)) + model, nxt + k
            elif op == 2:
                assert q.peek(3 * k).tolist() == model[:3 * k]
            elif op == 3:
                q.take_head_ids(np.array(model[:k], np.int64))
                model = model[k:]
            elif model:
                gone = rng.choice(model, size=min(k, len(model)), replace=False)
                q.remove(gone)
                model = [x for x in model if x not in set(gone.tolist())]
            assert len(q) == len(model) and q.to_array().tolist() == model


def test_ids_taken_from_the_head_leave_the_others_at_its_front_in_order():
    q = IdQueue(np.arange(10))
    q.push(np.arange(10, 20))
    q.take_from_head(np.array([0, 2, 3, 6]))  # 1, 4, 5 wait a forward
    assert q.to_array().tolist() == [1, 4, 5] + list(range(7, 20))
    q.take_from_head(np.array([1, 4, 5, 7]))  # the head itself
    assert q.to_array().tolist() == list(range(8, 20))
    q.take_from_head(np.array([9, 15]))  # across the pushed chunks
    assert q.to_array().tolist() == [8] + list(range(10, 15)) + list(range(16, 20))
    for bad in ([10, 8], [99]):  # out of FIFO order, or not in the queue
        with pytest.raises(ValueError):
            q.take_from_head(np.array(bad))
