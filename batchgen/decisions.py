"""Decision traces: what a policy decided at each boundary, without any time in it.

Given the same lengths and the same snapshot (same capabilities, same KV pool), the simulator and the executor
must take the same decisions at the same boundaries; only the time between boundaries differs. A trace makes
that checkable: one `BoundaryDecision` per boundary that ran something, its ids sorted, so two traces compare
with ==, and `first_difference` says where two runs parted.
"""

from __future__ import annotations

import csv
from dataclasses import astuple, dataclass, fields, replace
from typing import Iterable

import numpy as np

IdTuple = tuple[int, ...]


def _ids(a) -> IdTuple:
    """An id set as a sorted tuple: a few hundred ids, which Python sorts faster than numpy's call."""
    return tuple(sorted(np.asarray(a, dtype=np.int64).ravel().tolist()))


@dataclass(frozen=True)
class BoundaryDecision:
    """One boundary's decision as applied (idle decisions just before it that changed something folded in)."""

    instance: int
    phase: str
    prefilled: IdTuple
    chunked: IdTuple          # sequences a chunk of whose prompt this forward prefilled (chunked prefill)
    decoded: IdTuple
    host_resident: IdTuple    # of the decoded, those running with KV on host
    yielded: IdTuple
    offloaded: IdTuple
    evicted: IdTuple
    migrated: IdTuple         # running sequences moved to another rank
    admitted: IdTuple         # suspended sequences combined back (from any node)
    partitioned: IdTuple
    pinned: IdTuple
    steps: int
    stop: str
    micro_batch: int
    flags: str                # prefill_to_host, host_sync, cpu_attention, padded, chunks_only: the ones set,
                              # comma-joined

    @classmethod
    def of(cls, decision, plan, folded: "BoundaryDecision | None" = None) -> "BoundaryDecision":
        """From a `Decision` and the `StepPlan` it became; `folded`: idle decisions' changes since the last run."""
        return DeferredDecision(decision, plan, folded).resolve()

    def merged(self, earlier: "BoundaryDecision") -> "BoundaryDecision":
        """This decision with the id sets of an earlier (idle) one added."""
        sets = {f: tuple(sorted(set(getattr(self, f)) | set(getattr(earlier, f)))) for f in FOLDED_FIELDS}
        return replace(self, **sets)

    def changes_something(self) -> bool:
        return any(getattr(self, f) for f in ID_FIELDS)

    def row(self) -> dict[str, str | int]:
        """A CSV row: id sets as compact ranges ("0-15 18")."""
        return {f.name: (ranges(v) if isinstance(v, tuple) else v) for f, v in zip(fields(self), astuple(self))}


class DeferredDecision:
    """`BoundaryDecision.of(decision, plan, folded)`, built when first read (`resolve`). The engine records one per
    run, and sorting a run's id sets into tuples cost the simulator a twentieth of its time, though only traces and
    tests read them. It keeps just the arrays the summary reads, not the decision or the plan (a policy's carry
    could be large): arrays nobody writes into after the boundary (the state replaces its active arrays rather than
    writing into them; the policy's are its own). tests/test_sim_paths.py builds the summaries at once instead and
    compares the traces."""

    __slots__ = ("_parts", "_folded")

    def __init__(self, decision, plan, folded: "BoundaryDecision | None" = None):
        self._parts = (plan.instance, plan.phase, plan.prefill_ids, plan.chunk_ids, plan.decode_ids,
                       plan.decode_host_resident, plan.steps, plan.stop, plan.micro_batch, decision.yield_ids,
                       decision.offload_ids, decision.evict_ids, decision.move_ids,
                       [a.ids for a in decision.admits], decision.partition_ids, decision.pin_ids,
                       (("prefill_to_host", decision.prefill_to_host), ("host_sync", decision.host_sync),
                        ("cpu_attention", decision.cpu_attention), ("padded", decision.padded),
                        ("chunks_only", decision.chunks_only)))
        self._folded = folded

    def unsorted(self) -> tuple[tuple, tuple]:
        """The id sets as arrays in the engine's order (`ID_FIELDS` order), and the other fields (`SCALAR_FIELDS`
        order), without the folded idle changes: `resolve` sorts each set into a tuple, `DecisionColumns` sorts
        every boundary's at once."""
        (instance, phase, prefill_ids, chunk_ids, decode_ids, decode_host_resident, steps, stop, micro_batch,
         yield_ids, offload_ids, evict_ids, move_ids, admits, partition_ids, pin_ids, flags) = self._parts
        admitted = np.concatenate([np.asarray(a) for a in admits]) if admits else ()
        ids = (prefill_ids, chunk_ids, decode_ids, decode_ids[np.asarray(decode_host_resident, bool)], yield_ids,
               offload_ids, evict_ids, move_ids, admitted, partition_ids, pin_ids)
        return ids, (int(instance), phase, int(steps), str(stop), int(micro_batch),
                     ",".join(n for n, on in flags if on))

    @property
    def folded(self) -> "BoundaryDecision | None":
        return self._folded

    def resolve(self) -> BoundaryDecision:
        ids, scalars = self.unsorted()
        rec = BoundaryDecision(**dict(zip(SCALAR_FIELDS, scalars)), **{f: _ids(a) for f, a in zip(ID_FIELDS, ids)})
        return rec.merged(self._folded) if self._folded is not None else rec


