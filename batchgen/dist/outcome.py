"""A recovered `backend=dist` run's output, folded over its generations (batchgen.dist.recovery): the records and
counters of every generation, the tokens of sequences that finished, and the final state over the launched
cluster's topology."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgen.core.queues import IdQueue
from batchgen.core.state import ClusterState


def pad_ranks(values: np.ndarray, members: tuple[int, ...], world: int) -> np.ndarray:
    """A generation's per-rank array as per launch rank (a lost rank's entry 0): records of every generation
    line up."""
    out = np.zeros(world, dtype=np.asarray(values).dtype)
    out[list(members)] = values
    return out


@dataclass
class RunPieces:
    """What rank 0 keeps across generations: the finished engines' records and counters."""

    several: bool = False  # the launched cluster has several instances (each survives whole or is dropped)
    records: list = field(default_factory=list)
    events: int = 0
    moves: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)

    def add(self, engine, backend, members: tuple[int, ...], world: int) -> None:
        topo = engine.state.topo
        if not self.several:  # one instance: per launch rank (a lost rank's entries 0)
            for r in engine.records:
                r.rank_busy = pad_ranks(r.rank_busy, members, world)
                r.rank_comm = pad_ranks(r.rank_comm, members, world)
        else:  # whole instances survive: a record keeps its instance's ranks, renumbered to the launched one
            launched = launched_instances(topo, members)
            for r in engine.records:
                r.instance = int(launched[r.instance])
        self.records.extend(engine.records)
        self.events += backend.events
        for into, src in ((self.moves, backend.moves), (self.traffic, backend.traffic)):
            for k, v in src.items():
                into[k] = (max(into.get(k, 0), v) if k.startswith("peak") else into.get(k, 0) + v)


@dataclass
class PartialOutput:
    """What a run that stopped keeps (rank 0 alive): every finished sequence's tokens, and the steps run."""

    finished: dict[int, list[int]]  # sequence id -> its generated tokens, for each sequence that had finished
    total: int                      # sequences in the job
    records: list

    @classmethod
    def of(cls, tokens, done: np.ndarray, records: list) -> "PartialOutput":
        return cls({int(s): list(tokens.generated[s]) for s in np.flatnonzero(done)}, len(done), list(records))

    @classmethod
    def from_reports(cls, reports: list) -> "PartialOutput | None":
        """What rank 0 reported to the launcher as sequences finished (`finished_report`): all that is left of
        its outputs when rank 0 itself died (no records)."""
        if not reports:
            return None
        finished = {}
        for r in reports:
            finished.update(r["finished"])
        return cls(finished, reports[-1]["total"], [])

    @property
    def summary(self) -> str:
        return f"{len(self.finished)} of {self.total} sequences had finished"


def carry_totals(before, after) -> None:
    """A process's new `RankWorker` (next generation) goes on counting where the old one stopped: busy,
    communication and wall seconds, CPU seconds, KV moves and the bytes they copied are over the process's whole
    run."""
    after.busy_s += before.busy_s
    after.comm_s += before.comm_s
    after._busy_pending += before._busy_pending
    after._comm_pending += before._comm_pending
    after._start, after._cpu_start = before._start, before._cpu_start
    for into, src in ((after.moves, before.moves), (getattr(after, "traffic", {}), getattr(before, "traffic", {}))):
        for kind, n in src.items():
            into[kind] = into.get(kind, 0) + n
    for kind, tiers in getattr(before, "kv_bytes", {}).items():
        for tier, (nbytes, seqs) in tiers.items():
            entry = after.kv_bytes.setdefault(kind, {}).setdefault(tier, [0, 0])
            entry[0] += nbytes
            entry[1] += seqs


def finished_report(tokens, ids) -> dict:
    """A progress message for the launcher: the tokens of sequences that just finished (each sent once, so a
    rank 0 that dies later leaves them behind in its parent)."""
    return {"total": len(tokens.generated), "finished": {int(s): list(tokens.generated[int(s)]) for s in ids}}


# what a generation's state counts over its run (prefill, prefix takes, decode reads): the output sums them
RUN_COUNTERS = ("prefill_computed", "decode_kv_read", "decode_forwards", "cascade_prefix_read", "prefix_taken",
                "prefix_restored")


def fold_peaks(first: ClusterState, retired: ClusterState, members: tuple[int, ...]) -> None:
    """The launched cluster's peak pages (per launch rank) and host use also count a later generation's, and its
    run counters add that generation's."""
    idx = list(members)
    first.peak_pages[idx] = np.maximum(first.peak_pages[idx], retired.peak_pages)
    k = min(first.peak_host.size, retired.peak_host.size)
    first.peak_host[:k] = np.maximum(first.peak_host[:k], retired.peak_host[:k])
    for name in RUN_COUNTERS:
        if hasattr(retired, name):
            setattr(first, name, getattr(first, name) + getattr(retired, name))


def launched_instances(topo, members: tuple[int, ...]) -> np.ndarray:
    """Each instance of a later generation's topology as the launched instance it is (several instances
    survive whole and keep their size: its first GPU's launch rank over that size)."""
    size = topo.instance_gpus(0).size
    return np.array([members[int(topo.instance_gpus(i)[0])] // size for i in range(topo.num_instances)])


def settle(first: ClusterState, last: ClusterState, members: tuple[int, ...]) -> None:
    """The output's state after recoveries: the launched cluster's (its topology, so that records' per-rank
    arrays, indexed by launch rank, line up with its GPUs) holding the last generation's per-sequence results
    (every sequence finished: nothing left on any GPU, host or queue)."""
    if not last.all_finished():
        raise AssertionError("settle: the last generation left sequences unfinished")
    fold_peaks(first, last, members)
    last.table.instance[:] = launched_instances(last.topo, members)[last.table.instance]
    first.table = last.table
    first.num_finished = last.num_finished
    first.pages_used[:] = 0
    first.host_used[:] = 0
    first._host_any = False
    first.host_reserved[:] = 0
    first.forget_prefixes()
    first.pending = [IdQueue() for _ in first.pending]
    first.pinned = [IdQueue() for _ in first.pinned]
    first.suspended = [IdQueue() for _ in first.suspended]
    first.active = [np.empty(0, np.int64) for _ in first.active]
    first.prefilling = [np.empty(0, np.int64) for _ in first.prefilling]
    first.check()
