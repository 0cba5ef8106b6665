"""The offloading systems the BatchGen paper compares against on its memory-limited rig (one GPU, weights and
KV in host memory), each as a policy behind the same interface: `flexgen`, `moe_lightning`, `zero_inference`.

All three run static blocks (a block of sequences per rank is prefilled, then decoded until it drains, then the
next block), stream every layer's weights through a ring of two layers (loaded once per layer and reused by the
block's micro-batches), and run each attention micro-batch's FFN on its own: their expert batch is a micro-batch,
bounded by GPU memory, where coroutine's is every running sequence, bounded by host memory. They differ in
where KV and attention live, whether CPU and GPU work overlap, and how their own search sizes the block.
"""

from batchgen.policy.offload.flexgen import FlexGenPolicy
from batchgen.policy.offload.moe_lightning import MoELightningPolicy
from batchgen.policy.offload.zero_inference import ZeroInferencePolicy

__all__ = ["FlexGenPolicy", "MoELightningPolicy", "ZeroInferencePolicy"]
