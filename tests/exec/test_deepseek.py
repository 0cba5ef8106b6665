"""DeepSeek-V3 (MLA, shared experts, group-limited sigmoid routing, first layers dense) against transformers'
`DeepseekV3ForCausalLM` on tiny seeded models saved with `save_pretrained`: prompt logits through the real
`PagedKVCache` (built from the model's KV geometry: one latent per token, no V pool), greedy decoding against
`generate`, module-based batching, and the memory the MLA cache takes. The cache's latent pools start as a large
finite sentinel, so a read of a slot that was never written shows up in the logits (pools must stay finite:
attention masks the slots past a context instead of zeroing them)."""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import ExecModelConfig, ModelLoadError, init_random, load_model
from batchgen.exec.models.deepseek import DeepseekMoE

transformers = pytest.importorskip("transformers")

PAGE = 4
PROMPT_LENS = (5, 11, 8)
NEW_TOKENS = 12
SENTINEL = 1e4  # what never-written pool slots hold: wrecks the logits if read, harmless if masked
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_hf(**overrides):
    """vocab 256, hidden 64, 3 layers (the first dense), 4 heads, MLA ranks 32/32, rope 8, nope 16, v 16,
    8 routed experts in 2 groups (1 kept), top-2, 1 shared expert; a nonzero correction bias so that it counts."""
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=128,
                initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    args.update(overrides)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**args)).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


VARIANTS = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None}, "yarn_no_interleave":
            {"rope_parameters": YARN, "rope_interleave": False}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    hf = tiny_hf(**VARIANTS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


def new_cache(model, num_pages=64) -> PagedKVCache:
    cache = PagedKVCache(**model.kv_cache_geometry()._asdict(), page_size=PAGE, num_pages=num_pages)
    for layer in range(cache.num_layers):
        cache.layer(layer)[0].fill_(SENTINEL)
    return cache


def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen) for n in PROMPT_LENS]


def layers(cache: PagedKVCache):
    return [cache.layer(layer) for layer in range(cache.num_layers)]


@torch.no_grad()
def prefill(model, cache: PagedKVCache, toks: list[torch.Tensor]) -> torch.Tensor:
    meta = cache.prepare(list(range(len(toks))), [len(t) for t in toks], [0] * len(toks))
    meta.check()
    return model(torch.cat(toks), meta, layers(cache))


@torch.no_grad()
def test_config_and_names_from_save_pretrained(pair):
    hf, ours = pair
    c = ours.config
    assert (c.architecture, c.mlp_only_layers, c.n_group, c.topk_group, c.n_shared_experts) == \
           ("deepseek_v3", (0,), 2, 1, 1)
    assert ours.moe(0) is None and isinstance(ours.moe(1), DeepseekMoE)
    bias = hf.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.moe(2).gate.e_score_correction_bias, bias)


@torch.no_grad()
def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    toks = prompts()
    logits = prefill(ours, new_cache(ours), toks)
    expected = torch.cat([hf(t[None]).logits[0] for t in toks])
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-5, diff


@torch.no_grad()
def test_greedy_decoding_matches_generate(pair):
    hf, ours = pair
    toks = prompts()
    cache = new_cache(ours)
    logits = prefill(ours, cache, toks)
    nxt = logits[torch.tensor(PROMPT_LENS).cumsum(0) - 1].argmax(-1)
    out = [nxt]
    for step in range(NEW_TOKENS - 1):
        starts = [n + step for n in PROMPT_LENS]
        logits = ours(nxt, cache.prepare([0, 1, 2], [1, 1, 1], starts), layers(cache))
        nxt = logits.argmax(-1)
        out.append(nxt)
    ours_tokens = torch.stack(out, dim=1)
    for b, t in enumerate(toks):
        ref = hf.generate(t[None], max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(t)))
        assert ref[0, len(t):].tolist() == ours_tokens[b].tolist(), f"prompt {b}"


@torch.no_grad()
def test_attention_micro_batches_then_one_ffn_batch(pair):
    _, ours = pair
    toks = prompts()
    reference = prefill(ours, new_cache(ours), toks)
    cache = new_cache(ours)
    groups = [[0], [1, 2]]
    metas = [cache.prepare(g, [PROMPT_LENS[b] for b in g], [0] * len(g)) for g in groups]
    hidden = ours.embed(torch.cat(toks))
    bounds = [0, PROMPT_LENS[0], sum(PROMPT_LENS)]
    for layer in range(ours.num_layers):
        parts = [ours.attention_block(layer, hidden[bounds[i]:bounds[i + 1]], metas[i], cache.layer(layer))
                 for i in range(len(groups))]
        hidden = ours.ffn_block(layer, torch.cat(parts))
    assert (ours.final_logits(hidden) - reference).abs().max().item() < 1e-5


