"""backend=dist recovers from a lost worker while prompts share prefixes: the rebuilt state and the survivors'
caches agree on which prefixes they hold, and every output equals the single-process executor's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.dist.run import execute_dist
from batchgen.exec.run import ExecSettings, execute
from batchgen.workload.spec import Workload
from tests.distributed.test_dist_backend import dist_settings
from tests.exec.test_exec_parity import kv_mb_for
from conftest import make_job

pytestmark = pytest.mark.usefixtures("one_thread")


def grouped_job(policy: str):
    n, group, prefix = 16, 4, 29
    rng = np.random.default_rng(5)
    inputs, outputs = prefix + rng.integers(3, 12, n), rng.integers(8, 40, n)
    knobs = {"token_budget": 64} if policy == "continuous" else {"b_moe": 4}
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides=knobs)
    return dataclasses.replace(job, workload=Workload("grouped", inputs, outputs, prefix_group=np.arange(n) // group,
                                                      prefix_len=np.full(n, prefix)))


@pytest.mark.parametrize("policy", ["coroutine", "continuous"])
def test_a_killed_worker_is_recovered_from_while_prefixes_are_shared(saved, loop_kernel, kill_at, policy):
    _, path = saved
    kill_at(1, 12)
    out = execute_dist(grouped_job(policy), dist_settings(path, 2, kv_tokens=2000, timeout_s=60.0))
    ref = execute(grouped_job(policy), ExecSettings(device="cpu", model_path=str(path),
                                                    kv_budget_mb=kv_mb_for(path, 2000), threads=1))
    assert len(out.recoveries) == 1 and out.prepared.state.all_finished()
    assert out.tokens.generated == ref.tokens.generated
    rec = out.recoveries[0]
    state = out.prepared.state
    assert rec.kept > 0 and state.prefix_taken > 0  # prefixes were taken, and the survivor kept KV across the loss
    assert state.prefill_computed > ref.prepared.state.prefill_computed  # both generations' prefills counted
