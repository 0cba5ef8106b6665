"""The offloading systems' policies on the executor: greedy outputs equal transformers' `generate`, while every
layer's weights are copied from their host copy once per forward and each micro-batch runs its own FFN."""

from __future__ import annotations

import numpy as np
import pytest

from batchgen.exec.run import ExecSettings, execute
from conftest import make_job

from .test_exec_parity import hf_greedy, kv_mb_for, saved  # noqa: F401 (the fixture)

N = 8


def knobs(policy: str, mla: bool) -> dict:
    return {"flexgen": {"gpu_batch_size": 2, "num_gpu_batches": 2, "cache_on": "cpu", "cpu_delegation": not mla},
            "moe_lightning": {"micro_batch_size": 2, "num_micro_batches": 2, "attention": "gpu" if mla else "cpu"},
            "zero_inference": {"batch_size": 4}}[policy]


@pytest.mark.slow  # about a minute each on the 2-core machine
@pytest.mark.parametrize("policy", ["flexgen", "moe_lightning", "zero_inference"])
def test_offload_policies_match_hf_generate_and_move_weights(saved, policy):  # noqa: F811
    model, path = saved
    mla = "deepseek" in type(model).__name__.lower()
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 30, N), rng.integers(4, 24, N)
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides=knobs(policy, mla))
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000, 4, 64)))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    traffic = out.kv_traffic
    forwards = sum(r.iterations for r in out.records)
    layers = model.config.num_hidden_layers
    assert traffic["weight_bytes"] > 0  # every layer's weights went through the host -> device copy
    # an FFN per micro-batch: more FFN calls than layers x forwards whenever a block holds several micro-batches
    assert traffic["ffn_calls"] >= layers * forwards
    if policy != "zero_inference":
        assert traffic["ffn_calls"] > layers * forwards
        assert traffic["host_resident_seq_steps"] > 0  # the block's KV stayed on the host
    blocks = {r.running for r in out.records if r.phase == "decode"}
    assert max(blocks) <= 2 * 4  # static blocks of at most block (4) x ranks (2)
