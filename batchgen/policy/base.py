"""The one interface between scheduling policies and backends.

A policy sees a read-only `Snapshot` of one expert-parallel instance at a scheduling boundary and returns a
`Decision`. It imports neither simpy nor torch: the simulator and the executor build the same snapshot and
apply the same decision, so a policy tested here behaves the same at 128 simulated GPUs and on real ones.
Output lengths are not in the snapshot: like a real engine, a policy learns a sequence ended when it ends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

import numpy as np

EMPTY = np.empty(0, dtype=np.int64)

Stop = Literal["none", "first_finish", "rank_drains"]
Phase = Literal["prefill", "decode", "mixed", "idle"]  # mixed: one forward of prefill chunks and decodes


class PoolView(Protocol):
    """A FIFO pool of sequence ids, read-only."""

    def __len__(self) -> int: ...
    def peek(self, n: int) -> np.ndarray: ...


class PrefixView(Protocol):
    """The prefix cache as a policy may read it (batchgen.core.prefix_pages): which prompts share, and which
    prefixes its ranks hold, so that a prefill budget counts the tokens a forward computes, not those it takes."""

    def group(self, ids: np.ndarray) -> np.ndarray: ...         # each sequence's group (-1: none)
    def shared_tokens(self, ids: np.ndarray) -> np.ndarray: ...  # the prefix it would take or create (whole pages)
    def shared_span(self, ids: np.ndarray) -> np.ndarray: ...    # ... and the tokens of it past them it can take
    # each sequence's prefix levels, outermost first: (group, whole-page tokens) of its group's chain of nested
    # groups (batchgen.workload.prefix_tree); one level, its group's, where groups do not nest
    def levels(self, ids: np.ndarray) -> list[list[tuple[int, int]]]: ...
    # (rank, group) -> (whole-page tokens, tail tokens a taker copies) of a prefix there
    def on_ranks(self) -> dict[tuple[int, int], tuple[int, int]]: ...
    fetches: bool  # a rank without its group's prefix copies one another rank holds (batchgen.core.prefix_fetch)
    resumes_anywhere: bool  # a restore onto any rank of its node takes the prefix there (not only at home)
    # suspended sequences' home ranks (whose cache holds their host copy; -1: not this instance's) and the prefix
    # tokens each takes if restored there (0: none)
    def restore_shares(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    # host copies' tokens held in their node's host prefix, not their own (batchgen.core.host_prefixes)
    def host_held(self, ids: np.ndarray) -> np.ndarray: ...
    # the tokens new host copies of these sequences, made in this order on `nodes`, would take from their node's
    # host prefix instead of writing them
    def host_skips(self, ids: np.ndarray, nodes: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Lengths:
    """Per-sequence lengths a real engine knows: the prompt and what was generated so far."""

    input_len: np.ndarray
    decoded: np.ndarray

    def context(self, ids: np.ndarray) -> np.ndarray:
        return self.input_len[ids] + self.decoded[ids]

    @functools.cached_property
    def mean_input(self) -> float:
        """The batch's mean prompt length: prompts never change, and a policy with nothing running reads it at every
        boundary (over a million prompts, a mean costs most of a millisecond)."""
        return float(np.mean(self.input_len)) if self.input_len.size else 0.0


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by the backend (never guessed): policies plan within it."""

    # False where prefill KV must sit on the device for the whole forward (the exec backend today): a policy
    # then budgets KV pages for what it prefills. True in the simulator, which models layer-by-layer offload.
    layerwise_offload: bool = True
    # running sequences may be host-resident (KV restored per layer and micro-batch into a staging buffer)
    host_resident_decode: bool = True
    # attention of host-resident sequences may run on the host CPU beside their KV (GQA/MHA models only)
    cpu_attention: bool = True
    # how many ranks one sequence's attention can be PARTITIONed over: the head counts must divide evenly
    partition_degrees: tuple[int, ...] = (1, 2, 4, 8)
    # a padded decision (static batches) runs as Hugging Face `generate` does: prompts padded to the batch's
    # longest, finished rows kept computing until the batch drains. False (the executor): prompts unpadded and
    # finished rows dropped, the batch's slots still held until it drains. Decisions are the same either way.
    padded_batches: bool = True
    # every forward may run as two micro-batches (a policy's two_batch_overlap, SGLang's TBO)
    two_batch_overlap: bool = True
    # a rank may be a group of GPUs running attention tensor-parallel (a policy's attention_tp > 1)
    attention_tp: bool = True
    # an FFN per attention micro-batch, or pipelined against it (a policy's ffn_schedule other than combined)
    micro_batch_ffn: bool = True
    # each attention micro-batch's expert all-to-all sent while the next one computes (a policy's comm_overlap)
    comm_overlap: bool = True
    # forwards that prefill may run data parallel, streaming in the experts a rank does not hold (a policy's
    # prefill_parallel=dp)
    dp_prefill: bool = True
    # a node's host copies of one group's members hold its prompt prefix once (batchgen.core.host_prefixes)
    host_prefixes: bool = True
    # a shared prefix copied from a sibling GPU's instead of recomputed (batchgen.core.prefix_fetch)
    prefix_fetch: bool = True
    # a host copy resumed onto another GPU of its node takes the group's prefix there, copying only the rest
    # (batchgen.core.prefix_pages.attach_restored)
    resume_prefix: bool = True


