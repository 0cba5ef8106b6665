"""The offloading systems' policies on the executor: greedy outputs equal transformers' `generate`, while the
weights the memory plan streams (on a rig of GPUs too small for them) live on the host and are copied into
the device staging slots once per forward, and each micro-batch runs its own FFN."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from batchgen.exec.run import ExecSettings, execute
from batchgen.job import prepare
from batchgen.memory import MemorySettings
from conftest import make_job

from .test_exec_parity import hf_greedy, kv_mb_for, saved  # noqa: F401 (the fixture)

N = 8
# GB per GPU of a rig (2 GPUs, no fixed reserve) on which tiny_moe's plan streams weights: at 0.022 every
# decoder layer whole (the non-expert weights with two layers' experts do not fit), at 0.03 every MoE layer's
# experts (weights_stream.StreamSpec)
RIG_GB = {"flexgen": (0.022, True), "moe_lightning": (0.03, False), "zero_inference": (0.03, False)}


def knobs(policy: str, mla: bool) -> dict:
    return {"flexgen": {"gpu_batch_size": 2, "num_gpu_batches": 2, "cache_on": "cpu", "cpu_delegation": not mla},
            "moe_lightning": {"micro_batch_size": 2, "num_micro_batches": 2, "attention": "gpu" if mla else "cpu"},
            "zero_inference": {"batch_size": 4}}[policy]


@pytest.mark.slow  # about a minute each on the 2-core machine
@pytest.mark.parametrize("policy", ["flexgen", "moe_lightning", "zero_inference"])
def test_offload_policies_match_hf_generate_and_move_weights(saved, policy):  # noqa: F811
    check_offload_policy(saved, policy, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_policy_streaming_whole_layers_on_cuda_matches_hf_generate(saved):  # noqa: F811
    """On CUDA the streamed weights are pinned host copies, copied on a side stream with the next layer
    prefetched (batchgen.exec.weight_stream): outputs still equal transformers' (fp32)."""
    check_offload_policy(saved, "flexgen", "cuda")


def check_offload_policy(saved, policy: str, device: str) -> None:  # noqa: F811
    model, path = saved
    mla = "deepseek" in type(model).__name__.lower()
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 30, N), rng.integers(4, 24, N)
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides=knobs(policy, mla))
    gb, whole = RIG_GB[policy]
    gpu = dataclasses.replace(job.cluster.gpu, hbm_gb=gb, memory_mib=gb * 1e9 / 2**20)
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpu=gpu),
                              memory=MemorySettings(activation_reserve_gb=0))
    budget = prepare(job).budget
    assert budget.streamed_layers == job.model.num_moe_layers and budget.whole_layers == whole
    out = execute(job, ExecSettings(device=device, dtype="float32", model_path=str(path),
                                    kv_budget_mb=kv_mb_for(path, 2000, 4, 64)))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    traffic = out.kv_traffic
    forwards = sum(r.iterations for r in out.records)
    layers = model.config.num_hidden_layers
    assert traffic["weight_bytes"] > 0  # the streamed weights went through the host -> device copy
    # an FFN per micro-batch: more FFN calls than layers x forwards whenever a block holds several micro-batches
    assert traffic["ffn_calls"] >= layers * forwards
    if policy != "zero_inference":
        assert traffic["ffn_calls"] > layers * forwards
        assert traffic["host_resident_seq_steps"] > 0  # the block's KV stayed on the host
    blocks = {r.running for r in out.records if r.phase == "decode"}
    assert max(blocks) <= 2 * 4  # static blocks of at most block (4) x ranks (2)