ID_FIELDS = tuple(f.name for f in fields(BoundaryDecision) if f.type == "IdTuple")
COLUMNS = tuple(f.name for f in fields(BoundaryDecision))
SCALAR_FIELDS = tuple(f for f in COLUMNS if f not in ID_FIELDS)
RUN_FIELDS = ("prefilled", "chunked", "decoded", "host_resident")  # what ran: never folded from idle decisions
FOLDED_FIELDS = tuple(f for f in ID_FIELDS if f not in RUN_FIELDS)
CHANGED_FIELDS = ("decoded", "host_resident")  # the running sets: decisions.csv holds their changes


def _file_columns(names: tuple[str, ...]) -> tuple[str, ...]:
    """decisions.csv's columns for trace fields: a running set as the ids that joined it and those that left."""
    return tuple(c for f in names for c in ((f"{f}_joined", f"{f}_left") if f in CHANGED_FIELDS else (f,)))


FILE_COLUMNS, FILE_ID_COLUMNS = _file_columns(COLUMNS), _file_columns(ID_FIELDS)


def ranges(ids: Iterable[int]) -> str:
    """Sorted ids as runs: (0, 1, 2, 5) -> "0-2 5"."""
    out, ids = [], list(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return " ".join(out)


def ids_of(text: str) -> IdTuple:
    """The inverse of `ranges`: "0-2 5" -> (0, 1, 2, 5)."""
    out: list[int] = []
    for run in text.split():
        first, _, last = run.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return tuple(out)


def trace_of(records) -> list[BoundaryDecision]:
    """The decision trace of a run's step records (engine.StepRecord), in the order they ran."""
    return [r.decision for r in records if getattr(r, "decision", None) is not None]


@dataclass
class DecisionColumns:
    """A decision trace as the columns of decisions.csv, built without a `BoundaryDecision` per boundary. Boundary
    k's ids of a file column `c` are `ids[c][0][offsets[k]:offsets[k + 1]]`, `offsets = ids[c][1]`, sorted.

    The running sets (`CHANGED_FIELDS`: every running sequence at every boundary) are almost all of a trace: 8.5M
    ids for 20K sequences on 8 GPUs, where the policy's own choices are 60K, and most of the time it took to write
    them. The file holds what changed instead: for each boundary, the ids that joined its instance's set since that
    instance's previous boundary (`<field>_joined`) and those that left it (`<field>_left`); `read_decisions`
    replays them into the whole sets."""

    ids: dict[str, tuple[np.ndarray, np.ndarray]]   # file column -> (every boundary's ids, int64; offsets, one more)
    scalars: dict[str, np.ndarray]                  # instance, steps, micro_batch: int64; phase, stop, flags: str

    @classmethod
    def of(cls, records) -> "DecisionColumns":
        """From a run's step records (engine.StepRecord), in the order they ran: `trace_of(records)` as columns."""
        sets: list[list] = [[] for _ in FILE_ID_COLUMNS]
        sizes: list[list[int]] = [[] for _ in FILE_ID_COLUMNS]
        scalars: list[tuple] = []
        changes = SetChanges()
        for r in records:
            summary = r.summary if hasattr(r, "summary") else getattr(r, "decision", None)  # not resolved
            if summary is None:
                continue
            ids, values = _unsorted(summary)
            scalars.append(values)
            for held, n, a in zip(sets, sizes, changes.columns(values[0], ids)):
                k = len(a)
                n.append(k)
                if k:
                    held.append(a)
        columns = {}
        for f, held, n in zip(FILE_ID_COLUMNS, sets, sizes):
            offsets = np.zeros(len(n) + 1, np.int64)
            np.cumsum(n, out=offsets[1:])
            flat = np.concatenate([np.asarray(a, np.int64).ravel() for a in held]) if held else np.empty(0, np.int64)
            columns[f] = (sorted_within(flat, offsets), offsets)
        values = list(zip(*scalars)) if scalars else [()] * len(SCALAR_FIELDS)
        return cls(columns, {f: np.array(v, dtype=np.int64 if f in ("instance", "steps", "micro_batch") else object)
                             for f, v in zip(SCALAR_FIELDS, values)})

    def __len__(self) -> int:
        return len(self.scalars["instance"])


class SetChanges:
    """Each instance's running sets as changes since that instance's previous boundary, through one scratch mask
    over the ids (cleared after each use): O(the two sets' sizes) per boundary, no sort."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, str], np.ndarray] = {}
        self.mask = np.zeros(0, bool)

    def columns(self, instance: int, ids: tuple) -> list:
        """A boundary's id sets in `ID_FIELDS` order -> its file columns' (`FILE_ID_COLUMNS`)."""
        out = []
        for f, a in zip(ID_FIELDS, ids):
            out.extend(self.changes(instance, f, a) if f in CHANGED_FIELDS else (a,))
        return out

    def changes(self, instance: int, field: str, ids) -> tuple[np.ndarray, np.ndarray]:
        """(joined, left): of `ids`, those not in the instance's previous set of `field`; of that set, those not
        in `ids`."""
        now = np.asarray(ids, np.int64).ravel()
        before = self.last.get((instance, field), _NONE)
        self.last[(instance, field)] = now
        if not (now.size or before.size):
            return now, before
        try:
            return self._changes(now, before)
        except IndexError:  # an id past the mask: make room for it (the mask is all false again)
            top = max(int(now.max(initial=-1)), int(before.max(initial=-1))) + 1
            self.mask = np.zeros(max(top, 2 * self.mask.size), bool)
            return self._changes(now, before)

    def _changes(self, now: np.ndarray, before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = self.mask
        mask[before] = True
        joined = now[~mask[now]]  # an IndexError here leaves the mask to be replaced (`changes`)
        mask[before] = False
        mask[now] = True
        left = before[~mask[before]]
        mask[now] = False
        return joined, left


_NONE = np.empty(0, np.int64)


def read_decisions(path) -> list[BoundaryDecision]:
    """decisions.csv as the trace it was written from (`trace_of`), each running set replayed from its changes."""
    running: dict[tuple[int, str], set[int]] = {}
    trace = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            values: dict = {}
            for f in COLUMNS:
                if f in CHANGED_FIELDS:
                    now = running.setdefault((int(row["instance"]), f), set())
                    now.difference_update(ids_of(row[f"{f}_left"]))
                    now.update(ids_of(row[f"{f}_joined"]))
                    values[f] = tuple(sorted(now))
                elif f in ID_FIELDS:
                    values[f] = ids_of(row[f])
                else:
                    values[f] = int(row[f]) if f in ("instance", "steps", "micro_batch") else row[f]
            trace.append(BoundaryDecision(**values))
    return trace


def _unsorted(summary) -> tuple[tuple, tuple]:
    """A record's decision as `DeferredDecision.unsorted`, its folded idle changes added (the union, sorted, as
    `BoundaryDecision.merged` makes it); an already built `BoundaryDecision` as its tuples."""
    if isinstance(summary, DeferredDecision):
        ids, values = summary.unsorted()
        folded = summary.folded
        if folded is not None:
            ids = tuple(np.union1d(np.asarray(a, np.int64).ravel(), np.asarray(getattr(folded, f), np.int64))
                        if f in FOLDED_FIELDS else a for f, a in zip(ID_FIELDS, ids))
        return ids, values
    return tuple(getattr(summary, f) for f in ID_FIELDS), tuple(getattr(summary, f) for f in SCALAR_FIELDS)


def sorted_within(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each row's ids (`ids[offsets[k]:offsets[k + 1]]`) sorted, in place. The rows out of order are found at
    once, then each is sorted by one call: the engine keeps its sets in admission order, so nearly every decode
    set is out of order, and numpy's vectorised sort of each row took a fifth of one stable sort of (row, id)
    keys."""
    rows = np.flatnonzero(np.diff(offsets) > 1)  # rows with a pair of ids
    if not rows.size:
        return ids
    down = ids[1:] < ids[:-1]
    starts = offsets[1:-1]
    down[starts[(starts > 0) & (starts < ids.size)] - 1] = False  # pairs that straddle two rows
    rows = rows[np.logical_or.reduceat(down, offsets[rows])]  # a row's pairs, and straddling ones up to the next
    for lo, hi in zip(offsets[rows].tolist(), offsets[rows + 1].tolist()):
        ids[lo:hi].sort()
    return ids