@dataclass(frozen=True)
class Snapshot:
    now: float
    instance: int
    page_tokens: int
    gpus: np.ndarray               # global GPU index of each rank of this instance
    rank_node: np.ndarray          # node of each rank
    pages_capacity: np.ndarray     # KV pages per rank
    pages_used: np.ndarray
    pad_rows: np.ndarray           # finished rows still occupying a static batch, per rank
    # running sequences of this instance
    active_ids: np.ndarray
    active_rank: np.ndarray        # rank (0..R-1) of each running sequence
    active_context: np.ndarray
    active_decoded: np.ndarray
    active_pages: np.ndarray
    active_tp: np.ndarray
    active_host_resident: np.ndarray  # bool: running with KV on host (no pages), restored per layer
    # queues
    pending: PoolView              # not yet prefilled and not pinned (this instance)
    pinned: Sequence[PoolView]     # not yet prefilled, pinned to each rank
    suspended: Sequence[PoolView]  # prefilled, KV on the host of each node (all nodes of the cluster)
    node_instance: np.ndarray      # instance that owns each node (-1 if shared)
    host_capacity_tokens: np.ndarray  # KV tokens each node's host memory may hold
    host_used_tokens: np.ndarray
    lengths: Lengths
    last_phase: Phase
    gpus_per_node: int
    capabilities: Capabilities = Capabilities()
    # per running sequence: context tokens a chunked prefill has written so far while it is under way (such a
    # sequence does not decode yet and holds the pages of what it wrote); 0 for every sequence that decodes
    active_prefilled: np.ndarray = field(default_factory=lambda: EMPTY)
    # what this policy's previous decision on this instance left for the next one (`Decision.carry`; None at the
    # first): a policy that must remember (SGLang's new_token_ratio) stays a pure function of its snapshot
    carry: Any = None
    # the prefix cache, where the job shares prefixes (None: nothing is shared)
    prefixes: PrefixView | None = None
    # per running sequence: the tokens of a shared prefix it holds by reference (their pages are not its own but
    # its GPU's, already out of `pages_capacity`); empty where nothing is shared (`prefixes` None)
    active_shared: np.ndarray = field(default_factory=lambda: EMPTY)

    @property
    def layerwise_offload(self) -> bool:
        return self.capabilities.layerwise_offload

    @property
    def num_ranks(self) -> int:
        return self.gpus.size

    def rank_count(self) -> np.ndarray:
        return np.bincount(self.active_rank, minlength=self.num_ranks)

    def own_nodes(self) -> np.ndarray:
        return np.unique(self.rank_node)


@dataclass(frozen=True)
class Admit:
    """COMBINE sequences from the head of `node`'s suspended pool onto ranks (MIGRATE if remote)."""

    node: int
    ids: np.ndarray
    ranks: np.ndarray
    host_resident: np.ndarray | bool = False  # run with KV on host (restored per layer), holding no pages
    # False: the host copy is dropped once the KV is on the GPU (nothing syncs it from then on; a later YIELD
    # writes the whole KV down again). PD-disaggregation's decode side keeps no host copy.
    keep_host_copy: bool = True


