"""The executor's models against transformers (the oracle) on tiny random models: full-prompt logits, greedy
decoding step by step through a paged KV cache, and module-based batching (attention in micro-batches, one
FFN batch). A test-local page allocator builds `AttentionMetadata` exactly as the contract says; its pools start
as a large finite sentinel, so any read of a slot that was never written shows up in the logits (pools must
stay finite: attention masks the slots past a context instead of zeroing them)."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models import ExecModelConfig, MoEDecoder, init_random, load_model, tokens_per_expert
from batchgen.exec.models.config import UnsupportedModelError

PAGE = 4
SENTINEL = 1e4  # what never-written pool slots hold: wrecks the logits if read, harmless if masked
PROMPT_LENS = (5, 11, 8)
NEW_TOKENS = 12


class ToyPagedCache:
    """Pages dealt round-robin (sequence b owns pages b, b+B, b+2B, ...) so that the gather through
    block_table is really exercised; block_table rows are padded with -1 to the batch's widest sequence."""

    def __init__(self, model: MoEDecoder, num_seqs: int, max_len: int, dtype=torch.float32):
        pages_per_seq = math.ceil(max_len / PAGE)
        self.pages = [[b + i * num_seqs for i in range(pages_per_seq)] for b in range(num_seqs)]
        shape = model.kv_cache_shape(num_seqs * pages_per_seq, PAGE)
        self.pools = [(torch.full(shape, SENTINEL, dtype=dtype), torch.full(shape, SENTINEL, dtype=dtype))
                      for _ in range(model.num_layers)]
        self.lens = [0] * num_seqs

    def meta(self, seqs: list[int], new_lens: list[int]) -> AttentionMetadata:
        """Metadata for a pass adding new_lens[i] tokens to sequence seqs[i]; call `advance` after it ran."""
        positions, slots = [], []
        for b, n in zip(seqs, new_lens):
            for p in range(self.lens[b], self.lens[b] + n):
                positions.append(p)
                slots.append(self.pages[b][p // PAGE] * PAGE + p % PAGE)
        ctx = [self.lens[b] + n for b, n in zip(seqs, new_lens)]
        width = max(math.ceil(c / PAGE) for c in ctx)
        table = [self.pages[b][:math.ceil(c / PAGE)] + [-1] * (width - math.ceil(c / PAGE))
                 for b, c in zip(seqs, ctx)]
        starts = [0]
        for n in new_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(torch.tensor(positions), torch.tensor(starts), torch.tensor(ctx),
                                 torch.tensor(table), torch.tensor(slots), PAGE)
        meta.check()
        return meta

    def advance(self, seqs: list[int], new_lens: list[int]) -> None:
        for b, n in zip(seqs, new_lens):
            self.lens[b] += n


def tiny_hf(arch: str, **overrides):
    """A seeded tiny transformers model; a larger init than HF's 0.02 keeps greedy margins far above fp32 noise."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    common.update(overrides)
    torch.manual_seed(0)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                                         **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                                          num_experts_per_tok=2, head_dim=16, mlp_only_layers=[1],
                                          norm_topk_prob=False, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=96, tie_word_embeddings=True, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "llama"])
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its save_pretrained directory)."""
    hf = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


def prompts(vocab: int = 256) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENS]


@torch.no_grad()
def prefill(model: MoEDecoder, cache: ToyPagedCache, toks: list[torch.Tensor]) -> torch.Tensor:
    seqs, lens = list(range(len(toks))), [len(t) for t in toks]
    logits = model(torch.cat(toks), cache.meta(seqs, lens), cache.pools)
    cache.advance(seqs, lens)
    return logits


@torch.no_grad()
def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    toks = prompts()
    logits = prefill(ours, ToyPagedCache(ours, 3, 32), toks)
    expected = torch.cat([hf(t[None]).logits[0] for t in toks])
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-5, diff


@torch.no_grad()
def test_greedy_decoding_matches_generate(pair):
    hf, ours = pair
    toks = prompts()
    cache = ToyPagedCache(ours, 3, max(PROMPT_LENS) + NEW_TOKENS)
    logits = prefill(ours, cache, toks)
    ends = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    nxt = logits[ends].argmax(-1)
    out = [nxt]
    for _ in range(NEW_TOKENS - 1):
        seqs = [0, 1, 2]
        logits = ours(nxt, cache.meta(seqs, [1, 1, 1]), cache.pools)
        cache.advance(seqs, [1, 1, 1])
        nxt = logits.argmax(-1)
        out.append(nxt)
    ours_tokens = torch.stack(out, dim=1)
    for b, t in enumerate(toks):
        ref = hf.generate(t[None], max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(t)))
        assert ref[0, len(t):].tolist() == ours_tokens[b].tolist(), f"prompt {b}"


