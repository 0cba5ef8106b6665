"""The latency-model interface: what the simulator, the memory planner and the static planner ask of a model of
time. Two implementations: `Roofline` (data-sheet peaks scaled by fitted per-module efficiencies) and
`TablePredictor` (interpolates a device's measured calibration points, the roofline filling any gaps).

Every method broadcasts numpy arrays and returns seconds (a float for scalar inputs): the simulator prices a
(ranks x iterations) grid at once. Unless a method says otherwise, a cost is for ONE layer on ONE rank.
Attention takes the longest context as well as the sum, because padded kernels (the CPU executor's, and any
dense-batch kernel) cost queries x longest context however short the others are; `max_context=None` means
"unknown": the cost then follows the sum alone.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from batchgen.specs import HardwareSpec, ModelSpec
from batchgen.specs.host import HostSpec


@runtime_checkable
class LatencyModel(Protocol):
    model: ModelSpec
    gpu: HardwareSpec
    host: HostSpec
    ep_ranks: int
    gpus_per_node: int
    host_link_bw: float   # achieved bytes/s of this GPU's host link (planner: how much host traffic fits)
    attention_padding: float  # share of queries x longest context that attention pays (0: paged kernels); a
                              # simulator calls padded kernels on runs of similar contexts, as the executor does

    def key(self) -> tuple:
        """Hashable identity: two models with equal keys price everything alike (plan caches use it)."""

    # ---- compute modules ----
    def attention_decode(self, tokens, context_sum, micro_batches=1, max_context=None):
        """Decode attention of `tokens` queries (one per sequence) over `context_sum` context tokens, in
        `micro_batches` launches; `max_context`: the longest of those contexts."""

    def attention_prefix(self, pairs, kv_tokens, calls):
        """Cascade attention's prefix kernels: `calls` calls whose queries attend `pairs` query-key pairs of shared
        prefixes, each reading its prefix's KV once (`kv_tokens` in all). Their own pages are `attention_decode`'s."""

    def attention_prefill(self, tokens, context_sq_sum, micro_batches=1, max_context=None, sequences=None):
        """Prefill attention over `tokens` prompt tokens of `sequences` prompts whose squared lengths sum to
        `context_sq_sum`; `max_context`: the longest prompt."""

    def head_shard(self, degree: int) -> "LatencyModel":
        """The same GPU computing 1/degree of every attention head (a PARTITIONed sequence's shard); see
        batchgen.latency.tp_attention.partition_attention_decode."""

    def dense_ffn(self, tokens): ...
    def shared_experts(self, tokens): ...
    def router(self, tokens): ...

    def experts(self, total_tokens):
        """(slowest rank, mean rank) seconds of the routed experts for `total_tokens` at the instance's gate."""

    def local_experts(self, tokens):
        """Seconds of the routed experts for `tokens` of one rank's own gate with every expert on that GPU (a
        data-parallel prefill streams in the experts the rank does not hold)."""

    def expert_batch_per_expert(self, total_tokens): ...

    def lm_head(self, tokens):
        """Final projection and sampling, once per forward (not per layer)."""

    def step_overhead(self, sequences):
        """Seconds per forward outside the modules (embedding, batch metadata, sampling, bookkeeping) for a
        forward over `sequences` sequences; once per forward, not per layer (0 on a data-sheet roofline)."""

    def boundary_overhead(self, sequences):
        """Seconds the engine spends at one scheduling boundary (policy decision, KV bookkeeping) with
        `sequences` sequences in play (0 on a data-sheet roofline)."""

    # ---- communication and copies ----
    def all_to_all(self, total_tokens): ...
    def all_reduce(self, nbytes, peers): ...
    def h2d(self, nbytes, copies=1): ...
    def d2h(self, nbytes, copies=1): ...
    def network(self, nbytes, cross_node): ...
    def local_copy(self, nbytes): ...

    # ---- host-resident KV and CPU attention ----
    def kv_restore(self, context_sum, micro_batches=1): ...
    def kv_append(self, tokens, micro_batches=1): ...
    def cpu_attention(self, tokens, context_sum, micro_batches=1): ...
    def cpu_attention_ship(self, tokens, micro_batches=1): ...
    def cpu_attention_ship_bytes(self, tokens): ...

    # ---- shape ----
    def layer_counts(self) -> tuple[int, int]: ...
    def weight_bytes_per_rank(self) -> float: ...
