"""Greedy outputs of the executor, under every policy, equal transformers' `generate` on the same weights
(Mixtral, Qwen3-MoE and DeepSeek-V3 styles), even when a small KV budget forces yields, migrations between
ranks and evictions in mid-sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import read_config
from batchgen.exec.run import ExecSettings, execute
from conftest import make_job

from .test_deepseek import tiny_hf as tiny_deepseek
from .test_models import tiny_hf

N = 10


def hf_greedy(model, prompt: np.ndarray, new_tokens: int) -> list[int]:
    ids = torch.tensor(prompt, dtype=torch.long)[None]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v3"])
def saved(request, tmp_path_factory):
    model = tiny_deepseek() if request.param == "deepseek_v3" else tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def kv_mb_for(path, tokens: int, staging_seqs: int = 0, max_context: int = 0) -> float:
    """A KV budget of about `tokens` tokens for this model (MLA's latent cache is much smaller per token), plus
    the staging buffers host-resident decode carves out of it (two of `staging_seqs` x `max_context` tokens
    of one layer)."""
    geometry = read_config(path).kv_cache_geometry()._asdict()
    staging = 2 * staging_seqs * max_context / geometry["num_layers"]
    return PagedKVCache.page_bytes(**geometry, page_size=tokens + staging, dtype=torch.float32) / 2**20


@pytest.mark.parametrize("policy,kv_tokens", [("coroutine", 80), ("continuous", 80), ("static", 80),
                                              ("coroutine", 5000)])
def test_greedy_matches_hf_generate(saved, policy, kv_tokens):
    model, path = saved
    kv_mb = kv_mb_for(path, kv_tokens)
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"b_moe": 4} if policy == "coroutine" else None)
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    t = out.prepared.state.table
    if kv_tokens < 1000:  # the budget holds a few sequences per rank: the policies had to make room
        moved = out.kv_moves
        if policy == "coroutine":
            assert moved.get("yield", 0) > 0 and moved.get("restore", 0) + moved.get("migrate", 0) > 0
        else:
            assert t.recomputes.sum() > 0 and moved.get("evict", 0) > 0
    else:
        assert out.kv_moves.get("migrate", 0) > 0 or out.kv_moves.get("restore", 0) > 0


@pytest.mark.parametrize("chunked,mixed,token_budget,kv_tokens", [(True, True, 12, 80), (True, False, 12, 80),
                                                                  (False, True, 0, 80)])
def test_continuous_chunked_prefill_matches_hf_generate(saved, chunked, mixed, token_budget, kv_tokens):
    """Chunked prefill with a budget below most prompts: prompts are split over several forwards (each chunk
    attends over the KV its earlier chunks left in the paged cache, beside the running sequences' decodes, or
    alone on their rank while its decodes wait with mixed_chunks=false), and greedy outputs still equal
    transformers'; with a small KV pool part-prefilled prompts are preempted too. chunked_prefill=false keeps the
    whole-prompt rule."""
    model, path = saved
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    knobs = {"chunked_prefill": chunked, **({"token_budget": token_budget, "mixed_chunks": mixed} if chunked else {})}
    job = make_job("continuous", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides=knobs)
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, kv_tokens)))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    forwards = [r.decision.chunked for r in out.records if r.decision is not None]
    split = [sid for sid in range(N) if sum(sid in c for c in forwards) > 1]
    phases = {r.phase for r in out.records}
    if chunked and mixed:
        assert len(split) >= N // 2 and "mixed" in phases  # most prompts took several forwards, beside decodes
    elif chunked:  # chunks alone on their rank: a rank that prefills decodes nothing; the other rank may
        assert len(split) >= N // 2 and "prefill" in phases and phases <= {"prefill", "decode", "mixed"}
        home = out.prepared.state.table.home_gpu  # continuous pins a sequence to one GPU
        for r in out.records:
            if r.decision is not None and r.decision.chunked:
                assert not set(home[list(r.decision.decoded)]) & set(home[list(r.decision.chunked)])
    else:
        assert not split and phases == {"prefill", "decode"}
    if kv_tokens < 1000:
        assert out.prepared.state.table.recomputes.sum() > 0


def _devices():
    out = [["cpu", "cpu"]]
    if torch.cuda.is_available():
        out.append(["cpu", "cuda"])
    return out


@pytest.mark.parametrize("devices", _devices())
def test_instances_on_their_own_devices_steal_work_without_changing_outputs(saved, devices):
    """Two one-rank instances, each with its own copy of the model on its own device: the one that drains
    first takes suspended sequences from the other (KV moved between devices) and greedy outputs still equal
    transformers'."""
    model, path = saved
    outputs = np.where(np.arange(N) % 2 == 0, 36, 6)  # instance 0 (even ids) gets the long ones
    inputs = np.random.default_rng(5).integers(4, 30, N)
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2, "gpus_per_instance": 1}, policy_overrides={"b_moe": 2})
    out = execute(job, ExecSettings(device=devices, dtype="float32", model_path=str(path),
                                    kv_budget_mb=kv_mb_for(path, 400)))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    assert out.kv_moves.get("migrate", 0) > 0
    assert (out.prepared.state.table.instance[::2] == 1).any()  # a long one finished on the other instance


