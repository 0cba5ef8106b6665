"""How much KV fits where: the memory budget of a job, checked before any work starts.

Device: usable HBM = hbm * gpu_memory_fraction - activation_reserve_gb (a fixed part: CUDA context,
communication buffers) - activations of the policy's batch shape (`BatchShape`, see `activation_bytes`: the
expert batch at the gate, the attention micro-batch, the prefill chunk, and the double-buffered staging area
of host-resident decode); the rest after this rank's resident weights is the paged KV pool. A policy that may
stream weights (coroutine) keeps the experts of some MoE layers on the host and copies them through a ring
buffer of two MoE layers' experts, paying a PCIe copy of every streamed layer's experts every iteration: all
layers when the weights do not fit otherwise (the default), or as many as a plan chose (`streamed_layers`).
Host: each node keeps a copy of its GPUs' weights (the source of truth) and the rest, up to
host_memory_fraction, holds KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.specs import ClusterSpec, ModelSpec


class ConfigError(ValueError):
    """Bad input: says what is wrong and how to fix it, raised before the job starts."""


@dataclass(frozen=True)
class MemorySettings:
    gpu_memory_fraction: float = 0.9     # of HBM the engine may use (the rest: fragmentation)
    activation_reserve_gb: float = 1.0   # per GPU, fixed: CUDA context, communication buffers (activations of
    #                                      the batch shape come on top when the policy declares one)
    host_memory_fraction: float = 0.9    # of each node's host memory the engine may use

    def __post_init__(self):
        for name in ("gpu_memory_fraction", "host_memory_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"memory.{name} must be in (0, 1], got {v}")
        if self.activation_reserve_gb < 0:
            raise ConfigError(f"memory.activation_reserve_gb must be >= 0, got {self.activation_reserve_gb}")


@dataclass(frozen=True)
class BatchShape:
    """The largest batches a policy forms on one rank, which size its activation memory.

    gate_tokens: tokens entering the gate in one forward (decode: running sequences, B_moe).
    attn_seqs: sequences in one attention micro-batch (B_attn).
    prefill_tokens: prompt tokens in one prefill forward.
    staging_seqs: sequences per staging buffer of host-resident decode (B_attn), 0 without host-resident decode.
    """

    gate_tokens: int
    attn_seqs: int
    prefill_tokens: int
    staging_seqs: int = 0

    def __post_init__(self):
        for name in ("gate_tokens", "attn_seqs", "prefill_tokens", "staging_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ConfigError(f"BatchShape.{name} must be a whole number >= 0, got {v!r}")


def batch_shape_of(policy, max_context: int) -> BatchShape | None:
    """The policy's batch shape (`policy.batch_shape(max_context)`), or None if it declares none."""
    fn = getattr(policy, "batch_shape", None)
    return fn(max_context) if callable(fn) else None


def staging_bytes(model: ModelSpec, staging_seqs: int, max_context: int) -> float:
    """Two staging buffers (double buffering), each one layer's KV of staging_seqs sequences at max_context."""
    return 2.0 * staging_seqs * max_context * model.kv_bytes_per_token_per_layer


def activation_bytes(model: ModelSpec, shape: BatchShape, max_context: int) -> float:
    """Device bytes for activations of one rank (beyond the fixed reserve), a decision where papers are silent:

    - per token at the gate (decode: gate_tokens; prefill: prefill_tokens): four hidden-state rows (residual,
      normed input, attention output, FFN output), fp32 router logits, the all-to-all's dispatch and combine
      buffers (top_k rows each way) and the FFN intermediate (gate and up outputs of top_k experts, or of a
      dense layer's FFN, whichever is larger);
    - per sequence of an attention micro-batch: fp32 queries and partial outputs of every head (scores are not
      materialised: flash kernels);
    - a prefill chunk also holds two layers' KV of its tokens (written, then offloaded layer by layer) and, for
      MLA, its keys and values up-projected per head;
    - host-resident decode adds the double-buffered staging area (`staging_bytes`).
    Decode and prefill forwards do not overlap: the larger of the two counts, plus the staging area.
    """
    m = model
    row = m.hidden_size * m.act_bytes
    inter = 0
    if m.is_moe:
        inter = m.top_k * m.moe_intermediate_size + m.num_shared_experts * m.moe_intermediate_size
    if m.num_dense_layers:
        inter = max(inter, m.intermediate_size)
    per_token = 4 * row + 4 * m.num_experts + (2 * m.top_k * row if m.is_moe else 0) + 2 * inter * m.act_bytes
    if m.attention == "gqa":
        qk, v = m.head_dim, m.head_dim
    else:  # absorbed MLA decode: queries in the latent space
        qk, v = m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
    per_seq = m.num_heads * (qk + v) * 4
    decode = shape.gate_tokens * per_token + shape.attn_seqs * per_seq
    prefill_row = per_token + 2 * m.kv_bytes_per_token_per_layer
    if m.attention == "mla":
        prefill_row += m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * m.act_bytes
    prefill = shape.prefill_tokens * prefill_row
    return float(max(decode, prefill) + staging_bytes(m, shape.staging_seqs, max_context))


