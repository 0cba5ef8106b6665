"""FlexGen (Sheng et al., ICML 2023) as a policy: a zig-zag block schedule with its placement from a search.

A block of num_gpu_batches micro-batches of gpu_batch_size sequences goes through one layer at a time: the
layer's weights are copied to the GPU once (the next layer's while this one computes) and reused by every
micro-batch of the block, each of which runs attention and then its own FFN. The KV cache lives on the GPU or
on the host (restored per layer and micro-batch, overlapped with compute), and with CPU delegation
(`cpu_cache_compute`) attention runs on the CPU beside the host KV while the GPU waits for it (FlexGen overlaps
I/O with compute, not CPU with GPU compute). Kept and simplified: see conf/policy/flexgen.yaml.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.memory import ConfigError
from batchgen.policy.offload.base import AUTO, OffloadPolicy, whole
from batchgen.policy.offload.block import BlockPlan
from batchgen.policy.offload.search import COUNTS, POW2

CACHE = ("gpu", "cpu", "auto")
FALLBACK = {"gpu_batch_size": 8, "num_gpu_batches": 4, "cache_on": "cpu", "cpu_delegation": False}


@dataclass(frozen=True)
class FlexGenPolicy(OffloadPolicy):
    gpu_batch_size: int | str = "auto"
    num_gpu_batches: int | str = "auto"
    cache_on: str = "auto"
    cpu_delegation: bool | str = "auto"
    name: str = "flexgen"

    def __post_init__(self):
        whole(self.gpu_batch_size, "gpu_batch_size")
        whole(self.num_gpu_batches, "num_gpu_batches")
        if self.cache_on not in CACHE:
            raise ValueError(f"policy.cache_on must be one of {', '.join(CACHE)}, got {self.cache_on!r}")
        if self.cpu_delegation not in (True, False, AUTO):
            raise ValueError(f"policy.cpu_delegation must be true, false or auto, got {self.cpu_delegation!r}")

    def knob(self, key: str):
        value = getattr(self, key)
        return FALLBACK[key] if value == AUTO else value

    def block_plan(self) -> BlockPlan:
        gbs, ngb = self.knob("gpu_batch_size"), self.knob("num_gpu_batches")
        host = self.knob("cache_on") == "cpu"
        return BlockPlan(gbs * ngb, gbs, host, host and bool(self.knob("cpu_delegation")), "micro_batch")

    def candidates(self, rig):
        if self.cpu_delegation is True and not rig.cpu_attention_ok:
            raise ConfigError(f"policy.cpu_delegation=true is not offered for {rig.model.name} on "
                              f"{rig.cluster.gpu.name}: CPU attention needs GQA/MHA attention and a GPU beside the "
                              "CPU; use cpu_delegation=false or auto")
        pick = lambda key, auto: auto if getattr(self, key) == AUTO else (getattr(self, key),)  # noqa: E731
        for gbs in pick("gpu_batch_size", [b for b in POW2 if b <= rig.per_rank]):
            for ngb in pick("num_gpu_batches", [n for n in COUNTS if gbs * n <= 2 * rig.per_rank]):
                for cache in pick("cache_on", ("gpu", "cpu")):
                    delegations = ((False, True) if rig.cpu_attention_ok else (False,)) if cache == "cpu" else (False,)
                    for cpu in pick("cpu_delegation", delegations):
                        yield dataclasses.replace(self, gpu_batch_size=gbs, num_gpu_batches=ngb, cache_on=cache,
                                                  cpu_delegation=cpu)