@torch.no_grad()
def test_attention_micro_batches_then_one_ffn_batch(pair):
    """Module-based batching: attention per micro-batch (own metadata, same pools), FFN on the concatenation."""
    _, ours = pair
    toks = prompts()
    reference = prefill(ours, ToyPagedCache(ours, 3, 32), toks)

    cache = ToyPagedCache(ours, 3, 32)
    groups = [[0], [1, 2]]
    metas = [cache.meta(g, [PROMPT_LENS[b] for b in g]) for g in groups]
    hidden = ours.embed(torch.cat(toks))
    bounds = [0, PROMPT_LENS[0], sum(PROMPT_LENS)]
    for layer in range(ours.num_layers):
        parts = [ours.attention_block(layer, hidden[bounds[i]:bounds[i + 1]], metas[i], cache.pools[layer])
                 for i in range(len(groups))]
        hidden = ours.ffn_block(layer, torch.cat(parts))
    assert torch.allclose(ours.final_logits(hidden), reference, atol=1e-5)


@torch.no_grad()
def test_chunked_prefill_mixed_with_other_sequences(pair):
    """A sequence continuing from cached context (query_len > 1, positions not from 0) in the same pass as
    another sequence's whole prompt gives the same logits as running each prompt in one go."""
    _, ours = pair
    toks = prompts()
    reference = prefill(ours, ToyPagedCache(ours, 3, 32), toks)
    ends = torch.tensor(PROMPT_LENS).cumsum(0)

    cache = ToyPagedCache(ours, 3, 32)
    first = 6
    ours(toks[1][:first], cache.meta([1], [first]), cache.pools)
    cache.advance([1], [first])
    rest = len(toks[1]) - first
    logits = ours(torch.cat([toks[1][first:], toks[2]]), cache.meta([1, 2], [rest, len(toks[2])]), cache.pools)
    assert torch.allclose(logits[:rest], reference[ends[1] - rest:ends[1]], atol=1e-5)
    assert torch.allclose(logits[rest:], reference[ends[1]:ends[2]], atol=1e-5)


@torch.no_grad()
def test_sliding_window_matches_transformers(tmp_path):
    hf = tiny_hf("mixtral", sliding_window=4)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.sliding_window == 4
    toks = prompts()
    logits = prefill(ours, ToyPagedCache(ours, 3, 32), toks)
    expected = torch.cat([hf(t[None]).logits[0] for t in toks])
    assert (logits - expected).abs().max().item() < 1e-5


@torch.no_grad()
def test_grouped_experts_equal_dense_reference():
    """The sorted, grouped execution equals a plain per-token sum over the k chosen experts."""
    cfg = ExecModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=24)
    moe = init_random(cfg, seed=3, std=0.3).moe(0)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    ids, w = moe.route(x)
    assert torch.allclose(w.sum(-1), torch.ones(40))  # Mixtral renormalises
    assert tokens_per_expert(ids, 4).sum() == 80
    ref = torch.zeros_like(x)
    for t in range(40):
        for j in range(2):
            e = ids[t, j]
            h = torch.nn.functional.silu(moe.w_gate[e] @ x[t]) * (moe.w_up[e] @ x[t])
            ref[t] += w[t, j] * (moe.w_down[e] @ h)
    assert torch.allclose(moe.experts(x, ids, w), ref, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_expert_loop(dtype):
    """torch._grouped_mm (one call per projection for all experts) gives what one GEMM per expert gives (to
    rounding: tiny shapes may take other kernels), with empty experts."""
    from batchgen.exec.models.moe import grouped_mm_available
    cfg = ExecModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, num_experts=6, top_k=2, moe_intermediate_size=24)
    moe = init_random(cfg, seed=3, std=0.3, dtype=dtype).moe(0)
    x = torch.randn(30, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    counts = [7, 0, 11, 0, 12, 0]  # rows already sorted by expert; three experts get nothing
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    if not grouped_mm_available(x.device, dtype):
        pytest.skip("this torch has no usable torch._grouped_mm here: the loop runs")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(moe._grouped(x, offs).float(), moe._looped(x, counts).float(), rtol=tol, atol=tol)
    ids, w = moe.route(x)
    moe.experts(x, ids, w)
    assert sum(moe.last_tokens_per_expert) == 60


@torch.no_grad()
def test_tiny_moe_spec_random_init_bf16_and_fp32():
    from batchgen.specs import load_model as load_spec

    cfg = ExecModelConfig.from_spec(load_spec("tiny_moe"))
    assert (cfg.architecture, cfg.num_experts, cfg.top_k, cfg.num_kv_heads) == ("mixtral", 8, 2, 2)
    toks = prompts(cfg.vocab_size)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = init_random(cfg, seed=0, dtype=dtype)
        assert model.embed_tokens.weight.dtype == dtype
        results[dtype] = prefill(model, ToyPagedCache(model, 3, 16, dtype=dtype), toks).float()
        assert torch.isfinite(results[dtype]).all()
    diff = (results[torch.float32] - results[torch.bfloat16]).abs().max().item()
    assert diff < 0.1 * results[torch.float32].abs().max().item()


def test_from_spec_refuses_shared_experts_with_gqa():
    """MLA specs build DeepSeek-V3 configs (tests/exec/test_deepseek.py); shared experts exist only there."""
    from dataclasses import replace

    from batchgen.specs import load_model as load_spec

    with pytest.raises(UnsupportedModelError, match="shared experts"):
        ExecModelConfig.from_spec(replace(load_spec("tiny_moe"), num_shared_experts=1))


def test_from_hf_config_names_unsupported_model_type():
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*mixtral.*qwen3_moe"):
        ExecModelConfig.from_hf_config({"model_type": "gpt2"})
