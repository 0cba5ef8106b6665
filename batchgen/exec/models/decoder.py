"""A Mixtral / Qwen3-MoE / DeepSeek-V3 style decoder whose layers are exposed module by module, for module-based
batching. DeepSeek-V3 (architecture "deepseek_v3") swaps in MLA attention (`mla.py`) and the group-routed MoE
with shared experts (`deepseek.py`); its KV cache holds one latent per token: build caches from
`kv_cache_geometry()`, which is right for every architecture.

A runner calls `embed`, then for each layer `attention_block` on micro-batches of sequences (each with its own
metadata and the same layer's KV pool) and `ffn_block` once on their concatenated hidden states, then
`final_logits` on the rows it samples from. `forward` is the same thing in one batch, for tests and simple use.
Every token is independent outside attention, so this split changes no result.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models import invariant
from batchgen.exec.models.attention import KVCacheLayer, PagedAttention
from batchgen.exec.models.config import ExecModelConfig, KVCacheGeometry
from batchgen.exec.models.deepseek import DeepseekMoE
from batchgen.exec.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from batchgen.exec.models.mla import MLARotaryEmbedding, MLAttention
from batchgen.exec.models.moe import SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, config: ExecModelConfig, layer: int, rope: RotaryEmbedding, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = (MLAttention if config.is_mla else PagedAttention)(config, rope, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.is_moe = config.is_moe_layer(layer)
        moe = DeepseekMoE if config.architecture == "deepseek_v3" else SparseMoE
        self.mlp = (moe(config, **kw) if self.is_moe
                    else SwiGLUMLP(config.hidden_size, config.intermediate_size, **kw))


class MoEDecoder(nn.Module):
    """Parameters are created uninitialised: use `loading.load_model` or `loading.init_random`."""

    def __init__(self, config: ExecModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_layers
        kw = dict(device=device, dtype=dtype)
        self.rope = (MLARotaryEmbedding(config) if config.is_mla
                     else RotaryEmbedding(config.head_dim, config.rope_theta))
        # built without its random init (every model is filled by the loader or `init_random`): normal_ on the
        # meta device imports torch._dynamo, a second of every process's start-up
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, **kw))
        self.layers = nn.ModuleList(DecoderLayer(config, layer, self.rope, **kw)
                                    for layer in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.lm_head = (None if config.tie_word_embeddings
                        else invariant.Linear(config.hidden_size, config.vocab_size, bias=False, **kw))

    # ---- module-level entry points ----

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return self.embed_tokens(token_ids)

    def attention_block(self, layer: int, hidden: torch.Tensor, meta: AttentionMetadata,
                        kv_cache_layer: KVCacheLayer) -> torch.Tensor:
        """Input norm + attention + residual, for the sequences `meta` describes; writes their new K/V."""
        block = self.layers[layer]
        return hidden + block.self_attn(block.input_layernorm(hidden), meta, kv_cache_layer)

    def ffn_block(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Post-attention norm + MoE (or dense MLP) + residual, over any set of tokens. Afterwards
        `self.moe(layer).last_tokens_per_expert` holds this call's expert batch sizes."""
        block = self.layers[layer]
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def moe(self, layer: int) -> SparseMoE | None:
        """The layer's MoE module (for `route` / `experts`), None for a dense layer."""
        mlp = self.layers[layer].mlp
        return mlp if isinstance(mlp, SparseMoE) else None

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [T, hidden] -> [T, vocab]. Pass only the rows you sample from."""
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        lin = invariant.linear if invariant.enabled() else F.linear
        return lin(hidden, self.embed_tokens.weight)

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: Sequence[KVCacheLayer]) -> torch.Tensor:
        """All layers on one batch: [T] token ids -> [T, vocab] logits (every row)."""
        hidden = self.embed(token_ids)
        for layer in range(self.num_layers):
            hidden = self.attention_block(layer, hidden, meta, kv_caches[layer])
            hidden = self.ffn_block(layer, hidden)
        return self.final_logits(hidden)

    # ---- KV cache geometry ----

    def kv_cache_geometry(self) -> KVCacheGeometry:
        """What to build the paged KV cache with, for any architecture:
        `PagedKVCache.from_budget(**model.kv_cache_geometry()._asdict(), page_size=..., budget_bytes=...)`.
        MLA: one latent "head" of kv_lora_rank + qk_rope_head_dim in the K pool and no V pool."""
        return self.config.kv_cache_geometry()

    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        """Shape of a layer's K pool (and of its V pool, if the geometry has one; MLA reads only the K pool)."""
        g = self.kv_cache_geometry()
        return (num_pages, page_size, g.num_kv_heads, g.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """All layers, K and V (MLA: the latent only)."""
        return self.kv_cache_geometry().bytes_per_token(torch.empty((), dtype=dtype).element_size())