@torch.no_grad()
def test_yield_and_restore_of_the_latent_cache(pair):
    """The host copy round trip (YIELD, then COMBINE) carries the latent exactly: decoding continues the same."""
    _, ours = pair
    toks = prompts()
    cache = new_cache(ours)
    prefill(ours, cache, toks)
    step = torch.tensor([7, 8, 9])
    expected = ours(step, cache.prepare([0, 1, 2], [1, 1, 1], [n for n in PROMPT_LENS]), layers(cache))

    cache = new_cache(ours)
    prefill(ours, cache, toks)
    cache.yield_to_host([1])
    assert cache.used_pages() == sum(-(-n // PAGE) for n in PROMPT_LENS) - 3
    cache.restore([1])
    got = ours(step, cache.prepare([0, 1, 2], [1, 1, 1], list(PROMPT_LENS)), layers(cache))
    assert torch.equal(got, expected)
    cache.check()


@torch.no_grad()
def test_instance_runner_on_the_latent_cache(pair):
    """The runner's path: micro-batches of one sequence, one FFN batch, caches from the model's geometry."""
    from batchgen.exec.runner import InstanceRunner, RankBatch

    _, ours = pair
    toks = prompts()
    ends = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    reference = prefill(ours, new_cache(ours), toks)[ends]
    batch = RankBatch(new_cache(ours), [0, 1, 2], torch.cat(toks).tolist(), list(PROMPT_LENS), [0, 0, 0])
    (logits,), _ = InstanceRunner(ours, micro_batch=1).forward([batch])
    assert (logits - reference).abs().max().item() < 1e-5


def test_bf16_load_keeps_the_router_in_fp32(pair, tmp_path):
    hf, _ = pair
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    gate = model.moe(1).gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    cache = PagedKVCache(**model.kv_cache_geometry()._asdict(), page_size=PAGE, num_pages=16, dtype=torch.bfloat16)
    assert torch.isfinite(prefill(model, cache, prompts()).float()).all()


def test_mla_cache_memory_is_the_latent_only(pair):
    _, ours = pair
    c = ours.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    for dtype in (torch.float32, torch.bfloat16):
        size = torch.empty((), dtype=dtype).element_size()
        want = c.num_layers * latent * size
        assert ours.kv_bytes_per_token(dtype) == want
        cache = PagedKVCache.from_budget(**ours.kv_cache_geometry()._asdict(), page_size=PAGE,
                                         budget_bytes=want * PAGE * 10, dtype=dtype)
        assert cache.bytes_per_token == want and cache.num_pages == 10
        pools = [t for layer in range(c.num_layers) for t in cache.layer(layer)]
        assert sum(t.numel() for t in pools) * size == want * PAGE * 10  # no V pool anywhere
        assert cache.layer(0)[1].numel() == 0


def test_kv_cache_rejects_a_v_pool_of_another_width():
    with pytest.raises(ValueError, match="v_head_dim"):
        PagedKVCache(2, 1, 40, page_size=4, num_pages=2, v_head_dim=16)


def test_fused_expert_layout(tmp_path):
    hf = tiny_hf()
    hf.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    toks = prompts()
    ours = load_model(tmp_path)
    with torch.no_grad():
        expected = torch.cat([hf(t[None]).logits[0] for t in toks])
    assert (prefill(ours, new_cache(ours), toks) - expected).abs().max().item() < 1e-5


def test_missing_and_extra_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_hf().save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer: ignored, as transformers does
    save_file(tensors, str(file))
    load_model(tmp_path)
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    tensors.pop(name)
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.") + ".*missing"):
        load_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="llama3"):
        load_model(tmp_path)


def test_from_spec_builds_mla_configs():
    from batchgen.specs import load_model as load_spec

    cfg = ExecModelConfig.from_spec(load_spec("deepseek_v3"))  # 671B: the config only, no weights
    assert (cfg.architecture, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_group, cfg.topk_group) == \
           ("deepseek_v3", 512, 1536, 8, 4)
    assert cfg.mlp_only_layers == (0, 1, 2) and cfg.n_shared_experts == 1 and cfg.routed_scaling_factor == 2.5
    assert cfg.kv_cache_geometry() == (61, 1, 576, 0)
    assert cfg.kv_cache_geometry().bytes_per_token(2) == load_spec("deepseek_v3").kv_bytes_per_token

    import dataclasses
    tiny = dataclasses.replace(load_spec("deepseek_v3"), num_layers=2, hidden_size=32, vocab_size=64,
                               num_heads=2, num_kv_heads=2, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, num_experts=4, top_k=2,
                               moe_intermediate_size=16, first_dense_layers=1, max_context=64)
    small = ExecModelConfig.from_spec(tiny)
    assert (small.n_group, small.topk_group) == (1, 1)  # 4 experts do not split into 8 groups
    model = init_random(small, seed=0, std=0.2)
    toks = [torch.arange(5), torch.arange(3, 10)]
    logits = prefill(model, new_cache(model), toks)
    assert logits.shape == (12, 64) and torch.isfinite(logits).all()


def test_routing_a_rows_split_gives_the_whole_batchs_bits():
    """Expert parallelism routes each rank's rows alone: a split of a batch must route each row as the whole
    batch does, bit for bit (the elementwise sigmoid's scalar tail on a CPU changed some rows' last bits: on
    AVX-512, 9 of the 30 splits below). Parts of 1-3 rows are left out: the BLAS runs so few rows through
    other GEMM kernels (one row: a matrix-vector product), which the router's logits cannot avoid."""
    cfg = ExecModelConfig(architecture="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                          num_kv_heads=4, head_dim=8, num_experts=8, top_k=3, moe_intermediate_size=16,
                          q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                          n_shared_experts=1, n_group=4, topk_group=2, max_position_embeddings=64)
    moe = init_random(cfg, seed=3, std=0.3).moe(0)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids, weights = moe.route(x)
        for n in range(4, len(x) - 3):
            parts = [moe.route(part) for part in (x[:n], x[n:])]
            assert torch.equal(torch.cat([p[0] for p in parts]), ids)
            assert torch.equal(torch.cat([p[1] for p in parts]), weights), f"split at {n}"
