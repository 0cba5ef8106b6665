"""The offloading systems' own policy searches, priced with batchgen's latency model and memory budget.

Each system enumerates its schedule's knobs (FlexGen: GPU batch size x number of GPU batches x KV placement x
CPU delegation; MoE-Lightning: micro-batch size x number of micro-batches; ZeRO-Inference: the batch size) and
keeps the candidate of highest predicted throughput that fits memory. What a candidate is worth is predicted the
way the simulator will price it: the device budget of `plan_memory` for its batch shape (the weight ring, the
activations of one micro-batch, staging buffers), device pages for the whole block's KV at the workload's longest
sequence when KV stays on the GPU (these systems reserve prompt + generation length up front), host memory for
it otherwise; one decode iteration at the typical context on `batchgen.pricing.microbatch`'s DAG, and the block's
prefill with the layer weights streamed once (`batchgen.pricing.price.price`). Throughput = block x mean output /
(prefill + mean output x iteration). This stands in for FlexGen's LP over its cost model and MoE-Lightning's
hierarchical roofline: the same terms (weight, KV and activation transfers, CPU and GPU compute per layer,
memory constraints), computed by one model here so that the search agrees with the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from batchgen.memory import ConfigError, plan_memory
from batchgen.plan.decode import DecodeGrid
from batchgen.pricing.costs import prefill_load
from batchgen.pricing.price import price
from batchgen.pricing.microbatch import price_microbatched

TIE = 0.01
POW2 = tuple(1 << k for k in range(0, 11))          # micro-batch sizes 1 .. 1024
COUNTS = tuple(1 << k for k in range(0, 7))         # micro-batches per block 1 .. 64


@dataclass(frozen=True)
class Rig:
    """What a search sees of the job: the model, the cluster, the latency model, and the workload's shape."""

    model: Any
    cluster: Any
    lat: Any
    memory: Any
    page_tokens: int
    num_sequences: int
    mean_input: float
    max_input: int
    mean_output: float
    max_context: int

    @classmethod
    def of(cls, model, cluster, lat, memory, workload, page_tokens: int) -> "Rig":
        inp, out = np.asarray(workload.input_lens), np.asarray(workload.output_lens)
        return cls(model, cluster, lat, memory, page_tokens, int(inp.size), float(inp.mean()), int(inp.max()),
                   float(out.mean()), int((inp + out).max()))

    @property
    def typical_context(self) -> float:
        return self.mean_input + self.mean_output / 2

    @property
    def per_rank(self) -> int:
        """Sequences each rank sees over the job: a block larger than that only pads the search."""
        return max(1, math.ceil(self.num_sequences / self.cluster.num_gpus))

    @property
    def cpu_attention_ok(self) -> bool:
        return self.model.attention != "mla" and self.cluster.gpu.kind != "cpu"


@dataclass(frozen=True)
class Scored:
    policy: Any
    tokens_per_s: float
    iteration_s: float
    prefill_s: float


def score(rig: Rig, policy, memo: dict | None = None) -> Scored | None:
    """The candidate's predicted decode-and-prefill throughput per instance, or None if it does not fit.
    `memo`: prices already computed in this search, keyed by everything they read (candidates that differ only
    in what the price does not read share it: FlexGen's KV placements of one block shape, for instance)."""
    plan = policy.block_plan()
    m, c, lat, P = rig.model, rig.cluster, rig.lat, rig.page_tokens
    try:
        budget = plan_memory(m, c, lat, rig.memory, page_tokens=P, can_stream_weights=True, uses_host_kv=True,
                             policy_name=policy.name, batch_shape=policy.batch_shape(rig.max_context),
                             max_context=rig.max_context)
    except ConfigError:
        return None
    n = plan.block
    if plan.kv_on_host:
        if n * c.node_size * (rig.max_context + P) > budget.host_kv_tokens_per_node:
            return None
    elif n * math.ceil((rig.max_context + P) / P) > budget.kv_pages_per_gpu:
        return None
    R = lat.ep_ranks
    one = lambda v: np.full((1, 1), float(v))  # noqa: E731
    ctx = rig.typical_context
    if plan.kv_on_host:
        grid = DecodeGrid(one(0), one(0), one(0), one(n), one(n * ctx), one(n))
    else:
        grid = DecodeGrid(one(n), one(n * ctx), one(1), one(0), one(0), one(n))
    n_moe = max(lat.layer_counts()[1], 1)
    memo = {} if memo is None else memo
    cpu_attention, pipelined = plan.kv_on_host and plan.cpu_attention, plan.ffn_schedule == "pipelined"
    prefetch = budget.streamed_bytes_per_iter / n_moe
    key = ("decode", plan.kv_on_host, n, ctx, plan.micro_batch, cpu_attention, pipelined, prefetch, R)
    if key not in memo:
        price_d, _ = price_microbatched(lat, grid, plan.micro_batch, cpu_attention=cpu_attention,
                                        pipelined=pipelined, prefetch_bytes=prefetch, replicas=R)
        memo[key] = float(price_d.iteration_s[0])
    iteration = memo[key]
    stream_s = float(lat.h2d(budget.streamed_bytes_per_iter)) if budget.streamed_bytes_per_iter else 0.0
    key = ("prefill", n, plan.micro_batch, stream_s)
    if key not in memo:
        memo[key] = _prefill_s(rig, n, plan.micro_batch, stream_s)
    prefill_s = memo[key]
    total = prefill_s + rig.mean_output * iteration
    return Scored(policy, n * R * rig.mean_output / total if total > 0 else 0.0, iteration, prefill_s)


def _prefill_s(rig: Rig, n: int, micro_batch: int, stream_s: float) -> float:
    """A block of n typical prompts prefilled, the layer weights streamed once."""

    empty = np.empty(0, np.int64)
    load = prefill_load(np.zeros(n, np.int64), np.full(n, int(round(rig.mean_input))), empty, empty, 1, micro_batch)
    return price(rig.lat, load, stream_s).compute_s


def search(rig: Rig, candidates: Iterable, what: str):
    """The fastest fitting candidate (among those within TIE of it, the smallest block); ConfigError if none."""
    memo: dict = {}
    scored = [s for s in (score(rig, p, memo) for p in candidates) if s is not None]
    if not scored:
        raise ConfigError(f"{what}: no schedule fits {rig.model.name} on {rig.cluster.gpu.name} (every block of "
                          "its search exceeds device or host memory): give it a GPU with more memory, more host "
                          "memory, or smaller explicit batches")
    top = max(s.tokens_per_s for s in scored)
    near = [s for s in scored if s.tokens_per_s >= top * (1 - TIE)]
    return min(near, key=lambda s: (s.policy.block_plan().block, s.policy.block_plan().micro_batch)).policy
