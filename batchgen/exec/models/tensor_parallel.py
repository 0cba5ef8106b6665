"""Attention of a PARTITIONed sequence, one head shard at a time (tensor-parallel attention).

A sequence partitioned over `degree` ranks runs attention on each of them for a slice of its heads: shard j
owns query heads [j*H/d, (j+1)*H/d) and (GQA) the KV heads they read, [j*Hkv/d, (j+1)*Hkv/d), whose K/V it
keeps in its own rank's cache; for MLA every shard keeps a replica of the latent and expands it only for its
heads. Each shard projects its heads, attends, and multiplies by its columns of o_proj: the shards' partial
outputs sum to the full attention output (the collective that joins them is that sum, an all-reduce across
the group). The split is over heads only, so nothing but the order of the final sum differs from the whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models.attention import PagedAttention
from batchgen.exec.models.layers import apply_rotary
from batchgen.exec.models.mla import MLAttention


def _rows(linear: torch.nn.Linear, lo: int, hi: int, x: torch.Tensor) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias[lo:hi]
    return F.linear(x, linear.weight[lo:hi], bias)


def check_degree(attn, degree: int) -> None:
    heads = (attn.num_heads, attn.num_kv_heads) if isinstance(attn, PagedAttention) else (attn.num_heads,)
    if degree < 1 or any(h % degree for h in heads):
        raise ValueError(f"cannot partition attention with heads {heads} over {degree} ranks: the degree must "
                         "divide every head count")


def shard_attention(attn, hidden: torch.Tensor, meta: AttentionMetadata, kv_layer, shard: int,
                    degree: int) -> torch.Tensor:
    """Shard `shard` of `degree`'s partial attention output [T, hidden_size], without o_proj's bias (add it
    once to the sum). `hidden` is already normed; the shard's new K/V (or latent) is written into kv_layer."""
    check_degree(attn, degree)
    if isinstance(attn, MLAttention):
        return _mla_shard(attn, hidden, meta, kv_layer, shard, degree)
    return _gqa_shard(attn, hidden, meta, kv_layer, shard, degree)


def _gqa_shard(attn: PagedAttention, hidden, meta, kv_layer, shard: int, degree: int) -> torch.Tensor:
    """Shard `shard`'s heads over `kv_layer`: the shard's own pools [pages, tokens per page, Hkv / degree, D]
    (a PARTITIONed sequence's), or a whole pool of every KV head (a TP-attention group's), of which it writes
    and reads its slice."""
    T, D = hidden.shape[0], attn.head_dim
    H, Hkv = attn.num_heads // degree, attn.num_kv_heads // degree
    q = _rows(attn.q_proj, shard * H * D, (shard + 1) * H * D, hidden).view(T, H, D)
    k = _rows(attn.k_proj, shard * Hkv * D, (shard + 1) * Hkv * D, hidden).view(T, Hkv, D)
    v = _rows(attn.v_proj, shard * Hkv * D, (shard + 1) * Hkv * D, hidden).view(T, Hkv, D)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = attn.rope(meta.positions.to(q.device), q.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k_pool, v_pool = kv_layer
    if k_pool.shape[2] != Hkv:  # a whole pool: this shard's slice of its KV heads (a view, written in place)
        heads = slice(shard * Hkv, (shard + 1) * Hkv)
        k_pool, v_pool = k_pool[:, :, heads], v_pool[:, :, heads]
    meta.write(k_pool.flatten(0, 1), k.to(k_pool.dtype))
    meta.write(v_pool.flatten(0, 1), v.to(v_pool.dtype))
    out = attn._attend(q, k_pool, v_pool, meta).reshape(T, H * D)
    return F.linear(out, attn.o_proj.weight[:, shard * H * D:(shard + 1) * H * D])


def _mla_shard(attn: MLAttention, hidden, meta, kv_layer, shard: int, degree: int) -> torch.Tensor:
    T, N = hidden.shape[0], attn.num_heads // degree
    lo, hi = shard * N * attn.qk_dim, (shard + 1) * N * attn.qk_dim
    if attn.q_proj is not None:
        q = _rows(attn.q_proj, lo, hi, hidden)
    else:
        q = _rows(attn.q_b_proj, lo, hi, attn.q_a_layernorm(attn.q_a_proj(hidden)))
    latent_pool = kv_layer[0]  # a replica of the whole latent: every shard writes the same row
    query = attn.rotate_and_cache(q.view(T, N, attn.qk_dim), hidden, meta, latent_pool)
    width = attn.nope + attn.v_dim
    kv_b = attn.kv_b_proj.weight[shard * N * width:(shard + 1) * N * width]
    out = attn._attend(query, latent_pool, meta, kv_b).reshape(T, N * attn.v_dim)
    return F.linear(out, attn.o_proj.weight[:, shard * N * attn.v_dim:(shard + 1) * N * attn.v_dim])



def group_attention(attn, hidden: torch.Tensor, meta: AttentionMetadata, kv_layer, degree: int) -> torch.Tensor:
    """Attention of a TP-attention group (policy.attention_tp = degree) over its one KV pool: the sum of the
    degree head shards' partial outputs (the all-reduce), with o_proj's bias once. MLA: every shard writes and
    reads the same latent (the replica each GPU of the group holds); GQA: shard j writes and reads its slice of
    the pool's KV heads (what GPU j holds). `hidden` is already normed."""
    check_degree(attn, degree)
    total = None
    for shard in range(degree):
        head_shard = _mla_shard if isinstance(attn, MLAttention) else _gqa_shard
        part = head_shard(attn, hidden, meta, kv_layer, shard, degree)
        total = part if total is None else total + part
    return total if attn.o_proj.bias is None else total + attn.o_proj.bias
