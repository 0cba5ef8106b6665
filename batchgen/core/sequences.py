"""Per-sequence state of a batch job, as columns.

A job holds up to millions of sequences, so each field is one numpy array indexed by sequence id rather than
one object per sequence. `where` is the single source of truth for a sequence's place: it lives in exactly one
of the pending pool, the host (suspended, KV checkpointed), one GPU, or the finished set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PENDING = -1    # prompt not yet prefilled; no KV anywhere
SUSPENDED = -2  # yielded: KV checkpointed in the host memory of node `host_node`
FINISHED = -3   # produced all its tokens
# where >= 0: running on that (global) GPU index. Its KV is either device-resident (paged on that GPU) or, with
# `host_resident`, host-resident: it stays in the host memory of the GPU's node (the source of truth) and is
# restored layer by layer, one attention micro-batch at a time, into a device staging buffer, with the new
# token's KV appended back to host. Host-resident sequences hold no GPU pages, so the expert batch can grow far
# past what device KV holds.

PLACE_NAMES = {PENDING: "pending", SUSPENDED: "suspended", FINISHED: "finished"}


class InvariantError(AssertionError):
    """The state broke a rule that must always hold: a bug in a policy or a backend, never bad input."""


@dataclass
class SequenceTable:
    input_len: np.ndarray
    output_len: np.ndarray  # ground truth (when EOS comes); policies never see it
    decoded: np.ndarray = field(init=False)         # tokens generated so far (prefill makes the first)
    where: np.ndarray = field(init=False)
    host_node: np.ndarray = field(init=False)       # node whose host memory holds the KV copy, -1 if none
    kv_gpu: np.ndarray = field(init=False)          # GPU whose cache holds the KV (pages or host copy; the lead of
    #                                                 a partition), -1 if none: the source of its next move
    pages: np.ndarray = field(init=False)           # KV pages allocated on the GPU while running
    home_gpu: np.ndarray = field(init=False)        # GPU a sequence is pinned to (-1: free to move)
    tp: np.ndarray = field(init=False)              # GPUs a running sequence is partitioned over
    host_resident: np.ndarray = field(init=False)   # running with its KV on host only (see `where`)
    instance: np.ndarray = field(init=False)
    first_token_time: np.ndarray = field(init=False)
    finish_time: np.ndarray = field(init=False)
    yields: np.ndarray = field(init=False)
    migrations: np.ndarray = field(init=False)
    recomputes: np.ndarray = field(init=False)
    partitions: np.ndarray = field(init=False)
    # tokens of the context (prompt, plus generated tokens for a recompute) whose KV a chunked prefill has written
    # so far, while it is under way (0 < prefilled < context, running, device-resident); 0 for everyone else
    prefilled: np.ndarray = field(init=False)

    def __post_init__(self):
        # own copies: an executor learns true output lengths (EOS) and writes them here
        self.input_len = np.array(self.input_len, dtype=np.int64)
        self.output_len = np.array(self.output_len, dtype=np.int64)
        n = self.input_len.size
        if self.output_len.size != n:
            raise ValueError("input_len and output_len must have the same length")
        self.decoded = np.zeros(n, np.int64)
        self.where = np.full(n, PENDING, np.int32)
        self.host_node = np.full(n, -1, np.int32)
        self.kv_gpu = np.full(n, -1, np.int32)
        self.pages = np.zeros(n, np.int64)
        self.home_gpu = np.full(n, -1, np.int32)
        self.tp = np.ones(n, np.int32)
        self.host_resident = np.zeros(n, bool)
        self.instance = np.zeros(n, np.int32)
        self.first_token_time = np.full(n, np.nan)
        self.finish_time = np.full(n, np.nan)
        self.yields = np.zeros(n, np.int32)
        self.migrations = np.zeros(n, np.int32)
        self.recomputes = np.zeros(n, np.int32)
        self.partitions = np.zeros(n, np.int32)
        self.prefilled = np.zeros(n, np.int64)

    def __len__(self) -> int:
        return self.input_len.size

    def context(self, ids: np.ndarray) -> np.ndarray:
        """Tokens whose KV a sequence needs: its prompt plus what it has generated."""
        return self.input_len[ids] + self.decoded[ids]

    def remaining(self, ids: np.ndarray) -> np.ndarray:
        return self.output_len[ids] - self.decoded[ids]

    def check(self) -> None:
        """Rules that hold for every sequence at every boundary."""
        if np.any(self.decoded < 0) or np.any(self.decoded > self.output_len):
            bad = np.flatnonzero((self.decoded < 0) | (self.decoded > self.output_len))[:5]
            raise InvariantError(f"sequences {bad.tolist()} decoded outside [0, output_len]")
        done = self.where == FINISHED
        if not np.array_equal(done, self.decoded == self.output_len):
            bad = np.flatnonzero(done != (self.decoded == self.output_len))[:5]
            raise InvariantError(f"sequences {bad.tolist()}: finished must mean exactly output_len tokens")
        if np.any(np.isnan(self.finish_time[done])) or np.any(~np.isnan(self.finish_time[~done])):
            raise InvariantError("finish_time must be set exactly for finished sequences")
        if np.any(self.pages[self.where < 0] != 0):
            raise InvariantError("only running sequences may hold GPU pages")
        if np.any(self.host_resident & (self.where < 0)):
            raise InvariantError("only running sequences can be host-resident")
        if np.any(self.host_resident & ((self.pages != 0) | (self.host_node < 0))):
            bad = np.flatnonzero(self.host_resident & ((self.pages != 0) | (self.host_node < 0)))[:5]
            raise InvariantError(f"host-resident sequences {bad.tolist()} must hold no GPU pages and have a host copy")
        if np.any((self.where == SUSPENDED) & (self.host_node < 0)):
            raise InvariantError("a suspended sequence must have its KV on some node's host memory")
        if np.any((self.where == PENDING) & (self.host_node >= 0)):
            raise InvariantError("a pending sequence has no KV, so no host copy")
        running = self.where >= 0
        if np.any(self.kv_gpu[running] != self.where[running]):
            bad = np.flatnonzero(running & (self.kv_gpu != self.where))[:5]
            raise InvariantError(f"running sequences {bad.tolist()}: their KV must be in their GPU's cache (kv_gpu)")
        if np.any((self.where == SUSPENDED) & (self.kv_gpu < 0)):
            raise InvariantError("a suspended sequence's KV must be in some GPU's cache (kv_gpu)")
        partial = self.prefilled != 0
        if partial.any():
            ids = np.flatnonzero(partial)
            bad = ids[(self.where[ids] < 0) | self.host_resident[ids] | (self.tp[ids] != 1)
                      | (self.prefilled[ids] < 0) | (self.prefilled[ids] >= self.context(ids))]
            if bad.size:
                raise InvariantError(f"sequences {bad[:5].tolist()}: a prompt part-way through a chunked prefill must "
                                     "run device-resident on one GPU with 0 < prefilled < its context")


def without(kept: np.ndarray, ids: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """`kept` (unique ids) in its order with `ids` dropped: np.setdiff1d(kept, ids, assume_unique=True) without its
    sort, through `scratch`, a mask over every id that is all False between calls."""
    if ids.size == 1:  # one sequence leaves (a finish, mostly): one comparison
        return kept[kept != ids[0]]
    scratch[ids] = True
    out = kept[~scratch[kept]]
    scratch[ids] = False
    return out