@dataclass
class Decision:
    """What to change at this boundary, and how long to run before the next one.

    Applied in field order: pin, evict, yield, offload, move, admit, partition, prefill, chunks; then the instance
    runs one forward pass if anything prefills (whole prompts or chunks), else up to `steps` decode iterations
    (stopping early per `stop`).

    Chunked prefill (`chunk_ids`): one forward carries every running sequence's decode token and, per rank,
    chunks of prompts: `chunk_lens[i]` tokens of sequence `chunk_ids[i]` from where its prefill stands (a
    sequence part-way through its prefill continues there; any other starts at 0 and is taken from the head of
    its rank's pinned queue with `prefill_pinned`, else of the pending pool). A chunk that completes its context
    makes the sequence's first token. `prefill_ids` and `chunk_ids` are not used together.
    """

    pin_ids: np.ndarray = field(default_factory=lambda: EMPTY)
    pin_ranks: np.ndarray = field(default_factory=lambda: EMPTY)
    evict_ids: np.ndarray = field(default_factory=lambda: EMPTY)     # drop KV (running or suspended)
    yield_ids: np.ndarray = field(default_factory=lambda: EMPTY)     # YIELD: KV to host, suspended
    offload_ids: np.ndarray = field(default_factory=lambda: EMPTY)   # keep running, host-resident from now
    move_ids: np.ndarray = field(default_factory=lambda: EMPTY)      # MIGRATE running sequences ...
    move_ranks: np.ndarray = field(default_factory=lambda: EMPTY)    # ... to these ranks (KV over links)
    admits: list[Admit] = field(default_factory=list)
    partition_ids: np.ndarray = field(default_factory=lambda: EMPTY)  # PARTITION running sequences ...
    partition_degree: np.ndarray = field(default_factory=lambda: EMPTY)  # ... over this many ranks each
    prefill_ids: np.ndarray = field(default_factory=lambda: EMPTY)   # from the head of pending / pinned
    prefill_ranks: np.ndarray = field(default_factory=lambda: EMPTY)
    prefill_pinned: bool = False     # prefill ids come from the ranks' pinned queues, not the shared pool
    prefill_to_host: bool = False    # offload prefill KV to host (suspended) instead of keeping it running
    host_sync: bool = False          # keep the host KV copy of running sequences up to date (every page)
    steps: int = 64
    stop: Stop = "none"
    micro_batch: int = 0             # B_attn: attention runs in micro-batches of this many sequences (0 = one)
    cpu_attention: bool = False      # host-resident sequences' attention runs on the host CPU beside their KV
    padded: bool = False             # static batches: finished rows keep costing until the whole batch ends
    # decode FFN schedule: "combined" (module-based batching: every micro-batch's tokens form one expert batch),
    # "micro_batch" (each attention micro-batch runs its own FFN with the layer's weights, loaded once per layer:
    # FlexGen / ZeRO-Inference), "pipelined" (the same, with the next micro-batch's attention overlapping this
    # one's FFN: MoE-Lightning's CGOPipe); see batchgen.pricing.microbatch
    ffn_schedule: str = "combined"
    chunk_ids: np.ndarray = field(default_factory=lambda: EMPTY)    # chunked prefill: these sequences ...
    chunk_ranks: np.ndarray = field(default_factory=lambda: EMPTY)  # ... on these ranks ...
    chunk_lens: np.ndarray = field(default_factory=lambda: EMPTY)   # ... write this many more context tokens
    chunks_only: bool = False  # the chunks' forward carries no decode: running sequences wait for it to end (SGLang
    #                            without --enable-mixed-chunk, its default: a prefill batch, then decode batches)
    carry: Any = None  # handed to this instance's next snapshot (`Snapshot.carry`), untouched by the engine

    @property
    def phase(self) -> Phase:
        if self.prefill_ids.size or self.chunk_ids.size:
            return "prefill"
        return "decode"


