"""Greedy outputs of the executor, under every policy, equal transformers' `generate` on the same weights,
even when a small KV budget forces yields, migrations between ranks and evictions in mid-sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.exec.run import ExecSettings, execute
from conftest import make_job

from .test_models import tiny_hf

N = 10


def hf_greedy(model, prompt: np.ndarray, new_tokens: int) -> list[int]:
    ids = torch.tensor(prompt, dtype=torch.long)[None]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def saved(request, tmp_path_factory):
    model = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("policy,kv_mb", [("coroutine", 0.06), ("continuous", 0.06), ("static", 0.06),
                                          ("coroutine", 4.0)])
def test_greedy_matches_hf_generate(saved, policy, kv_mb):
    model, path = saved
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"b_moe": 4} if policy == "coroutine" else None)
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    t = out.prepared.state.table
    if kv_mb < 1:  # the budget holds a few sequences per rank: the policies had to make room
        moved = out.kv_moves
        if policy == "coroutine":
            assert moved.get("yield", 0) > 0 and moved.get("restore", 0) + moved.get("migrate", 0) > 0
        else:
            assert t.recomputes.sum() > 0 and moved.get("evict", 0) > 0
    else:
        assert out.kv_moves.get("migrate", 0) > 0 or out.kv_moves.get("restore", 0) > 0
