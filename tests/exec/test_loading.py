"""Loading Hugging Face directories: both expert layouts, shards, tied heads, and every bad input as a
`ModelLoadError` that names the file or the parameter."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models import ModelLoadError, load_model, load_tokenizer


def tiny_hf(arch: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(0)
    if arch == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)).eval()
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=8,
        norm_topk_prob=True, **common)).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[object, Path]:
    hf = tiny_hf("mixtral")
    path = tmp_path_factory.mktemp("mixtral")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(saved[1], dst)
    return dst


@torch.no_grad()
def logits_of(model, toks: torch.Tensor) -> torch.Tensor:
    """One prompt, pages 0..n-1 in order: the simplest valid metadata."""
    page, n = 4, len(toks)
    pages = (n + page - 1) // page
    meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n]), torch.tensor([n]),
                             torch.arange(pages)[None], torch.arange(n), page)
    caches = [tuple(torch.zeros(model.kv_cache_shape(pages, page)) for _ in range(2))
              for _ in range(model.num_layers)]
    return model(toks, meta, caches)


def assert_same_model(hf, ours) -> None:
    toks = torch.arange(3, 12)
    with torch.no_grad():
        expected = hf(toks[None]).logits[0]
    assert (logits_of(ours, toks) - expected).abs().max().item() < 1e-5


def test_save_pretrained_writes_per_expert_names(saved):
    from safetensors import safe_open

    with safe_open(str(saved[1] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert_same_model(saved[0], load_model(saved[1]))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_expert_layout_in_shards(arch, tmp_path):
    """transformers 5's own layout (save_original_format=False): experts.gate_up_proj / down_proj, sharded."""
    hf = tiny_hf(arch)
    hf.save_pretrained(tmp_path, save_original_format=False, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in index and len(set(index.values())) > 1
    assert_same_model(hf, load_model(tmp_path))


def test_bf16_load_casts_weights(saved):
    model = load_model(saved[1], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(copy)


def test_missing_weights(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(copy)


def test_missing_shard_named_by_index(copy):
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors"):
        load_model(copy)


def _rewrite(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_renamed_tensor_is_unexpected(copy):
    old = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    _rewrite(copy, lambda t: t.__setitem__(old.replace("w3", "w4"), t.pop(old)))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*unexpected.*experts\.2\.w4\.weight"):
        load_model(copy)


def test_dropped_tensor_is_missing(copy):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    _rewrite(copy, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=re.escape(name) + ".*missing"):
        load_model(copy)


def test_wrong_shape(copy):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(copy, lambda t: t.__setitem__(name, torch.zeros(8, 32)))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*k_proj\.weight.*\[8, 32\].*\[16, 32\]"):
        load_model(copy)


def test_config_disagreeing_with_weights(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["num_local_experts"] = 8
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"block_sparse_moe\.gate\.weight.*\[4, 32\].*\[8, 32\]"):
        load_model(copy)


def test_unsupported_model_type(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'gpt2'.*supported.*mixtral"):
        load_model(copy)


def test_unsupported_rope_scaling(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model(copy)


def test_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello world").ids == [1, 2]