@dataclass(frozen=True)
class Forecast:
    """What the instance's next snapshots will show if each run goes as decided and nothing else happens: the
    running sequences of the decision's run at each of the next `len(alive)` boundaries. Row j is boundary
    j + 1 after this one: `alive[j, i]` whether `Snapshot.active_ids[i]` still runs there (it has not ended),
    `context[j, i]` its context then (meaningful where alive). Given to `Policy.repeats` only, never to
    `decide`: a policy learns that a sequence ended when it ends (see `repeats`)."""

    alive: np.ndarray    # (J, N) bool
    context: np.ndarray  # (J, N) int64


class Policy(Protocol):
    """A scheduling policy: `decide` is all it must have. The optional members below (with the defaults of
    `PolicyDefaults`, which every registered policy inherits) are read by the engine and the job's layout:

    - `instance_gpus(num_gpus, node_size) -> int` sizes the instances (PD-disaggregation's units,
      batchgen.job.effective_cluster); None: the cluster's own instance size.
    - `route(num_sequences, num_instances) -> instance per sequence` replaces the round-robin split of the
      input; None: round-robin.
    - `receives_work(instance) -> bool` keeps an instance with nothing queued alive until the job is done (it
      runs what other instances hand over); default False.
    - `resolve_for_job(rig) -> Policy` returns the policy with its own search's choices (the offloading
      systems); None: nothing to resolve.
    - `for_gpu(gpu) -> Policy` returns the policy with the knobs it left "auto" set to its engine's defaults on
      that GPU (vLLM's and SGLang's batch caps: batchgen.policy.engine_defaults), when the job is built; None:
      nothing to resolve.
    - `two_batch_overlap`: every forward as two micro-batches (SGLang's TBO; sglang_opt); default False.
    - `comm_overlap`: each attention micro-batch's expert dispatch sent while the next micro-batch computes, and
      its combine while the next layer starts (batchgen.plan.decode.overlapped_all_to_all); default False.
    - `attention_tp`: GPUs per tensor-parallel attention group (1: data-parallel attention); default 1.
    - `prefill_parallel`: how forwards that prefill run their experts: `ep` (expert parallel over the instance,
      the all-to-all on every prompt token) or `dp` (each rank through every expert, streaming in those it does
      not hold; batchgen.pricing.price); default ep.
    - `ffn_schedule`: how its decisions run the experts beside the attention micro-batches (`Decision.
      ffn_schedule`: `combined`, one expert batch per layer; the offloading systems' `micro_batch` or
      `pipelined`), so that a backend that runs only one can refuse the policy before the run; default combined.
    - `repeats(snap, decision, forecast) -> int`: at how many of the next boundaries (a prefix of the
      `Forecast`'s) `decide` would return this same decision again (a decode of every running sequence, nothing
      else), so that the simulator may run them as one event and replay their bookkeeping (batchgen.engine.repeat);
      None (the default): never asked. A speed declaration only: decisions and results are the same either
      way, and a run with `check_invariants` calls `decide` at every replayed boundary and fails if the
      declaration was wrong.
    """

    name: str
    instance_gpus: Callable[[int, int], int] | None
    route: Callable[[int, int], np.ndarray] | None
    resolve_for_job: Callable[[Any], "Policy"] | None
    for_gpu: Callable[[Any], "Policy"] | None
    repeats: Callable[[Snapshot, Decision, Forecast], int] | None
    two_batch_overlap: bool
    comm_overlap: bool
    attention_tp: int | str
    ffn_schedule: str
    prefill_parallel: str

    def decide(self, snap: Snapshot) -> Decision: ...
    def receives_work(self, instance: int) -> bool: ...


class PolicyDefaults:
    """The defaults of `Policy`'s optional members (see there). Plain class attributes, not dataclass fields: a
    policy's knobs are its own fields, and one that has the member as a knob (sglang_opt's two_batch_overlap,
    continuous's attention_tp) or a method (pd_disagg's instance_gpus) overrides the default."""

    instance_gpus = None
    route = None
    resolve_for_job = None
    for_gpu = None
    two_batch_overlap = False
    comm_overlap = False
    attention_tp = 1
    ffn_schedule = "combined"
    prefill_parallel = "ep"

    repeats = None  # the engine asks a policy that declares repeats (block policies); None: it never does

    def receives_work(self, instance: int) -> bool:
        return False
