"""Data-parallel prefill over expert-parallel processes (`policy.prefill_parallel=dp`): in a forward that
prefills, each process runs its own tokens through every expert of each MoE layer, with no all-to-all.

Every process keeps a host copy of each MoE layer's routed experts (`ExpertParallelMoE(host_copy=True)`: the
whole layer it built before keeping its shard) and a ring of two slots on its device, each as large as one
layer's experts, shared by all its layers. A layer fills the next slot: the experts this process does not hold
are copied from the host copy (what the simulator prices: `batchgen.memory.prefill_stream_bytes_per_layer`
over the host link), the ones it holds from its own shard; then its tokens are routed and run through the slot
as one process would run the whole layer (`SparseMoE.experts`).

The copies are performed before the layer computes, not beside the previous one's compute, as the simulator
prices them (each layer the longer of the two): on a CPU the copy and the compute share the cores anyway."""

from __future__ import annotations

import torch

from batchgen.exec.models.moe import EXPERT_WEIGHTS, SparseMoE


class PrefillRing:
    """Two slots of one MoE layer's routed experts (`EXPERT_WEIGHTS` stacks, every expert), filled in turn.
    `active`: set by the runner for the forwards that prefill data parallel."""

    def __init__(self, like: SparseMoE, device: torch.device | str):
        self.slots = [{name: torch.empty(getattr(like, name).shape, dtype=getattr(like, name).dtype, device=device)
                       for name in EXPERT_WEIGHTS} for _ in range(2)]
        self.active = False
        self.copied_bytes = 0  # from host copies into the slots: the experts the processes did not hold
        self._next = 0

    def fill(self, host: dict[str, torch.Tensor], shard: SparseMoE, held: list[int]) -> dict[str, torch.Tensor]:
        """The next slot, holding every expert of a layer: `held` (global ids, in `shard`'s order) from the shard,
        the others from `host` (the layer's host copy, every expert)."""
        slot = self.slots[self._next]
        self._next = 1 - self._next
        where = {e: i for i, e in enumerate(held)}
        for name in EXPERT_WEIGHTS:
            into, own, copy = slot[name], getattr(shard, name), host[name]
            for e in range(into.shape[0]):
                if e in where:
                    into[e].copy_(own[where[e]])
                else:
                    into[e].copy_(copy[e], non_blocking=True)
                    self.copied_bytes += copy[e].numel() * copy[e].element_size()
        return slot


def host_copy(moe: SparseMoE) -> dict[str, torch.Tensor]:
    """A layer's routed experts kept in host memory: the built stacks themselves on a CPU, a pinned copy of them
    for a CUDA device."""
    out = {}
    for name in EXPERT_WEIGHTS:
        w = getattr(moe, name).detach()
        out[name] = w if w.device.type == "cpu" else w.to("cpu").pin_memory()
    return out
