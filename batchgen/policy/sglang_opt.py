"""The paper's tuned SGLang configuration (SGLang-Opt): `continuous` as SGLang runs it by default, with what
the paper says it tuned.

What it keeps from `continuous` (the same decisions, no code of its own): chunked prefill, SGLang's
conservative admission (new_token_ratio reserve), preemption by recompute, pinned data-parallel attention
ranks. SGLang's own defaults (batchgen.policy.engine_defaults): the chunked-prefill size picked from the GPU's
memory (`token_budget` auto), a rank's prefill batch of chunks alone while its decodes wait, the other ranks
decoding in the same forward (`mixed_chunks` false:
--enable-mixed-chunk is off by default), no two-batch overlap (`two_batch_overlap` false:
--enable-two-batch-overlap is off by default), a running cap derived from the KV pool (`max_running` 0, up to
`running_cap`, SGLang's largest request pool, 4096, which also sizes the activations). What the paper tuned
(PAPER_NOTES: 16 DP-attention ranks per group, memory fraction just below out-of-memory, CUDA graphs limited to
the sizes used):

- `gpu_memory_fraction`: replaces memory.gpu_memory_fraction for this job (the planner still subtracts the
  fixed reserve and the activations of the batch shape, so "just below OOM" is a fraction near 1);
- instances of 16 GPUs are the cluster's setting (cluster.gpus_per_instance=16), not the policy's.

`two_batch_overlap` true splits each forward in two micro-batches so one's all-to-all overlaps the other's
compute, priced by the simulator (batchgen.pricing.tbo), where it only hides communication (so it is off where
there is no all-to-all: a dense model or one GPU per instance, `batchgen.job.prepare`); the executors run
forwards whole and refuse it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from batchgen.core.cascade import cascade_mode
from batchgen.memory import BatchShape
from batchgen.policy.base import Decision, Snapshot
from batchgen.policy.continuous import ContinuousPolicy
from batchgen.policy.engine_defaults import kv_pool_running_cap, sglang_chunked_prefill_size


@dataclass(frozen=True)
class SGLangOptPolicy(ContinuousPolicy):
    max_running: int | str = 0           # 0 (or auto): derived from memory (the KV pool), at most running_cap
    admission: str = "conservative"
    running_cap: int = 4096
    gpu_memory_fraction: float = 0.97    # of HBM (replaces memory.gpu_memory_fraction); 0: keep memory's
    mixed_chunks: bool = False           # SGLang's --enable-mixed-chunk (off by default)
    two_batch_overlap: bool = False      # SGLang's --enable-two-batch-overlap (off by default)
    cascade_attention: str = "off"       # SGLang's default attention backends read every query's context whole
    name: str = "sglang_opt"

    def __post_init__(self):
        if self.max_running != "auto" and self.max_running < 0:
            raise ValueError(f"policy.max_running must be >= 0 (0: derived from memory), got {self.max_running}")
        if not self.max_running:  # the rest of continuous's checks, with a placeholder cap
            dataclasses.replace(self, max_running=1)
        else:
            super().__post_init__()
        object.__setattr__(self, "cascade_attention", cascade_mode(self.cascade_attention))
        if self.two_batch_overlap and self.cascade_attention != "off":
            raise ValueError("policy.two_batch_overlap splits each forward in two halves, which the cascade's price "
                             "does not follow: set policy.cascade_attention=off")
        if self.running_cap < 1:
            raise ValueError(f"policy.running_cap must be >= 1, got {self.running_cap}")
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError(f"policy.gpu_memory_fraction must be in [0, 1] (0: memory's), got "
                             f"{self.gpu_memory_fraction}")

    def engine_defaults(self, gpu) -> dict:
        """SGLang's own choices on `gpu`: the chunked-prefill size by device memory, the running cap from the KV
        pool (max_running 0)."""
        return {"max_running": 0, "token_budget": sglang_chunked_prefill_size(gpu)}

    def _capped(self, snap: Snapshot) -> ContinuousPolicy:
        """This policy with max_running set from the rank's KV pool: one page per sequence at least, so memory
        (the conservative admission's reserve) binds before the cap, as in a tuned SGLang."""
        if self.max_running:
            return self
        cap = kv_pool_running_cap(snap.pages_capacity, self.running_cap)
        capped = self._by_cap.get(cap)
        if capped is None:
            capped = self._by_cap[cap] = dataclasses.replace(self, max_running=cap)
        return capped

    @functools.cached_property
    def _by_cap(self) -> dict[int, ContinuousPolicy]:
        """The policy with its running cap fixed, per pool size: built once (decide runs at every forward; a
        cache keyed by the policy itself would hash every field at every call)."""
        return {}

    def decide(self, snap: Snapshot) -> Decision:
        capped = self._capped(snap)
        return ContinuousPolicy.decide(capped, snap)

    def batch_shape(self, max_context: int) -> BatchShape:
        if self.max_running:
            return super().batch_shape(max_context)
        return dataclasses.replace(self, max_running=self.running_cap).batch_shape(max_context)
