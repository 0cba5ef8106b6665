"""MIGRATEs of running sequences are carried out one at a time (each lands before its source lets go), so a
boundary's moves must come in an order in which every destination has room for each arrival then: two nearly full
GPUs that swap sequences fit only if the move into the roomier one goes first. The state finds that order and the
plan keeps it; after every boundary's KV ops no cache holds more pages than the state counts on its GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.exec import backend as exec_backend
from batchgen.exec.run import ExecSettings, execute
from batchgen.policy.base import Decision
from conftest import Scripted, make_job

I = np.int64
P = 8  # page tokens
PAGES = 12  # each GPU's KV pool: tiny_moe in fp32 holds 4096 bytes a token, a page 32 KiB


@pytest.mark.usefixtures("one_thread")
def test_full_gpus_swapping_sequences_migrate_in_an_order_each_destination_can_take(monkeypatch):
    # GPU 0 holds sequence 0 (47 prompt tokens: 6 pages); GPU 1 holds 1 (31: 4 pages) and 2 (23: 3 pages), 7 of 12.
    # Swapping 0 and 1 fits at the end (GPU 0: 4 pages, GPU 1: 9), and on the way only if 1 leaves for GPU 0 (room
    # for 4 more) before 0 arrives on GPU 1 (room for 5, not 6): in id order the executor's cache was full.
    script = [Decision(prefill_ids=np.array([0, 1, 2], I), prefill_ranks=np.array([0, 1, 1], I), steps=1),
              Decision(move_ids=np.array([0, 1], I), move_ranks=np.array([1, 0], I), steps=2)]
    job = make_job("continuous", n=3, inputs=[47, 31, 23], outputs=[6, 6, 6], page_tokens=P,
                   cluster_overrides={"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": 2})
    job = dataclasses.replace(job, policy=Scripted(script, uses_host_kv=False))
    migrations, held = [], []
    move_kv = exec_backend.ExecBackend.move_kv

    def moving(self, ops):
        migrations.append([(sid, src, dst) for sid, src, dst, *_ in ops.migrations()])
        move_kv(self, ops)
        held.append(([c.used_pages() for c in self.caches], self.state.pages_used.tolist()))

    monkeypatch.setattr(exec_backend.ExecBackend, "move_kv", moving)
    out = execute(job, ExecSettings(device="cpu", dtype="float32", threads=1,
                                    kv_budget_mb=PAGES * P * 4096 / 2**20))
    assert out.prepared.state.gpu_pages.tolist() == [PAGES, PAGES]
    assert migrations[1] == [(1, 1, 0), (0, 0, 1)]  # into GPU 0 first: its room lets GPU 1 make room
    for b, (cache, state) in enumerate(held):
        assert all(c <= s for c, s in zip(cache, state)), (b, cache, state)
    assert out.kv_moves["migrate"] == 2
    assert out.prepared.state.all_finished()
