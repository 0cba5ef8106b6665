"""Baselines at their engines' own defaults: continuous and sglang_opt take the batch caps vLLM and SGLang pick
for the GPU they run on, and SGLang's options that are off by default are off; and a simplification that favours
a baseline (transfers hidden under compute) can be switched off to measure it."""

import numpy as np
import pytest

from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.policy.continuous import ContinuousPolicy
from batchgen.policy.engine_defaults import sglang_chunked_prefill_size, vllm_offline_caps
from batchgen.setup import policy_config
from batchgen.specs import load_cluster, load_model
from batchgen.specs.catalog import load_hardware_file
from batchgen.workload import Workload


@pytest.mark.parametrize("gpu, vllm, sglang", [
    ("h100", (1024, 16384), 8192), ("h20", (1024, 16384), 8192), ("h200", (1024, 16384), 8192),
    ("a100_80g", (256, 8192), 8192),  # vLLM keeps A100s on the smaller caps whatever their memory
    ("a5000", (256, 8192), 2048), ("rtx4090", (256, 8192), 2048),
])
def test_each_engine_picks_its_caps_from_the_gpu(gpu, vllm, sglang):
    spec = load_hardware_file(gpu)
    assert vllm_offline_caps(spec) == vllm
    assert sglang_chunked_prefill_size(spec) == sglang


def _job(policy: str, cluster: str, **overrides) -> Job:
    model = load_model("qwen3_30b_a3b")
    return Job(model, load_cluster(cluster), Workload("w", np.full(4, 100), np.full(4, 10)),
               make_policy(policy_config(policy, model, **overrides)))


def test_the_shipped_configs_run_each_engine_at_its_defaults_on_the_clusters_gpu():
    on_h20, on_a100 = _job("continuous", "h20_16").policy, _job("continuous", "a100_8").policy
    assert (on_h20.max_running, on_h20.token_budget, on_h20.mixed_chunks) == (1024, 16384, True)
    assert (on_a100.max_running, on_a100.token_budget) == (256, 8192)
    sglang = _job("sglang_opt", "h20_16").policy
    assert (sglang.max_running, sglang.token_budget) == (0, 8192)  # 0: the running cap comes from the KV pool
    assert sglang.mixed_chunks is False and sglang.two_batch_overlap is False
    assert sglang.gpu_memory_fraction == 0.97  # what the paper tuned


def test_a_knob_set_by_hand_is_kept_and_auto_is_taken_only_where_an_engine_gives_it():
    pinned = _job("continuous", "h20_16", max_running=64).policy
    assert (pinned.max_running, pinned.token_budget) == (64, 16384)
    assert ContinuousPolicy(max_running=8, token_budget=512).for_gpu(load_hardware_file("h20")) == \
        ContinuousPolicy(max_running=8, token_budget=512)
    with pytest.raises(ValueError, match="policy.max_running of policy pd_disagg must be a whole number"):
        make_policy({"name": "pd_disagg", "max_running": "auto"})
    with pytest.raises(ValueError, match="policy.token_budget must be a whole number or auto"):
        ContinuousPolicy(token_budget="lots")


def test_a_policy_left_to_its_engine_says_how_to_resolve_it_when_used_unresolved():
    with pytest.raises(ValueError, match="max_running=auto is the engine's default.*for_gpu"):
        ContinuousPolicy().batch_shape(1000)
    assert _job("continuous", "h100_8").policy.batch_shape(1000).attn_seqs == 1024


def test_copies_paid_after_compute_cost_what_the_overlap_hid_and_nothing_where_nothing_moves():
    """backend=sim's overlap_copies=false, for measuring what a simplification that hides transfers is worth."""
    from batchgen.sim.run import simulate
    from conftest import make_job

    shipped = make_job("pd_disagg", "tiny_moe", "h100_8", n=80)
    hidden, paid = (simulate(shipped, progress=False, overlap_copies=o) for o in (True, False))
    bct = lambda out: float(np.nanmax(out.prepared.state.table.finish_time))  # noqa: E731
    assert bct(paid) > bct(hidden)
    still = make_job("continuous", "llama2_7b", "a100_8", n=20, cluster_overrides={"num_gpus": 1})
    assert bct(simulate(still, progress=False, overlap_copies=False)) == bct(simulate(still, progress=False))
