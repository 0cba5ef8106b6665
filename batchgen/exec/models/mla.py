"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token, `kv_a_proj_with_mqa` gives a latent c_kv (kv_lora_rank, then `kv_a_layernorm`) and one rotary key
k_pe (qk_rope_head_dim) shared by every head. The cache stores exactly that: one "head" per token and layer,
[c_kv | k_pe (after RoPE)], in the K pool of a `PagedKVCache` built with `v_head_dim=0` (no V pool; see
`ExecModelConfig.kv_cache_geometry`). Attention then gathers the context's latents through `block_table` and
expands them with `kv_b_proj` into per-head k_nope (qk_nope_head_dim) and v (v_head_dim); the key of head h
is [k_nope_h | k_pe] and the query [q_nope_h | q_pe_h]. One SDPA call, explicit mask, no loop over tokens or
sequences, as in `attention.PagedAttention`.

This is the "naive" path, written to match transformers' `DeepseekV3Attention` (5.24) in fp32: the context
is re-expanded in every layer of every step (context x kv_lora_rank x heads x (nope + v) FLOPs). The absorbed
path is future work: fold kv_b_proj's k_nope half into the query (q_nope_h W_uk_h, width kv_lora_rank) and its
v half into o_proj, so that attention runs directly on the cached latents with one shared 576-wide "key"
(MQA over [c_kv | k_pe]) and nothing is expanded; it changes rounding, so it would be checked against this
path rather than token-for-token against transformers.

