"""Tensor-parallel attention: a rank of the scheduler is a group of `degree` GPUs that share each sequence.

SGLang without --enable-dp-attention (and vLLM's default) runs attention tensor-parallel: every GPU of a group
holds 1/degree of the query heads (GQA: of the KV heads too, and their K/V; MLA: the whole latent, replicated,
as SGLang does for DeepSeek), projects and attends for those heads over the group's whole batch, and an
all-reduce of the hidden states joins the heads' o_proj outputs before the FFN. The dense FFN, the shared
experts and the vocabulary (embedding, LM head) are sharded 1/degree the same way (SGLang's TP linear layers);
the router is replicated; routed experts stay spread over the whole instance (`base.ep_ranks` GPUs), each GPU
dispatching 1/degree of its group's tokens (the all-to-all is the base model's, over the instance's tokens).

`TPAttention` prices ONE GROUP as the simulator's rank: every per-rank cost is taken on the group's tokens
with the shard's shapes (`shard_spec`: heads, intermediates and vocabulary divided by degree; GQA's KV bytes per
token divided by degree, MLA's latent not), which is what each GPU of the group runs; `attention_join` is the
all-reduce per layer. Host-resident KV moves per GPU, each its share of every token over its own link (GQA:
1/degree of the heads; MLA: the whole latent). Routed experts, the all-to-all and weight copies are the base
model's. The memory planner reads `weight_bytes_per_rank` (one GPU's share) and `kv_pages_per_group` to size the
group's KV. With latency=table the sharded modules are priced by the roofline (a calibration measures whole
modules, not head shards); the rest keeps the table.

Why not PARTITION (which splits one sequence's heads over ranks on the fly): a TP-attention engine shards every
sequence over a fixed group with one scheduler, one running cap and one KV pool per group; pricing and
scheduling the group as one rank gives exactly that, where per-GPU ranks would have to hold an MLA sequence's
replicated latent in 1/degree of a GPU's pool.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from batchgen.latency.base import LatencyModel
from batchgen.specs import ModelSpec


def attention_degrees(model: ModelSpec, instance_size: int) -> tuple[int, ...]:
    """Degrees a TP-attention group may have: divisors of the instance's GPUs (groups tile it) that split the
    query heads (GQA: and KV heads), the dense and shared intermediates and the vocabulary evenly."""
    out = []
    for t in range(1, instance_size + 1):
        if instance_size % t or t not in model.partition_degrees(instance_size):
            continue
        if model.num_dense_layers and model.intermediate_size % t:
            continue
        if model.is_moe and model.num_shared_experts and model.moe_intermediate_size % t:
            continue
        out.append(t)
    return tuple(out)


def shard_spec(model: ModelSpec, degree: int) -> ModelSpec:
    """The shapes one GPU of a TP-attention group computes with: heads, dense / shared intermediates and the
    vocabulary divided by `degree` (GQA: KV heads too, so its KV bytes per token; MLA keeps the latent)."""
    if degree == 1:
        return model
    heads = model.num_heads // degree
    kv = model.num_kv_heads // degree if model.attention == "gqa" else heads
    shared_inter = model.moe_intermediate_size // degree if model.num_shared_experts else model.moe_intermediate_size
    return dataclasses.replace(model, num_heads=heads, num_kv_heads=kv,
                               intermediate_size=model.intermediate_size // degree,
                               moe_intermediate_size=max(shared_inter, 1),
                               vocab_size=max(model.vocab_size // degree, 1), name=f"{model.name}/tp{degree}")


def partition_attention_decode(lat, degree: int, tokens, context_sum, micro_batches=1, max_context=None):
    """Decode attention of PARTITIONed sequences' head shards on one rank of their groups (degree > 1):
    `tokens` shard rows (one per partitioned sequence the rank serves) over `context_sum` context. A shard
    projects and attends for 1/degree of the heads (batchgen.exec.models.tensor_parallel), so it reads that
    share of the head-indexed projection weights (MLA's shared low-rank projections whole) and of a GQA
    token's KV (MLA: the whole latent). A roofline prices it on the shard's shapes (`Roofline.head_shard`);
    a measured model (latency=table, which measured whole heads only) is scaled by the roofline's ratio of
    the shard to the whole."""
    roof = getattr(lat, "fallback", lat)  # a TablePredictor's roofline, or the roofline itself
    shard = roof.head_shard(degree).attention_decode(tokens, context_sum, micro_batches, max_context)
    if roof is lat:
        return shard
    whole_roof = np.asarray(roof.attention_decode(tokens, context_sum, micro_batches, max_context), float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(whole_roof > 0, np.asarray(shard, float) / whole_roof, 0.0)
    return np.asarray(lat.attention_decode(tokens, context_sum, micro_batches, max_context), float) * ratio


class TPAttention:
    """A latency model whose rank is a TP-attention group of `degree` GPUs (see the module docstring).
    `shard` prices one GPU's share of the group's work (a Roofline over `shard_spec`); `base` everything that
    spans the instance. Anything not overridden is the base model's."""

    def __init__(self, base: LatencyModel, shard: LatencyModel, degree: int) -> None:
        if degree < 2:
            raise ValueError(f"TPAttention needs a degree >= 2, got {degree}")
        self.base, self.shard, self.degree = base, shard, int(degree)
        self.model = base.model

    def __getattr__(self, name):  # everything not overridden: the base model's
        return getattr(self.base, name)

    @property
    def attention_tp(self) -> int:
        return self.degree

    def key(self) -> tuple:
        return (*self.base.key(), "tp_attention", self.degree)

    # ---- sharded modules: one GPU's share of its group's tokens ----
    def attention_decode(self, tokens, context_sum, micro_batches=1, max_context=None):
        return self.shard.attention_decode(tokens, context_sum, micro_batches, max_context)

    def attention_prefix(self, pairs, kv_tokens, calls):
        return self.shard.attention_prefix(pairs, kv_tokens, calls)

    def attention_prefill(self, tokens, context_sq_sum, micro_batches=1, max_context=None, sequences=None):
        return self.shard.attention_prefill(tokens, context_sq_sum, micro_batches, max_context, sequences)

    def dense_ffn(self, tokens):
        return self.shard.dense_ffn(tokens)

    def shared_experts(self, tokens):
        return self.shard.shared_experts(tokens)

    def lm_head(self, tokens):
        return self.shard.lm_head(tokens)

    # ---- host-resident KV: each GPU of the group moves its share of every sequence's KV over its own link ----
    @property
    def _kv_split(self) -> int:
        """How many ways a token's KV is split over the group: GQA's KV heads (degree), MLA's latent (1:
        replicated, every GPU restores all of it, in parallel on its own PCIe link)."""
        return self.degree if self.model.attention == "gqa" else 1

    def kv_restore(self, context_sum, micro_batches=1):
        return self.base.kv_restore(np.asarray(context_sum, float) / self._kv_split, micro_batches)

    def kv_append(self, tokens, micro_batches=1):
        return self.base.kv_append(np.asarray(tokens, float) / self._kv_split, micro_batches)

    def attention_join(self, tokens):
        """Seconds per layer of the all-reduce that sums the heads' o_proj outputs over the group: a hidden row
        per token of the group's forward (0 without tokens)."""
        m = self.model
        return self.base.all_reduce(tokens * m.hidden_size * m.act_bytes, self.degree)

    # ---- memory ----
    def weight_bytes_per_rank(self) -> float:
        """One GPU's weights: its 1/degree of attention, dense FFN, shared experts and vocabulary, the router,
        and its routed experts."""
        m, t = self.model, self.degree
        sharded = (m.num_layers * m.attention_params_per_layer + m.num_dense_layers * m.dense_ffn_params
                   + m.embedding_params + m.num_moe_layers * m.shared_expert_params)
        return self.base.weight_bytes_per_rank() - sharded * m.weight_bytes * (1 - 1 / t)

    def kv_pages_per_group(self, pages_per_gpu: int) -> int:
        """KV pages (in whole-token pages) a group holds: GQA splits every token's K/V over the group's GPUs
        (degree x one GPU's pool); MLA replicates the latent on each GPU, so the group holds one GPU's pool."""
        return pages_per_gpu * (self.degree if self.model.attention == "gqa" else 1)