@dataclass(frozen=True)
class MemoryBudget:
    weights_per_gpu_bytes: float     # resident on each GPU (with the ring buffer of streamed experts)
    streamed_bytes_per_iter: float   # weights copied host -> GPU every iteration (0 if all resident)
    kv_pages_per_gpu: int
    host_kv_tokens_per_node: int
    page_tokens: int
    activation_bytes: float = 0.0    # per GPU, from the policy's batch shape (staging included), beyond the
    #                                  fixed activation_reserve_gb
    staging_bytes: float = 0.0       # per GPU: the double-buffered staging area of host-resident decode
    streamed_layers: int = 0         # MoE layers whose experts stream through the ring buffer
    attention_tp: int = 1            # >1: a scheduler rank is a TP-attention group of this many GPUs, and
    #                                  kv_pages_per_gpu counts the group's pages (`group_budget`)
    whole_layers: bool = False       # the streamed_layers stream whole decoder layers (every one), not experts
    prefill_ring_bytes: float = 0.0  # per GPU: two MoE layers of the experts a data-parallel prefill streams in

    def describe(self, model: ModelSpec) -> str:
        gb = 1e9
        kv_tok = self.kv_pages_per_gpu * self.page_tokens
        if self.attention_tp > 1:
            per = f"TP-attention group of {self.attention_tp} GPUs" + (
                ", latent replicated on each" if model.attention == "mla" else ", KV heads split")
            return (f"weights {self.weights_per_gpu_bytes / gb:.1f} GB/GPU resident (attention, dense FFN, shared "
                    f"experts and vocabulary sharded 1/{self.attention_tp})"
                    + (f", activations {self.activation_bytes / gb:.1f} GB/GPU" if self.activation_bytes else "")
                    + f", KV {kv_tok:,} tokens per {per}")
        return (f"weights {self.weights_per_gpu_bytes / gb:.1f} GB/GPU resident"
                + (f" (+{self.streamed_bytes_per_iter / gb:.1f} GB streamed per iteration, "
                   f"{self.streamed_layers} of {model.num_moe_layers} MoE layers)"
                   if self.streamed_bytes_per_iter else "")
                + (f", a ring of {self.prefill_ring_bytes / gb:.1f} GB/GPU for the experts data-parallel prefill "
                   "streams" if self.prefill_ring_bytes else "")
                + (f", activations {self.activation_bytes / gb:.1f} GB/GPU" if self.activation_bytes else "")
                + (f" (staging {self.staging_bytes / gb:.1f} GB)" if self.staging_bytes else "")
                + f", KV {kv_tok:,} tokens/GPU ({kv_tok * model.kv_bytes_per_token / gb:.1f} GB)"
                + f", host KV {self.host_kv_tokens_per_node:,} tokens/node")


