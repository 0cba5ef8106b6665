"""MoE-Lightning (Cao et al., ASPLOS 2025) as a policy: CPU attention beside host KV, experts on the GPU, and
CPU compute, GPU compute and transfers pipelined over micro-batches (CGOPipe); its policy from a roofline search.

Every layer's weights are paged from host to the GPU once per layer (the next layer's while this one computes)
and reused by every micro-batch; while the GPU runs the FFN of micro-batch i, the CPU attends micro-batch i + 1
over the host KV (queries and new KV go down, attention outputs come back). The whole block's KV lives on the
host. Kept and simplified: see conf/policy/moe_lightning.yaml.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.memory import ConfigError
from batchgen.policy.offload.base import AUTO, OffloadPolicy, whole
from batchgen.policy.offload.block import BlockPlan
from batchgen.policy.offload.search import COUNTS, POW2

ATTENTION = ("cpu", "gpu", "auto")
FALLBACK = {"micro_batch_size": 32, "num_micro_batches": 4, "attention": "cpu"}


@dataclass(frozen=True)
class MoELightningPolicy(OffloadPolicy):
    micro_batch_size: int | str = "auto"
    num_micro_batches: int | str = "auto"
    attention: str = "auto"
    name: str = "moe_lightning"

    def __post_init__(self):
        whole(self.micro_batch_size, "micro_batch_size")
        whole(self.num_micro_batches, "num_micro_batches")
        if self.attention not in ATTENTION:
            raise ValueError(f"policy.attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")

    def knob(self, key: str):
        value = getattr(self, key)
        return FALLBACK[key] if value == AUTO else value

    def block_plan(self) -> BlockPlan:
        mbs, n = self.knob("micro_batch_size"), self.knob("num_micro_batches")
        return BlockPlan(mbs * n, mbs, True, self.knob("attention") == "cpu", "pipelined")

    def candidates(self, rig):
        if self.attention == "cpu" and not rig.cpu_attention_ok:
            raise ConfigError(f"policy.attention=cpu is not offered for {rig.model.name}: its MLA latent KV must be "
                              "up-projected on the GPU; use policy.attention=gpu or auto")
        pick = lambda key, auto: auto if getattr(self, key) == AUTO else (getattr(self, key),)  # noqa: E731
        where = ("cpu", "gpu") if rig.cpu_attention_ok else ("gpu",)
        for mbs in pick("micro_batch_size", [b for b in POW2 if b <= rig.per_rank]):
            for n in pick("num_micro_batches", [k for k in COUNTS if mbs * k <= 2 * rig.per_rank]):
                for attention in pick("attention", where):
                    yield dataclasses.replace(self, micro_batch_size=mbs, num_micro_batches=n, attention=attention)
