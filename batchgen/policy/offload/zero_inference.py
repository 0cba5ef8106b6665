"""DeepSpeed ZeRO-Inference as a policy: every layer's weights streamed to the GPU with prefetch (the next
layer's while this one computes), the whole batch through each layer at once.

The KV cache stays on the GPU (DeepSpeed's KV offload, `--kv-offload` with attention computed on the CPU, exists
only for its OPT and BLOOM model code; `kv_offload: true` turns it on here for any GQA model), so the batch is
bounded by device memory: the largest batch that fits is the one its users tune to. Kept and simplified: see
conf/policy/zero_inference.yaml.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.memory import ConfigError
from batchgen.policy.offload.base import AUTO, OffloadPolicy, whole
from batchgen.policy.offload.block import BlockPlan

BATCHES = tuple(1 << k for k in range(0, 13))  # 1 .. 4096
FALLBACK_BATCH = 16


@dataclass(frozen=True)
class ZeroInferencePolicy(OffloadPolicy):
    batch_size: int | str = "auto"
    kv_offload: bool = False
    name: str = "zero_inference"

    def __post_init__(self):
        whole(self.batch_size, "batch_size")
        if not isinstance(self.kv_offload, bool):
            raise ValueError(f"policy.kv_offload must be true or false, got {self.kv_offload!r}")

    def block_plan(self) -> BlockPlan:
        batch = FALLBACK_BATCH if self.batch_size == AUTO else self.batch_size
        return BlockPlan(batch, 0, self.kv_offload, self.kv_offload, "micro_batch")

    def candidates(self, rig):
        if self.kv_offload and not rig.cpu_attention_ok:
            raise ConfigError(f"policy.kv_offload=true is not offered for {rig.model.name}: its attention runs on "
                              "the CPU beside the offloaded KV, which needs GQA/MHA attention; use kv_offload=false")
        sizes = [b for b in BATCHES if b <= rig.per_rank] + [rig.per_rank]
        for batch in (sorted(set(sizes)) if self.batch_size == AUTO else (self.batch_size,)):
            yield dataclasses.replace(self, batch_size=batch)
