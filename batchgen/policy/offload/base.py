"""What the three offloading policies share: knobs resolved by their own search, a batch shape, the decision."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.memory import BatchShape
from batchgen.policy.base import Decision, Forecast, PolicyDefaults, Snapshot
from batchgen.policy.offload.block import BlockPlan, block_repeats, decide_block

AUTO = "auto"


def whole(value, key: str, allow_auto: bool = True) -> None:
    if value == AUTO and allow_auto:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"policy.{key} must be a whole number >= 1" + (" or auto (its own search)" if allow_auto
                                                                        else "") + f", got {value!r}")


@dataclass(frozen=True)
class OffloadPolicy(PolicyDefaults):
    """Subclasses define `block_plan` (their knobs as a schedule, with documented fallbacks for an unresolved
    auto) and `candidates` (their search space)."""

    max_prompt: int | str = "auto"  # longest prompt of the job, set by the search (sizes one micro-batch's prefill)
    name: str = "offload"
    can_stream_weights: bool = True
    uses_host_kv: bool = True

    def block_plan(self) -> BlockPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    def candidates(self, rig):  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def ffn_schedule(self) -> str:
        """The schedule of every decision (`decide_block`): the system's, whatever its knobs."""
        return self.block_plan().ffn_schedule

    def batch_shape(self, max_context: int) -> BatchShape:
        """One micro-batch's activations (prefill: its prompts; decode: its tokens at the FFN), and with host KV
        attended on the GPU its two staging buffers. The block's other micro-batches wait elsewhere."""
        p = self.block_plan()
        mb = p.micro_batch or p.block
        prompt = self.max_prompt if self.max_prompt != AUTO else max_context
        staged = p.kv_on_host and not p.cpu_attention
        return BatchShape(gate_tokens=mb, attn_seqs=mb, prefill_tokens=mb * int(prompt),
                          staging_seqs=mb if staged else 0)

    def decide(self, snap: Snapshot) -> Decision:
        return decide_block(snap, self.block_plan())

    def repeats(self, snap: Snapshot, decision: Decision, forecast: Forecast) -> int:
        """A block decodes unchanged until it drains or a row must be shed (`block.block_repeats`)."""
        return block_repeats(snap, forecast)

    def resolve_for_job(self, rig):
        """This policy with its auto knobs chosen by its own search over the job (`search.search`)."""
        from batchgen.policy.offload.search import search

        best = search(rig, [dataclasses.replace(c, max_prompt=rig.max_input) for c in self.candidates(rig)],
                       f"policy {self.name}")
        return best