def plan_memory(model: ModelSpec, cluster: ClusterSpec, lat: LatencyModel, settings: MemorySettings, *,
                page_tokens: int, can_stream_weights: bool, uses_host_kv: bool, policy_name: str,
                batch_shape: BatchShape | None = None, max_context: int = 0,
                streamed_layers: int | None = None, prefill_ring: float = 0.0) -> MemoryBudget:
    """The job's memory budget. `batch_shape` (with the workload's longest sequence, `max_context`) sizes the
    activations; without it only the fixed reserve counts. `streamed_layers`: how many MoE layers' experts
    stream from host (a plan's choice; 0 = all resident); None streams every MoE layer when the weights do not
    fit otherwise, else none. `prefill_ring`: device bytes kept for the experts a data-parallel prefill streams
    (`prefill_ring_bytes`)."""
    gb = 1e9
    gpu = cluster.gpu
    act = activation_bytes(model, batch_shape, max_context) if batch_shape is not None else 0.0
    staging = staging_bytes(model, batch_shape.staging_seqs, max_context) if batch_shape is not None else 0.0
    usable = gpu.hbm_bytes * settings.gpu_memory_fraction - settings.activation_reserve_gb * gb - act - prefill_ring
    weights = lat.weight_bytes_per_rank()
    page_bytes = page_tokens * model.kv_bytes_per_token
    host_usable = cluster.host_mem_bytes_per_node * settings.host_memory_fraction
    host_weights = host_weight_bytes(model, lat, cluster.node_size)
    streamed, whole_layers = 0.0, False
    n_moe = model.num_moe_layers
    if streamed_layers is not None and not 0 <= streamed_layers <= n_moe:
        raise ConfigError(f"streamed_layers must be within 0..{n_moe} (MoE layers of {model.name}), "
                          f"got {streamed_layers}")
    if streamed_layers is None:
        streamed_layers = n_moe if weights + page_bytes > usable and model.is_moe else 0
    if weights + page_bytes > usable or streamed_layers:
        if host_weights > host_usable:
            raise ConfigError(
                f"{model.name}'s weights fit nowhere: {weights / gb:.1f} GB per GPU exceed the usable "
                f"{usable / gb:.1f} GB of a {gpu.name}, and a node's share ({host_weights / gb:.0f} GB) exceeds "
                f"its usable host memory ({host_usable / gb:.0f} GB): add GPUs (cluster.num_gpus) or host "
                "memory (cluster.host_mem_gb_per_node)")
        resident, streamed_bytes, whole_layers = weight_layout(
            model, lat, streamed_layers, usable - page_bytes if can_stream_weights else -1.0)
        fits_streaming = model.is_moe and resident + page_bytes <= usable
        if not can_stream_weights or not fits_streaming:
            need = resident if can_stream_weights else weights
            if act and need + page_bytes <= usable + act:  # they would fit but for the activations
                raise ConfigError(_activations_exceed(model, gpu, settings, policy_name, batch_shape, act,
                                                      usable + act, need, max_context))
            if model.is_moe:
                how = ("spread the experts over more GPUs (cluster.num_gpus, and cluster.gpus_per_instance if "
                       "it is set), use a GPU with more memory"
                       + (", or +policy=coroutine, which streams expert weights from host memory"
                          if fits_streaming and not can_stream_weights else ""))
            else:
                how = ("a dense model runs one whole replica per GPU (tensor parallelism is not modelled "
                       "yet): use a GPU with more memory or a smaller model")
            if act:
                how += f" (activations of the policy's batch shape take {act / gb:.1f} GB: smaller batches free it)"
            if prefill_ring:
                how += (f" (data-parallel prefill keeps {prefill_ring / gb:.1f} GB for the experts it streams: "
                        "policy.prefill_parallel=ep frees it)")
            left = (f"only {usable / gb:.1f} GB of its {gpu.hbm_bytes / gb:.1f} GB are usable" if usable > 0 else
                    f"none of its {gpu.hbm_bytes / gb:.1f} GB is left for them (the memory fraction's margin, the "
                    f"reserve and the activations take {(gpu.hbm_bytes - usable) / gb:.1f} GB)")
            raise ConfigError(
                f"{model.name} needs {weights / gb:.1f} GB of weights per GPU on {cluster.instance_size}-GPU "
                f"instances of {gpu.name}, but {left} (policy {policy_name}): {how}")
        streamed, weights = streamed_bytes, resident
    pages = int((usable - weights) // page_bytes)
    host_kv = 0
    if uses_host_kv:
        host_kv = int(max(host_usable - host_weights, 0) // model.kv_bytes_per_token)
        if host_kv < page_tokens:
            raise ConfigError(f"no host memory left for KV on a node: {host_weights / gb:.0f} GB of weights vs "
                              f"{host_usable / gb:.0f} GB usable; raise cluster.host_mem_gb_per_node")
    return MemoryBudget(weights, streamed, pages, host_kv, page_tokens, act, staging, streamed_layers,
                        whole_layers=whole_layers, prefill_ring_bytes=prefill_ring)


def prefill_stream_bytes_per_layer(model: ModelSpec, lat: LatencyModel) -> float:
    """Bytes of one MoE layer's routed experts that a rank does not hold (it holds ceil(E / ranks)): what its
    data-parallel prefill copies from host for every MoE layer of every forward."""
    if not model.is_moe or lat.ep_ranks == 1:
        return 0.0
    held = -(-model.num_experts // lat.ep_ranks)
    return float((model.num_experts - held) * model.expert_params * model.weight_bytes)


def dp_prefill_copy(model: ModelSpec, lat: LatencyModel, streamed_bytes_per_iter: float) -> tuple[float, float | None]:
    """(bytes, seconds per MoE layer) of what one rank copies from host in a data-parallel prefill forward: every
    MoE layer's experts it does not hold, and the decode weights that stream anyway
    (`MemoryBudget.streamed_bytes_per_iter`); (0, None) where data parallel is expert parallel (a dense model, one
    rank per instance). One account for the simulator and the planner's prediction."""
    if not model.is_moe or lat.ep_ranks == 1:
        return 0.0, None
    n_moe = model.num_moe_layers
    copied = n_moe * prefill_stream_bytes_per_layer(model, lat) + streamed_bytes_per_iter
    return copied, float(lat.h2d(copied / n_moe))


def prefill_ring_bytes(model: ModelSpec, lat: LatencyModel, policy) -> float:
    """Device bytes a policy's data-parallel prefill (`prefill_parallel=dp`) keeps for the experts it streams: two
    MoE layers' worth, one computing while the next loads (as the ring of streamed decode weights); 0 otherwise."""
    if getattr(policy, "prefill_parallel", "ep") != "dp":
        return 0.0
    return 2.0 * prefill_stream_bytes_per_layer(model, lat)


def _activations_exceed(model, gpu, settings, policy_name, shape, act, room, weights, max_context) -> str:
    """The weights would fit but the batch shape's activations leave no room: say so, not "weights don't fit"."""
    gb = 1e9
    forward = (f"{shape.prefill_tokens:,} prompt tokens per prefill forward"
               if shape.prefill_tokens >= shape.gate_tokens
               else f"{shape.gate_tokens:,} tokens at the gate per decode forward")
    return (f"the activations of policy {policy_name}'s batch shape ({forward}, sequences of up to "
            f"{max_context:,} tokens) take {act / gb:.1f} GB per GPU: with {model.name}'s {weights / gb:.1f} GB of "
            f"weights per GPU they exceed the {room / gb:.1f} GB usable on a {gpu.name} ({gpu.hbm_bytes / gb:.1f} GB"
            f" x memory.gpu_memory_fraction={settings.gpu_memory_fraction} less memory.activation_reserve_gb="
            f"{settings.activation_reserve_gb}): shorten the longest sequences (workload.max_input / "
            "workload.max_output) or give the policy smaller batches")


def weight_layout(model: ModelSpec, lat: LatencyModel, streamed_layers: int, room: float) -> tuple[float, float, bool]:
    """(resident bytes, bytes streamed per iteration, whole layers) of one rank whose `streamed_layers` MoE layers'
    experts stream from host through a ring of two layers (two slots: one computes while the next one loads).
    Where even streaming every MoE layer's experts leaves more resident than `room` bytes but streaming every
    decoder layer whole fits it (DeepSeek-V2 on a 24 GB GPU: its attention and shared experts alone exceed an
    A5000), every layer streams whole. One account for the memory budget and the planner."""
    weights = lat.weight_bytes_per_rank()
    n_moe = model.num_moe_layers
    per_layer = (weights - _non_expert_bytes(model, lat)) / max(n_moe, 1)
    resident = weights - streamed_layers * per_layer + min(2, streamed_layers) * per_layer
    if resident > room and model.is_moe and streamed_layers == n_moe:
        whole_resident, whole_streamed = whole_layer_streaming(model, lat)
        if whole_resident <= room:
            return whole_resident, whole_streamed, True
    return resident, streamed_layers * per_layer, False


def whole_layer_streaming(model: ModelSpec, lat: LatencyModel) -> tuple[float, float]:
    """(resident bytes, streamed bytes per iteration) of one rank when every decoder layer's weights stream
    from host through a ring of two layers: embeddings and LM head stay resident, with two slots each as large
    as the largest layer, as the executor allocates them (batchgen.exec.weight_stream; a decision: the
    paper's memory-limited rig runs DeepSeek-V2, whose attention and shared experts alone exceed an A5000)."""
    weights = lat.weight_bytes_per_rank()
    resident = model.embedding_params * model.weight_bytes
    layers = weights - resident
    n_dense, n_moe = model.num_layers - model.num_moe_layers, model.num_moe_layers
    dense = (model.attention_params_per_layer + model.dense_ffn_params) * model.weight_bytes if n_dense else 0.0
    moe = (layers - n_dense * dense) / n_moe if n_moe else 0.0
    largest = max(dense, moe, layers / max(model.num_layers, 1))
    return resident + min(2, model.num_layers) * largest, layers


def group_budget(budget: MemoryBudget, lat: LatencyModel) -> MemoryBudget:
    """The budget as the scheduler sees it when each of its ranks is a TP-attention group (`lat.attention_tp`
    > 1, batchgen.latency.tp_attention): KV pages per group, not per GPU. MLA replicates the latent on every GPU
    of the group, so the group holds one GPU's pool once (not degree times); GQA splits each token's K/V over
    the group, so it holds degree pools' worth of whole tokens."""
    degree = getattr(lat, "attention_tp", 1)
    if degree <= 1:
        return budget
    import dataclasses

    return dataclasses.replace(budget, kv_pages_per_gpu=int(lat.kv_pages_per_group(budget.kv_pages_per_gpu)),
                               attention_tp=int(degree))


def host_weight_bytes(model: ModelSpec, lat: LatencyModel, node_size: int) -> float:
    """Weights one node keeps in host memory, the source of truth of its GPUs' weights: what every rank
    replicates (attention, dense layers, embeddings, shared experts, routers) once, and the distinct expert
    shards its GPUs hold (node_size shards when an instance spans the node; every expert once when several
    instances, or replicas, share it)."""
    lat = getattr(lat, "base", lat)  # a TP-attention group's GPUs share the node's one copy of the full weights
    non_expert = _non_expert_bytes(model, lat)
    shards = min(node_size, lat.ep_ranks) if model.is_moe else 0
    return non_expert + shards * (lat.weight_bytes_per_rank() - non_expert)


def _non_expert_bytes(model: ModelSpec, lat: LatencyModel) -> float:
    if not model.is_moe:
        return lat.weight_bytes_per_rank()
    per_rank = -(-model.num_experts // lat.ep_ranks)
    return lat.weight_bytes_per_rank() - model.num_moe_layers * per_rank * model.expert_params * model.weight_bytes


def check_prompts_fit(model: ModelSpec, input_lens: np.ndarray, output_lens: np.ndarray,
                      budget: MemoryBudget, uses_host_kv: bool, host_resident: bool = False,
                      pool_fix: str = "clip the workload or use a GPU with more memory",
                      host_fix: str = "raise cluster.host_mem_gb_per_node or memory.host_memory_fraction") -> None:
    """A sequence longer than the model's context, or than one GPU's KV pool (`pool_fix`: what to change), or
    than a node's host KV (`host_fix`), can never run. With `host_resident` decode (its KV restored per layer into
    staging buffers sized for the longest sequence) a sequence need not fit the device KV pool, only host
    memory."""
    total = input_lens + output_lens
    worst = int(np.argmax(total))
    if total[worst] > model.max_context:
        raise ConfigError(
            f"sequence {worst} needs {int(total[worst]):,} tokens (input {int(input_lens[worst]):,} + output "
            f"{int(output_lens[worst]):,}) but {model.name} allows {model.max_context:,}: clip the workload "
            "(workload.max_input / workload.max_output) or pick a model with a longer context")
    fit = budget.kv_pages_per_gpu * budget.page_tokens
    if not host_resident and total[worst] + budget.page_tokens > fit:
        raise ConfigError(f"sequence {worst} needs {int(total[worst]):,} tokens of KV but one GPU holds "
                          f"{fit:,}: {pool_fix}")
    host = budget.host_kv_tokens_per_node
    if uses_host_kv and total[worst] + budget.page_tokens > host:
        raise ConfigError(f"sequence {worst} needs {int(total[worst]):,} tokens of KV but a node's host memory "
                          f"holds {host:,} after the weights: {host_fix}")
