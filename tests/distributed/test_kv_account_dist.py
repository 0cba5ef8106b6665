"""backend=dist performs the migrations the state prices, over gloo: the scripted decisions of
tests/exec/test_kv_account.py over 4 processes (2 per node) copy, tier by tier and GPU by GPU, the KV the state
priced, device pages straight into device pages; outputs equal the single-process executor's. Each process keeps a host pool of its own, so a
host copy that stays on its node (which the state prices as nothing) changes processes by a copy: those copies
are counted apart (`migrate_host_copy`, and the `host` tier) and named here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.dist import backend as dist_backend
from batchgen.dist.run import DistSettings, execute_dist
from batchgen.exec.account import KVAccount
from batchgen.exec.run import ExecSettings, execute
from conftest import make_job
from tests.exec.test_kv_account import P, PRICED_KINDS, SCRIPT, TIERS, scripted

pytestmark = pytest.mark.usefixtures("one_thread")


def scripted_job():
    job = make_job("continuous", n=8, inputs=np.arange(8) % 5 + 11, outputs=np.full(8, 24), page_tokens=P,
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4})
    return dataclasses.replace(job, policy=scripted(SCRIPT))


def comparable(account: KVAccount, kinds=(), tiers=()) -> dict:
    """The account's {kind: {tier: bytes per GPU}} without these kinds and tiers."""
    return {k: {t: v for t, v in by_tier.items() if t not in tiers}
            for k, by_tier in account.as_dict().items() if k not in kinds}


@pytest.mark.slow
def test_dist_copies_what_the_state_priced(loop_kernel, monkeypatch):
    execute_plan = dist_backend.DistBackend.execute

    def pricing(self, plan):  # rank 0 (forked with this patch) adds up what the state priced, per tier and GPU
        result = yield from execute_plan(self, plan)
        for tier in TIERS:
            for g, nbytes in enumerate(np.asarray(getattr(plan.moves, tier)).tolist()):
                self.traffic[f"priced {tier} {g}"] += int(nbytes)
        return result

    monkeypatch.setattr(dist_backend.DistBackend, "execute", pricing)
    out = execute_dist(scripted_job(), DistSettings(device="cpu", procs=4, dtype="float32", kv_budget_mb=4,
                                                    timeout_s=60.0))
    ref = execute(scripted_job(), ExecSettings(device="cpu", dtype="float32", threads=1, kv_budget_mb=4))
    assert [list(g) for g in out.tokens.generated] == [list(g) for g in ref.tokens.generated]
    acc: KVAccount = out.kv_account
    apart = ("migrate_host_copy",)
    for tier in TIERS:
        want = np.array([out.kv_traffic.get(f"priced {tier} {g}", 0) for g in range(4)])
        got = sum((acc.of(k)[tier] for k in PRICED_KINDS if k not in apart), np.zeros(4, np.int64))
        assert np.array_equal(got, want), (tier, got, want)
    # the single-process executor copied the same bytes, per kind, tier and GPU, less dist's extra copies
    assert comparable(ref.kv_account) == comparable(acc, apart, ("host",))
    # dist's extra copies: the host copies kept by 1 (onto GPU 1, then GPU 0), made again from the arrival; and
    # host-resident 5's host copy, moved from GPU 0's process to GPU 1's on node 0
    assert np.flatnonzero(acc.of("migrate_host_copy")["d2h"]).tolist() == [0, 1]
    assert np.flatnonzero(acc.of("migrate")["host"]).tolist() == [1]