RoPE, as transformers 5.24 does it: `rope_interleave` (DeepSeek's default) treats the rotary dims as
interleaved pairs (x0, x1), (x2, x3), ... and writes the result de-interleaved, [x_even' | x_odd'], for q_pe
and k_pe alike (the cached k_pe is in that layout); without it, the usual rotate-half. yarn scaling is
supported: yarn inverse frequencies, cos/sin multiplied by the attention factor, and the softmax scale
1/sqrt(qk_nope + qk_rope) multiplied by mscale(factor, mscale_all_dim)^2.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models import cascade
from batchgen.exec.models.padding import gather_context, pad_queries
from batchgen.exec.models.config import ExecModelConfig
from batchgen.exec.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps


class MLARotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` over qk_rope_head_dim, with yarn's frequencies and cos/sin scaling when configured."""

    def __init__(self, config: ExecModelConfig) -> None:
        dim, base = config.qk_rope_head_dim, config.rope_theta
        super().__init__(dim, base)
        self.attention_scaling = 1.0
        if config.rope_scaling:
            self.inv_freq, self.attention_scaling = yarn_parameters(
                dim, base, dict(config.rope_scaling), config.max_position_embeddings)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.attention_scaling == 1.0:
            return super().__call__(positions, dtype)
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(params: Mapping[str, Any], max_position_embeddings: int) -> float:
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the context to the pretraining context
        factor = max_position_embeddings / params["original_max_position_embeddings"]
    return float(factor)


def yarn_parameters(dim: int, base: float, params: Mapping[str, Any],
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor): transformers' `_compute_yarn_parameters`, operation for operation."""
    factor = _yarn_factor(params, max_position_embeddings)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    original = params["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def softmax_scale(config: ExecModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under yarn (transformers' rule)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** (-0.5)
    params = dict(config.rope_scaling)
    if params and params.get("mscale_all_dim"):
        m = _yarn_mscale(_yarn_factor(params, config.max_position_embeddings), params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, rope_dim] in interleaved pairs -> rotated, de-interleaved (transformers'
    `apply_rotary_pos_emb_interleave`); cos/sin [T, rope_dim] are cat(freqs, freqs): the first half is used."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """transformers' parameter names: q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj. The KV cache layer is (latent_pool, unused): latent_pool is
    [num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]; the second tensor (an empty V pool) is ignored."""

    def __init__(self, config: ExecModelConfig, rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_heads
        self.nope, self.rope_dim, self.v_dim, self.rank = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                                           c.kv_lora_rank)
        self.qk_dim = self.nope + self.rope_dim
        self.interleave = c.rope_interleave
        self.scale = softmax_scale(c)
        kw = dict(bias=False, device=device, dtype=dtype)
        H, N = c.hidden_size, c.num_heads
        if c.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(H, c.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, device=device, dtype=dtype)
            self.q_b_proj = nn.Linear(c.q_lora_rank, N * self.qk_dim, **kw)
        else:
            self.q_proj = nn.Linear(H, N * self.qk_dim, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = nn.Linear(H, self.rank + self.rope_dim, **kw)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, device=device, dtype=dtype)
        self.kv_b_proj = nn.Linear(self.rank, N * (self.nope + self.v_dim), **kw)
        self.o_proj = nn.Linear(N * self.v_dim, H, **kw)
        self.rope = rope

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """hidden [T, hidden_size] (already normed) -> [T, hidden_size]; writes this pass's latents."""
        T = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        latent_pool = kv_cache[0]
        query = self.rotate_and_cache(q.view(T, self.num_heads, self.qk_dim), hidden, meta, latent_pool)
        out = self._attend(query, latent_pool, meta)
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))

    def rotate_and_cache(self, q: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                         latent_pool: torch.Tensor) -> torch.Tensor:
        """Queries [T, heads, qk] (all heads, or a PARTITIONed shard's) with RoPE applied to their rotary part;
        the new tokens' latents [c_kv | k_pe] written into latent_pool."""
        q_nope, q_pe = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden), [self.rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        cos, sin = self.rope(meta.positions, q.dtype)
        q_pe = self._rotate(q_pe, cos, sin)
        k_pe = self._rotate(k_pe[:, None, :], cos, sin)[:, 0]
        if tuple(latent_pool.shape[-2:]) != (1, self.rank + self.rope_dim):
            raise ValueError(f"MLA needs a latent KV pool [pages, page_size, 1, {self.rank + self.rope_dim}] "
                             f"(kv_lora_rank + qk_rope_head_dim), got {list(latent_pool.shape)}: build the cache "
                             "from model.kv_cache_geometry()")
        flat = latent_pool.view(-1, self.rank + self.rope_dim)  # a view: the pool must be contiguous
        meta.write(flat, torch.cat([c_kv, k_pe], dim=-1).to(latent_pool.dtype))
        return torch.cat([q_nope, q_pe], dim=-1)

    def _attend(self, q: torch.Tensor, latent_pool: torch.Tensor, meta: AttentionMetadata,
                kv_b_weight: torch.Tensor | None = None) -> torch.Tensor:
        """kv_b_weight: kv_b_proj's rows for q's heads (a PARTITIONed sequence's head shard); None: all."""
        T, N, Dq = q.shape
        weight = self.kv_b_proj.weight if kv_b_weight is None else kv_b_weight
        if meta.prefix_pages is not None:
            return self._cascade(q, latent_pool, meta, weight)
        p = pad_queries(q, meta)
        B, Q, L = p.mask.shape
        latents = gather_context(latent_pool[:, :, 0], meta, p.valid, q.dtype)  # [B, L, rank + rope]
        keys, values = self._expand(latents, weight, N)

        out = F.scaled_dot_product_attention(p.q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=p.mask[:, None], scale=self.scale)  # [B, N, Q, v]
        return p.unpad(out.transpose(1, 2))  # [T, N, v]

    def _expand(self, latents: torch.Tensor, weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The naive expansion: latents [..., L, rank + rope] -> per-head keys [..., L, heads, qk] and values
        [..., L, heads, v]."""
        c_kv, k_pe = torch.split(latents, [self.rank, self.rope_dim], dim=-1)
        kv = F.linear(c_kv, weight).view(*latents.shape[:-1], heads, self.nope + self.v_dim)
        k_nope, values = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_pe[..., None, :].expand(*k_nope.shape[:-1], self.rope_dim)], dim=-1)
        return keys, values

    def _cascade(self, q: torch.Tensor, latent_pool: torch.Tensor, meta: AttentionMetadata,
                 weight: torch.Tensor) -> torch.Tensor:
        """A cascaded call (batchgen.exec.models.cascade): the shared prefix's latents read and expanded once for
        its B decode queries, each query's own pages apart; q [B, N, qk] -> [B, N, v]."""
        B, N, _ = q.shape
        keys, values = self._expand(cascade.prefix_pages(latent_pool[:, :, 0], meta.prefix_pages, q.dtype), weight, N)
        shared, shared_lse = cascade.attend_lse(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                self.scale)  # [N, B, v], [N, B]
        own = meta.own()
        p = pad_queries(q, own)
        ko, vo = self._expand(gather_context(latent_pool[:, :, 0], own, p.valid, q.dtype), weight, N)
        mine, mine_lse = cascade.attend_lse(q[:, :, None, :], ko.transpose(1, 2), vo.transpose(1, 2), self.scale,
                                            p.valid[:, None, None, :])  # [B, N, 1, v]
        return cascade.merge(shared.transpose(0, 1), shared_lse.transpose(0, 1), mine[:, :, 0], mine_lse[:, :, 0])