def test_pd_disagg_matches_hf_generate(saved, kv_tokens=80):
    """PD-disaggregation on two one-GPU units (1 prefill + 1 decode, each its own instance): every prompt is
    prefilled on GPU 0 only, its KV shipped to GPU 1's cache (exported and imported), decoded there; with a
    small KV pool the decode unit preempts and recomputes. Greedy outputs equal transformers'."""
    model, path = saved
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    job = make_job("pd_disagg", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"token_budget": 64, "page_lookahead": 8})
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, kv_tokens)))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    t = out.prepared.state.table
    assert {r.phase for r in out.records if r.instance == 0} == {"prefill"}  # the prefill unit never decodes
    assert "decode" in {r.phase for r in out.records if r.instance == 1}
    # the decode unit prefills only what it preempted (recompute), never a fresh prompt
    recomputed = [s for r in out.records if r.instance == 1 and r.decision is not None for s in r.decision.chunked]
    assert all(t.recomputes[s] > 0 for s in recomputed)
    assert np.all(t.instance == 1)  # every sequence finished on the decode unit
    assert out.kv_moves.get("migrate", 0) >= N - int((t.output_len == 1).sum())  # KV shipped between caches
    assert t.recomputes.sum() > 0  # the decode unit ran short and recomputed (chunked, on its own GPU)


def test_sampled_outputs_do_not_depend_on_the_policy(saved):
    """Temperature and top-p sampling: a sequence's random draws belong to it (keyed by its id and step), so
    batching, yields, migrations and recomputes under different policies give the same tokens."""
    _, path = saved
    rng = np.random.default_rng(11)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    runs = {}
    for policy in ("coroutine", "continuous", "static"):
        job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                       cluster_overrides={"num_gpus": 2})
        out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 80),
                                        temperature=0.8, top_p=0.9, weights_seed=4))
        runs[policy] = [list(g) for g in out.tokens.generated]
    assert runs["coroutine"] == runs["continuous"] == runs["static"]
    greedy = execute(make_job("continuous", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8),
                     ExecSettings(device="cpu", model_path=str(path), weights_seed=4))
    assert runs["continuous"] != [list(g) for g in greedy.tokens.generated]  # it really sampled


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("residency,attention,tp", [("host", "gpu", 1), ("mixed", "gpu", 1), ("host", "cpu", 1),
                                                    ("mixed", "gpu", 2)])
def test_host_resident_decode_matches_hf_generate(saved, residency, attention, tp, device):
    """B_moe several times what device KV holds: running sequences beyond the device pages are host-resident
    (KV restored per layer and micro-batch into staging pages, or attended on the host CPU), and greedy
    outputs still equal transformers'. MLA models declare no CPU attention, so attention=cpu runs on the
    device there. tp=2: each rank is a TP-attention group of 2 GPUs (device attention as head shards)."""
    model, path = saved
    n, kv_tokens, page = 12, 80, 8
    rng = np.random.default_rng(7)
    inputs, outputs = rng.integers(24, 40, n), rng.integers(8, 32, n)
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=page,
                   cluster_overrides={"num_gpus": 2 * tp},
                   policy_overrides={"b_moe": 8, "b_attn": 2, "kv_residency": residency, "attention": attention,
                                     "attention_tp": tp})
    longest = -(-int((inputs + outputs).max()) // page) * page
    cpu = attention == "cpu" and not read_config(path).is_mla  # CPU attention stages nothing
    budget = kv_mb_for(path, kv_tokens, staging_seqs=0 if cpu else 2, max_context=longest)  # pool: ~80 tokens
    out = execute(job, ExecSettings(device=device, dtype="float32", model_path=str(path), kv_budget_mb=budget))
    assert out.prepared.state.gpu_pages[0] == kv_tokens // page
    assert out.prepared.policy.attention_tp == tp and out.prepared.state.topo.num_gpus == 2
    for sid in range(n):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    traffic = out.kv_traffic
    assert traffic["host_resident_seq_steps"] > 0
    # more sequences ran at once on a rank than its pages could hold device-resident, even at their prompts
    holds = (kv_tokens // page) // -(-int(inputs.min() + 1) // page)
    assert traffic["peak_rank_running"] >= 2 * holds, (traffic, holds)
    assert (traffic.get("cpu_attention_seq_steps", 0) > 0) == cpu
    assert (traffic["restored_bytes"] > 0) == (not cpu)
    if residency == "mixed":
        assert traffic["host_resident_seq_steps"] < traffic["seq_steps"]  # some ran device-resident


@pytest.mark.parametrize("policy,knobs", [("continuous", {"attention_tp": 2}),
                                          ("sglang_opt", {"token_budget": 24, "gpu_memory_fraction": 0.0,
                                                          "reserve_max_tokens": 40, "two_batch_overlap": False})])
def test_tp_attention_and_sglang_opt_match_hf_generate(saved, policy, knobs):
    """Tensor-parallel attention (each rank a group of 2 GPUs: attention run as two head shards over the
    group's one pool, their o_proj partials summed) and sglang_opt (conservative admission, chunks; without
    two-batch overlap, which the executor does not perform) both leave greedy outputs equal to transformers'."""
    model, path = saved
    rng = np.random.default_rng(5)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 4 if policy == "continuous" else 2}, policy_overrides=knobs)
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 200)))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    if policy == "continuous":
        assert out.prepared.policy.attention_tp == 2 and out.prepared.state.topo.num_gpus == 2  # 2 groups of 2
