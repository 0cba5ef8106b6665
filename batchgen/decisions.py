"""Decision traces: what a policy decided at each boundary, without any time in it.

Given the same lengths and the same snapshot (same capabilities, same KV pool), the simulator and the executor
must take the same decisions at the same boundaries; only the time between boundaries differs. A trace makes
that checkable: one `BoundaryDecision` per boundary that ran something, its ids sorted, so two traces compare
with ==, and `first_difference` says where two runs parted.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields, replace
from typing import Iterable

import numpy as np

from batchgen import fastpath

IdTuple = tuple[int, ...]


def _ids(a) -> IdTuple:
    if fastpath.ENABLED:
        if (a.size if isinstance(a, np.ndarray) else len(a)) == 0:  # most id sets are empty
            return ()
        if isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iu":  # a few hundred ids: Python sorts
            return tuple(sorted(a.tolist()))                                  # them faster than numpy's call
    return tuple(np.sort(np.asarray(a, dtype=np.int64).ravel()).tolist())


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
        sets = {f: tuple(sorted(set(getattr(self, f)) | set(getattr(earlier, f)))) for f in ID_FIELDS
                if f not in ("prefilled", "chunked", "decoded", "host_resident")}
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
    writing into them; the policy's are its own). With the fast paths off the engine builds the summary at once, so
    tests/test_sim_fastpath.py compares deferred traces with eager ones."""

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

    def resolve(self) -> BoundaryDecision:
        (instance, phase, prefill_ids, chunk_ids, decode_ids, decode_host_resident, steps, stop, micro_batch,
         yield_ids, offload_ids, evict_ids, move_ids, admits, partition_ids, pin_ids, flags) = self._parts
        admitted = np.concatenate([np.asarray(a) for a in admits]) if admits else ()
        rec = BoundaryDecision(
            instance=int(instance), phase=phase, prefilled=_ids(prefill_ids), chunked=_ids(chunk_ids),
            decoded=_ids(decode_ids), host_resident=_ids(decode_ids[np.asarray(decode_host_resident, bool)]),
            yielded=_ids(yield_ids), offloaded=_ids(offload_ids), evicted=_ids(evict_ids), migrated=_ids(move_ids),
            admitted=_ids(admitted), partitioned=_ids(partition_ids), pinned=_ids(pin_ids), steps=int(steps),
            stop=str(stop), micro_batch=int(micro_batch), flags=",".join(n for n, on in flags if on))
        return rec.merged(self._folded) if self._folded is not None else rec


ID_FIELDS = tuple(f.name for f in fields(BoundaryDecision) if f.type == "IdTuple")
COLUMNS = tuple(f.name for f in fields(BoundaryDecision))


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


def trace_of(records) -> list[BoundaryDecision]:
    """The decision trace of a run's step records (engine.StepRecord), in the order they ran."""
    return [r.decision for r in records if getattr(r, "decision", None) is not None]


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
