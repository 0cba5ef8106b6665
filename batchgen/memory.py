"""How much KV fits where: the memory budget of a job, checked before any work starts.

Device: usable HBM = hbm * gpu_memory_fraction - activation reserve; the rest after this rank's resident
weights is the paged KV pool. A policy that may stream weights (coroutine) keeps only the non-expert weights
resident when everything does not fit, plus a ring buffer of two MoE layers' experts, and pays a PCIe copy of
its experts every iteration. Host: each node keeps a copy of its GPUs' weights (the source of truth) and the
rest, up to host_memory_fraction, holds KV.
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
    gpu_memory_fraction: float = 0.9     # of HBM the engine may use (the rest: CUDA context, fragmentation)
    activation_reserve_gb: float = 2.0   # per GPU, for activations and communication buffers
    host_memory_fraction: float = 0.9    # of each node's host memory the engine may use

    def __post_init__(self):
        for name in ("gpu_memory_fraction", "host_memory_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"memory.{name} must be in (0, 1], got {v}")
        if self.activation_reserve_gb < 0:
            raise ConfigError(f"memory.activation_reserve_gb must be >= 0, got {self.activation_reserve_gb}")


@dataclass(frozen=True)
class MemoryBudget:
    weights_per_gpu_bytes: float     # resident on each GPU
    streamed_bytes_per_iter: float   # weights copied host -> GPU every iteration (0 if all resident)
    kv_pages_per_gpu: int
    host_kv_tokens_per_node: int
    page_tokens: int

    def describe(self, model: ModelSpec) -> str:
        gb = 1e9
        kv_tok = self.kv_pages_per_gpu * self.page_tokens
        return (f"weights {self.weights_per_gpu_bytes / gb:.1f} GB/GPU resident"
                + (f" (+{self.streamed_bytes_per_iter / gb:.1f} GB streamed per iteration)"
                   if self.streamed_bytes_per_iter else "")
                + f", KV {kv_tok:,} tokens/GPU ({kv_tok * model.kv_bytes_per_token / gb:.1f} GB)"
                + f", host KV {self.host_kv_tokens_per_node:,} tokens/node")


def plan_memory(model: ModelSpec, cluster: ClusterSpec, lat: LatencyModel, settings: MemorySettings, *,
                page_tokens: int, can_stream_weights: bool, uses_host_kv: bool, policy_name: str) -> MemoryBudget:
    gb = 1e9
    gpu = cluster.gpu
    usable = gpu.hbm_bytes * settings.gpu_memory_fraction - settings.activation_reserve_gb * gb
    weights = lat.weight_bytes_per_rank()
    page_bytes = page_tokens * model.kv_bytes_per_token
    host_usable = cluster.host_mem_bytes_per_node * settings.host_memory_fraction
    host_weights = weights * cluster.node_size
    streamed = 0.0
    if weights + page_bytes > usable:
        if host_weights > host_usable:
            raise ConfigError(
                f"{model.name}'s weights fit nowhere: {weights / gb:.1f} GB per GPU exceed the usable "
                f"{usable / gb:.1f} GB of a {gpu.name}, and a node's share ({host_weights / gb:.0f} GB) exceeds "
                f"its usable host memory ({host_usable / gb:.0f} GB): add GPUs (cluster.num_gpus) or host "
                "memory (cluster.host_mem_gb_per_node)")
        experts = weights - _non_expert_bytes(model, lat)
        ring = 2 * experts / max(model.num_moe_layers, 1)
        resident = weights - experts + ring
        fits_streaming = model.is_moe and resident + page_bytes <= usable
        if not can_stream_weights or not fits_streaming:
            if model.is_moe:
                how = ("spread the experts over more GPUs (cluster.num_gpus, and cluster.gpus_per_instance if "
                       "it is set), use a GPU with more memory"
                       + (", or +policy=coroutine, which streams expert weights from host memory"
                          if fits_streaming and not can_stream_weights else ""))
            else:
                how = ("a dense model runs one whole replica per GPU (tensor parallelism is not modelled "
                       "yet): use a GPU with more memory or a smaller model")
            raise ConfigError(
                f"{model.name} needs {weights / gb:.1f} GB of weights per GPU on {cluster.instance_size}-GPU "
                f"instances of {gpu.name}, but only {usable / gb:.1f} GB of its {gpu.hbm_gb:g} GB are usable "
                f"(policy {policy_name}): {how}")
        streamed, weights = experts - ring, resident
    pages = int((usable - weights) // page_bytes)
    host_kv = 0
    if uses_host_kv:
        host_kv = int(max(host_usable - host_weights, 0) // model.kv_bytes_per_token)
        if host_kv < page_tokens:
            raise ConfigError(f"no host memory left for KV on a node: {host_weights / gb:.0f} GB of weights vs "
                              f"{host_usable / gb:.0f} GB usable; raise cluster.host_mem_gb_per_node")
    return MemoryBudget(weights, streamed, pages, host_kv, page_tokens)


def _non_expert_bytes(model: ModelSpec, lat: LatencyModel) -> float:
    if not model.is_moe:
        return lat.weight_bytes_per_rank()
    per_rank = -(-model.num_experts // lat.ep_ranks)
    return lat.weight_bytes_per_rank() - model.num_moe_layers * per_rank * model.expert_params * model.weight_bytes


def check_prompts_fit(model: ModelSpec, input_lens: np.ndarray, output_lens: np.ndarray,
                      budget: MemoryBudget, uses_host_kv: bool) -> None:
    """A sequence longer than the model's context, or than one GPU's KV pool, can never run."""
    total = input_lens + output_lens
    worst = int(np.argmax(total))
    if total[worst] > model.max_context:
        raise ConfigError(
            f"sequence {worst} needs {int(total[worst]):,} tokens (input {int(input_lens[worst]):,} + output "
            f"{int(output_lens[worst]):,}) but {model.name} allows {model.max_context:,}: clip the workload "
            "(workload.max_input / workload.max_output) or pick a model with a longer context")
    fit = budget.kv_pages_per_gpu * budget.page_tokens
    if total[worst] + budget.page_tokens > fit:
        raise ConfigError(f"sequence {worst} needs {int(total[worst]):,} tokens of KV but one GPU holds "
                          f"{fit:,}: clip the workload or use a GPU with more memory")
    host = budget.host_kv_tokens_per_node
    if uses_host_kv and total[worst] + budget.page_tokens > host:
        raise ConfigError(f"sequence {worst} needs {int(total[worst]):,} tokens of KV but a node's host memory "
                          f"holds {host:,} after the weights: raise cluster.host_mem_gb_per_node or "
                          "memory.host_memory_fraction")
