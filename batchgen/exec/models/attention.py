"""GQA attention over the paged KV cache described by `batchgen.exec.metadata.AttentionMetadata`.

One call handles any mix of prefill, decode and recompute: the new tokens' K/V are written into the pool at
`slot_mapping`, then every sequence's whole context is gathered through `block_table` into a padded batch and
attended with one SDPA call under an explicit boolean mask. No loop over tokens or sequences. The pools may be
on another device than the model (attention on the host CPU beside host-resident KV): then q, k, v go to the
pools' device and the output comes back, and nothing else crosses.

GQA without copying K/V per query head: the `rep = num_heads // num_kv_heads` query heads that share a KV head
are folded into the query-length axis, so SDPA sees [B, kv_heads, rep * Q, D] queries against
[B, kv_heads, L, D] keys. This works with every SDPA backend (unlike `enable_gqa`) and moves rep times less
K/V than repeating it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models import cascade, invariant
from batchgen.exec.models.config import ExecModelConfig
from batchgen.exec.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
from batchgen.exec.models.padding import gather_context, pad_queries

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # (k_pool, v_pool), each [num_pages, page_size, kv_heads, head_dim]


class PagedAttention(nn.Module):
    def __init__(self, config: ExecModelConfig, rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding_window = c.sliding_window
        kw = dict(device=device, dtype=dtype)
        self.q_proj = invariant.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.k_proj = invariant.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.v_proj = invariant.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.o_proj = invariant.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias, **kw)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        self.rope = rope

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCacheLayer) -> torch.Tensor:
        """hidden [T, hidden_size] (already normed) -> [T, hidden_size]; writes this pass's K/V into kv_cache."""
        T = hidden.shape[0]
        q = self.q_proj(hidden).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope(meta.positions.to(q.device, non_blocking=True), q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        k_pool, v_pool = kv_cache
        if k_pool.device != q.device:  # attention beside a host-resident KV on the CPU: q, k, v go there
            q, k, v = (x.to(k_pool.device) for x in (q, k, v))
        flat_k = k_pool.view(-1, self.num_kv_heads, self.head_dim)  # a view: the pool must be contiguous
        flat_v = v_pool.view(-1, self.num_kv_heads, self.head_dim)
        meta.write(flat_k, k.to(k_pool.dtype))
        meta.write(flat_v, v.to(v_pool.dtype))

        if invariant.enabled():
            out = invariant.attend(q, k_pool, v_pool, meta, self.sliding_window)
        else:
            out = self._attend(q, k_pool, v_pool, meta)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim).to(hidden.device))

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        T, H, D = q.shape
        Hkv = k_pool.shape[2]  # all KV heads, or a PARTITIONed sequence's head shard (tensor_parallel.py)
        rep = H // Hkv
        if meta.prefix_pages is not None:
            return self._cascade(q, k_pool, v_pool, meta)
        p = pad_queries(q, meta, self.sliding_window)
        keys = gather_context(k_pool, meta, p.valid, q.dtype)    # [B, L, Hkv, D]
        values = gather_context(v_pool, meta, p.valid, q.dtype)
        B, Q, L = p.mask.shape
        mask, q_pad = p.mask, p.q

        # Fold the rep query heads of each KV head into the query axis: head h = kv * rep + r (HF's repeat_kv).
        qf = q_pad.view(B, Q, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, rep * Q, D)
        maskf = mask[:, None, None, :, :].expand(B, 1, rep, Q, L).reshape(B, 1, rep * Q, L)
        out = F.scaled_dot_product_attention(qf, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=maskf)
        out = out.view(B, Hkv, rep, Q, D).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, rep, D]
        return p.unpad(out).reshape(T, H, D)

    def _cascade(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """A cascaded call (batchgen.exec.models.cascade): its B decode queries over the shared prefix's K/V, read
        once, and each over its own pages; q [B, H, D] -> [B, H, D]."""
        if self.sliding_window is not None:
            raise ValueError("cascade attention reads a shared prefix whole: a sliding-window model needs "
                             "policy.cascade_attention=off")
        B, H, D = q.shape
        Hkv = k_pool.shape[2]
        rep, scale = H // Hkv, 1.0 / math.sqrt(D)
        keys = cascade.prefix_pages(k_pool, meta.prefix_pages, q.dtype).transpose(0, 1)  # [Hkv, P, D]
        values = cascade.prefix_pages(v_pool, meta.prefix_pages, q.dtype).transpose(0, 1)
        qk = q.view(B, Hkv, rep, D).permute(1, 0, 2, 3).reshape(Hkv, B * rep, D)  # every query of a KV head
        shared, shared_lse = cascade.attend_lse(qk, keys, values, scale)
        shared, shared_lse = shared.view(Hkv, B, rep, -1), shared_lse.view(Hkv, B, rep)
        own = meta.own()
        p = pad_queries(q, own)
        ko = gather_context(k_pool, own, p.valid, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        vo = gather_context(v_pool, own, p.valid, q.dtype).transpose(1, 2)
        qo = q.view(B, Hkv, rep, D)
        mine, mine_lse = cascade.attend_lse(qo, ko, vo, scale, p.valid[:, None, None, :])  # [B, Hkv, rep, Dv]
        out = cascade.merge(shared.permute(1, 0, 2, 3), shared_lse.permute(1, 0, 2), mine, mine_lse)
        return out.reshape(B, H, -1)
