"""What the engine hands a backend and what the backend reports: one run of an instance between two boundaries
(`StepPlan`), its outcome (`StepResult`), and the `Backend` protocol every backend implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol

import numpy as np

from batchgen.core.accounts import Moves
from batchgen.core.ops import GpuOps, KVOps
from batchgen.core.sequences import InvariantError
from batchgen.core.state import ClusterState
from batchgen.policy.base import Capabilities, Phase


@dataclass
class StepPlan:
    """One run of an instance between two boundaries, as the backend must execute it."""

    instance: int
    gpus: np.ndarray
    decode_ids: np.ndarray
    decode_rank: np.ndarray
    decode_tp: np.ndarray
    prefill_ids: np.ndarray
    prefill_rank: np.ndarray
    steps: int
    stop: str
    micro_batch: int
    decode_host_resident: np.ndarray  # bool per decode sequence: KV restored per layer from host
    cpu_attention: bool        # host-resident attention on the host CPU instead of the GPU
    pad_rows: np.ndarray       # per rank
    pad_context: np.ndarray    # per rank: summed context of the padding rows
    moves: Moves               # bytes this boundary's KV ops copy, per global GPU and tier (KVOps.moves)
    host_sync: bool
    prefill_to_host: bool
    padded: bool
    start: float = 0.0         # clock reading when the boundary began (before the decision)
    ffn_schedule: str = "combined"  # Decision.ffn_schedule: one expert batch, or an FFN per micro-batch
    # chunked prefill: one forward in which each chunk writes context tokens [start, start + len) of its sequence
    # beside every decode (a chunk that ends its context samples the sequence's first token)
    chunk_ids: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_rank: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_start: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_len: np.ndarray = field(default_factory=lambda: _EMPTY)
    chunk_completes: np.ndarray = field(default_factory=lambda: np.empty(0, bool))  # the chunk ends its context
    # whole prefills that take a shared prefix (batchgen.core.prefix_pages) start past it: per prefill, the first
    # context token it computes (empty: every one from its first token)
    prefill_start: np.ndarray = field(default_factory=lambda: _EMPTY)
    # the KV ops that come before the run, as the primitives emitted them (batchgen.core.ops); None for a backend
    # that prices their bytes (`moves`) instead of moving KV (the simulator) and does not ask for them
    ops: KVOps | None = None
    # running sequences that wait beside this run without a token of it (a chunks-only forward's decodes): still
    # running, and counted so in the step record
    waiting: int = 0
    # cascade attention (batchgen.core.cascade): per decode, the group whose prefix its query reads once per call
    # with the others of its rank (-1: none), and that prefix's tokens (0: none); empty: no cascade in this run
    decode_cascade: np.ndarray = field(default_factory=lambda: _EMPTY)
    decode_shared: np.ndarray = field(default_factory=lambda: _EMPTY)

    @property
    def phase(self) -> Phase:
        if self.prefill_ids.size:
            return "prefill"
        if self.chunk_ids.size:
            return "mixed" if self.decode_ids.size else "prefill"
        return "decode" if self.decode_ids.size else "idle"

    def for_rank(self, rank: int) -> GpuOps:
        """Everything rank `rank` of the instance does at this boundary: its KV ops (`KVOps.for_gpu`, which needs
        `ops`), then its prefills, chunks (id, start, length) and decodes."""
        if self.ops is None:
            raise InvariantError("this plan carries no KV ops: its backend did not ask for them (Backend.kv_ops)")
        mine = self.ops.for_gpu(int(self.gpus[rank]))
        mine.prefill = self.prefill_ids[self.prefill_rank == rank].tolist()
        on = self.chunk_rank == rank
        mine.chunks = list(zip(self.chunk_ids[on].tolist(), self.chunk_start[on].tolist(),
                               self.chunk_len[on].tolist()))
        mine.decode = self.decode_ids[self.decode_rank == rank].tolist()
        return mine


@dataclass
class StepResult:
    duration: float
    iterations: int
    produced: np.ndarray        # tokens each decode sequence generated
    finished: np.ndarray        # bool per decode sequence
    finish_offset: np.ndarray   # seconds after the start at which each decode sequence produced its last token
    prefill_finished: np.ndarray  # bool per prefill sequence (a one-token output ends at prefill)
    rank_busy: np.ndarray       # compute seconds per rank
    rank_comm: np.ndarray       # seconds per rank in collectives and copies not hidden by compute
    expert_tokens: float        # tokens entering the gate, summed over iterations (one MoE layer)
    expert_calls: int           # iterations that ran the MoE layers
    tokens: int                 # tokens processed (prefill + decode)
    # seconds per module over the run (attention, ffn, head = LM head + sampling, ...), where the backend knows
    modules: dict[str, float] = field(default_factory=dict)
    chunk_finished: np.ndarray = field(default_factory=lambda: np.empty(0, bool))  # per chunk: ended its context
                                                                                  # and its one token was the last
    # per prompt written to host after the forward: the tokens its copy holds of its node's host prefix, as the
    # backend wrote it (batchgen.core.host_prefixes; 0 for one that finished); empty: the state decides at record
    prefill_host_held: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


_EMPTY = np.empty(0, np.int64)
FFN_SCHEDULES = ("combined", "micro_batch", "pipelined")  # Decision.ffn_schedule


class Backend(Protocol):
    """What the engine needs from a backend: it executes plans and makes time pass; it decides nothing and
    keeps no bookkeeping of its own (the engine notices deadlocks and assembles the run's output).

    `capabilities`: what it can run, declared (the policy plans within it). `kv_ops`: whether it moves real KV
    and so needs each plan's explicit ops (`StepPlan.ops`, and `move_kv` for the ops of a decision that runs
    nothing); False for a backend that prices the bytes of `StepPlan.moves` instead."""

    state: ClusterState
    capabilities: Capabilities
    kv_ops: bool

    def now(self) -> float: ...
    def execute(self, plan: StepPlan) -> Generator[Any, Any, StepResult]: ...
    def move_kv(self, ops: KVOps) -> None:
        """Carry out KV ops of a boundary that runs nothing (an idle decision's yields, evictions)."""
        ...
    def idle(self) -> Generator[Any, Any, None]:
        """Block this instance until `wake` (another instance finished a step or ended)."""
        ...
    def wake(self) -> None: ...


def filled(n: int, value, dtype) -> np.ndarray:
    """n copies of `value`, read-only and shared: a column every running sequence has the same value in (degree 1
    when nothing was ever partitioned, not host-resident without host copies, one token in a forward)."""
    key = (n, value, dtype)
    out = _FILLED.get(key)
    if out is None:
        if len(_FILLED) >= 4096:
            _FILLED.clear()
        out = _FILLED[key] = np.full(n, value, dtype)
        out.flags.writeable = False
    return out


_FILLED: dict[tuple, np.ndarray] = {}


StepObserver = Callable[[StepPlan, StepResult], None]


def finished_ids(plan: StepPlan, result: StepResult) -> np.ndarray:
    """The sequences that ended in this run (decodes that stopped, prefills whose one token was the last)."""
    parts = [plan.decode_ids[result.finished], plan.prefill_ids[result.prefill_finished]]
    if plan.chunk_ids.size:
        parts.append(plan.chunk_ids[result.chunk_finished])
    return np.concatenate(parts)