@dataclass(frozen=True)
class Difference:
    instance: int
    boundary: int               # index among that instance's boundaries
    field: str                  # first field that differs ("length": one trace ended first)
    left: BoundaryDecision | None
    right: BoundaryDecision | None

    def describe(self) -> str:
        if self.left is None or self.right is None:
            longer = "first" if self.right is None else "second"
            return f"instance {self.instance}: the {longer} trace has more boundaries, from boundary {self.boundary}"
        a, b = getattr(self.left, self.field), getattr(self.right, self.field)
        if isinstance(a, tuple):
            only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            a, b = f"+[{ranges(only_a)}]", f"+[{ranges(only_b)}]"
        return (f"instance {self.instance}, boundary {self.boundary} ({self.left.phase}): {self.field} "
                f"{a} vs {b}")


def first_difference(left: list[BoundaryDecision], right: list[BoundaryDecision]) -> Difference | None:
    """Where two traces part, per instance (instances interleave differently in time); None if equal."""
    for inst in sorted({d.instance for d in left} | {d.instance for d in right}):
        a = [d for d in left if d.instance == inst]
        b = [d for d in right if d.instance == inst]
        for k in range(max(len(a), len(b))):
            x = a[k] if k < len(a) else None
            y = b[k] if k < len(b) else None
            if x is None or y is None:
                return Difference(inst, k, "length", x, y)
            if x != y:
                name = next(f for f in COLUMNS if getattr(x, f) != getattr(y, f))
                return Difference(inst, k, name, x, y)
    return None
