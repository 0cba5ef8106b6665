"""The KV operations of one boundary, as explicit per-GPU lists a backend executes without a global view.

The engine applies a policy's `Decision` to `ClusterState` (where every sequence should be); `plan_ops` turns
what that decision touched into the moves of KV a backend must make so that its caches follow: free (finished)
and evict (dropped for recompute), yield (device -> host copy, suspended), offload (device -> host copy, runs on
host-resident), migrate (from one GPU's cache to another's, device or host copy, across nodes or not), restore
(host copy -> device, same cache), and the partition groups: join (a PARTITIONed sequence's head shards gathered
back into the lead's host copy) and split (the lead's host copy scattered over the group as head shards). A
migration says whether the destination keeps a host copy: exactly when the state counts one for the sequence after
the decision (its `host_node`), so that the caches hold the host copies the state's host accounting counts.

GPUs are global indices (the world rank of its worker under a one-process-per-GPU backend): a migration's
source can be a GPU of another instance (a suspended sequence another instance yielded on a shared node).

`KVLedger` is the engine's record of where each sequence's KV is in the backend's caches (which GPU's cache holds
it, on device or as a host copy only, split into head shards or not). It is the one global view, kept on the
engine's side: `plan_ops` diffs only the sequences a decision touched against it, and `KVLedger.apply` checks
every op against it before recording it, so an impossible op (restore of a sequence that is not on host there,
a migration from a GPU that does not hold it) fails with the id and the GPU, before any backend moves a tensor.

Execution order within a boundary is the order of `KVOps`' fields: join, free, evict, yield, offload, migrate,
restore, split; then the run (prefill or chunks, and decode). A sequence is in at most one of free / evict /
yield / offload / migrate / restore per boundary, at most one join and one split.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from batchgen.core.sequences import FINISHED, PENDING, SUSPENDED, InvariantError

_I = np.empty(0, np.int64)
_B = np.empty(0, bool)
for _a in (_I, _B):
    _a.flags.writeable = False

def _ints():
    return field(default_factory=lambda: _I)


def _flags():
    return field(default_factory=lambda: _B)


MOVE_KINDS = ("free", "evict", "yield", "offload", "migrate", "restore")  # at most one per sequence per boundary


@dataclass(frozen=True)
class KVOps:
    """One boundary's KV moves, as arrays (one row per op, a GPU column each), in execution order."""

    gpus: np.ndarray                 # the instance's GPUs (a partition group is a run of them, wrapping)
    join_ids: np.ndarray = _ints()        # gather head shards back into the lead's host copy ...
    join_lead: np.ndarray = _ints()
    join_degree: np.ndarray = _ints()
    join_keep: np.ndarray = _flags()       # ... or (False) drop them: the sequence finished or is evicted
    free_ids: np.ndarray = _ints()        # finished: drop device pages and host copy
    free_gpu: np.ndarray = _ints()
    evict_ids: np.ndarray = _ints()       # evicted (recompute): drop device pages and host copy
    evict_gpu: np.ndarray = _ints()
    yield_ids: np.ndarray = _ints()       # YIELD: device -> host copy, pages freed; the sequence is suspended
    yield_gpu: np.ndarray = _ints()
    offload_ids: np.ndarray = _ints()     # device -> host copy, pages freed; the sequence runs on host-resident
    offload_gpu: np.ndarray = _ints()
    migrate_ids: np.ndarray = _ints()     # MIGRATE: the KV leaves src's cache for dst's ...
    migrate_src: np.ndarray = _ints()
    migrate_dst: np.ndarray = _ints()
    migrate_cross: np.ndarray = _flags()   # ... over the network (another node) or within the node
    migrate_to_device: np.ndarray = _flags()  # loaded into dst's device pages, or kept as a host copy there
    migrate_host_copy: np.ndarray = _flags()  # dst keeps a host copy (the state counts one: its host_node >= 0)
    restore_ids: np.ndarray = _ints()     # COMBINE: host copy -> device pages in the same cache
    restore_gpu: np.ndarray = _ints()
    split_ids: np.ndarray = _ints()       # PARTITION: the lead's host copy scattered as head shards over the group
    split_lead: np.ndarray = _ints()
    split_degree: np.ndarray = _ints()

    def empty(self) -> bool:
        return not (self.join_ids.size or self.free_ids.size or self.evict_ids.size or self.yield_ids.size
                    or self.offload_ids.size or self.migrate_ids.size or self.restore_ids.size or self.split_ids.size)

    def _host_copy(self) -> np.ndarray:
        """migrate_host_copy, or (a plan written without it) a host copy wherever the KV lands on host only."""
        return self.migrate_host_copy if self.migrate_host_copy.size == self.migrate_ids.size else \
            ~self.migrate_to_device

    def migrations(self) -> list[tuple[int, int, int, bool, bool, bool]]:
        """(id, source GPU, destination GPU, to device, host copy kept, across nodes) of each migration, in plan
        order."""
        return list(zip(self.migrate_ids.tolist(), self.migrate_src.tolist(), self.migrate_dst.tolist(),
                        self.migrate_to_device.tolist(), self._host_copy().tolist(), self.migrate_cross.tolist(),
                        strict=True))

    def group(self, lead: int, degree: int) -> list[int]:
        """A partition group's GPUs: the lead and the next degree - 1 GPUs of its instance (wrapping)."""
        rank = int(np.flatnonzero(self.gpus == lead)[0])
        return [int(self.gpus[(rank + j) % self.gpus.size]) for j in range(degree)]

    def for_gpu(self, gpu: int) -> "GpuOps":
        """What one GPU's worker does: its own cache's ops, migrations it sends or receives, and the partition
        groups it is a member of."""
        def mine(ids, where):
            return ids[where == gpu].tolist()

        def groups(ids, lead, degree, extra=None):
            out = []
            for i, (sid, l, d) in enumerate(zip(ids.tolist(), lead.tolist(), degree.tolist())):
                g = self.group(l, d)
                if gpu in g:
                    out.append((sid, tuple(g)) + (() if extra is None else (bool(extra[i]),)))
            return out

        send = self.migrate_src == gpu
        recv = self.migrate_dst == gpu
        return GpuOps(
            gpu=gpu, join=groups(self.join_ids, self.join_lead, self.join_degree, self.join_keep),
            free=mine(self.free_ids, self.free_gpu), evict=mine(self.evict_ids, self.evict_gpu),
            yield_=mine(self.yield_ids, self.yield_gpu), offload=mine(self.offload_ids, self.offload_gpu),
            send=list(zip(self.migrate_ids[send].tolist(), self.migrate_dst[send].tolist(),
                          self.migrate_cross[send].tolist())),
            receive=list(zip(self.migrate_ids[recv].tolist(), self.migrate_src[recv].tolist(),
                             self.migrate_cross[recv].tolist(), self.migrate_to_device[recv].tolist(),
                             self._host_copy()[recv].tolist())),
            restore=mine(self.restore_ids, self.restore_gpu),
            split=groups(self.split_ids, self.split_lead, self.split_degree))


@dataclass
class GpuOps:
    """One GPU's share of a boundary (lists of plain ints, as a worker process would receive them)."""

    gpu: int
    join: list = field(default_factory=list)     # (id, group GPUs, keep)
    free: list = field(default_factory=list)     # ids
    evict: list = field(default_factory=list)
    yield_: list = field(default_factory=list)
    offload: list = field(default_factory=list)
    send: list = field(default_factory=list)     # (id, destination GPU, across nodes)
    receive: list = field(default_factory=list)  # (id, source GPU, across nodes, to device, host copy kept)
    restore: list = field(default_factory=list)
    split: list = field(default_factory=list)    # (id, group GPUs)
    prefill: list = field(default_factory=list)  # ids: whole contexts (prompt + generated, for a recompute)
    chunks: list = field(default_factory=list)   # (id, start, length) of chunked prefill
    decode: list = field(default_factory=list)   # ids


class KVLedger:
    """Where each sequence's KV is in the backend's caches, as the ops so far have put it: the GPU whose cache
    holds it (-1: nowhere), whether on device pages (else a host copy only), and the degree of its head shards
    (0: not split; the lead is the holder). One per `ClusterState` (`of`), shared by its instances' loops."""

    _by_state: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, num_sequences: int, num_instances: int, gpu_node: np.ndarray):
        self.holder = np.full(num_sequences, -1, np.int64)
        self.on_device = np.zeros(num_sequences, bool)
        self.split = np.zeros(num_sequences, np.int64)
        self.gpu_node = gpu_node
        self._finished = [[] for _ in range(num_instances)]  # freed at the instance's next boundary

    @classmethod
    def of(cls, state) -> "KVLedger":
        ledger = cls._by_state.get(state)
        if ledger is None:
            ledger = cls._by_state[state] = cls(len(state.table), state.topo.num_instances, state.topo.gpu_node)
        return ledger

    def finished(self, instance: int, ids: np.ndarray) -> None:
        """Sequences that ended in a run: their KV is freed at the instance's next boundary."""
        if ids.size:
            self._finished[instance].append(ids)

    def take_finished(self, instance: int) -> np.ndarray:
        parts, self._finished[instance] = self._finished[instance], []
        return np.concatenate(parts) if parts else _I

    def where(self, sid: int) -> str:
        h = int(self.holder[sid])
        if h < 0:
            return "held nowhere"
        return (f"on GPU {h}'s " + ("device" if self.on_device[sid] else "host copy")
                + (f", split over {int(self.split[sid])} GPUs" if self.split[sid] else ""))

    # ---- checking and recording ops ------------------------------------------------------------------
    def _fail(self, ok: np.ndarray, ids: np.ndarray, gpus: np.ndarray, what: str) -> None:
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            sid = int(ids[i])
            raise InvariantError(f"{what} of sequence {sid} on GPU {int(gpus[i])}: its KV is {self.where(sid)}")

    def apply(self, ops: KVOps, fresh_ids: np.ndarray = _I, fresh_gpu: np.ndarray = _I,
              fresh_to_host: np.ndarray | bool = False) -> None:
        """Check every op against where the KV is, in execution order, and record its effect. `fresh_*`: the
        run's prefills and first chunks (KV written from scratch on that GPU; to_host: yielded after it). A failed
        check raises InvariantError (the run stops there; the ledger may hold the ops before the bad one)."""
        moved = np.concatenate([ops.free_ids, ops.evict_ids, ops.yield_ids, ops.offload_ids, ops.migrate_ids,
                                ops.restore_ids])
        if moved.size > 1:
            s = np.sort(moved)
            twice = s[1:][s[1:] == s[:-1]]
            if twice.size:
                sid = int(twice[0])
                kinds = [k for k in MOVE_KINDS if (getattr(ops, f"{k}_ids") == sid).any()]
                how = " and ".join(kinds) if len(kinds) > 1 else f"{kinds[0]} twice"
                raise InvariantError(f"sequence {sid} is in {how} in one boundary: at most one KV move per sequence "
                                     "per boundary")
        for name, ids in (("join", ops.join_ids), ("split", ops.split_ids)):
            if ids.size != np.unique(ids).size:
                raise InvariantError(f"a sequence is in two {name} ops in one boundary: {ids.tolist()}")
        h, dev, sp = self.holder, self.on_device, self.split
        ids = ops.join_ids
        if ids.size:
            self._fail((h[ids] == ops.join_lead) & (sp[ids] == ops.join_degree), ids, ops.join_lead,
                       "join (shards back to the lead)")
            sp[ids] = 0
        for kind, ids, gpus in (("free", ops.free_ids, ops.free_gpu), ("evict", ops.evict_ids, ops.evict_gpu)):
            if ids.size:
                self._fail((h[ids] == gpus) & (sp[ids] == 0), ids, gpus, kind)
                h[ids], dev[ids] = -1, False
        for kind, ids, gpus in (("yield", ops.yield_ids, ops.yield_gpu), ("offload", ops.offload_ids,
                                                                         ops.offload_gpu)):
            if ids.size:
                self._fail((h[ids] == gpus) & dev[ids], ids, gpus, f"{kind} (device -> host)")
                dev[ids] = False
        ids = ops.migrate_ids
        if ids.size:
            self._fail((h[ids] == ops.migrate_src) & (sp[ids] == 0), ids, ops.migrate_src, "migrate from")
            self._fail(ops.migrate_src != ops.migrate_dst, ids, ops.migrate_dst, "migrate to its own")
            cross = self.gpu_node[ops.migrate_src] != self.gpu_node[ops.migrate_dst]
            self._fail(cross == ops.migrate_cross, ids, ops.migrate_dst, "migrate (wrong across-nodes flag)")
            h[ids], dev[ids] = ops.migrate_dst, ops.migrate_to_device
        ids = ops.restore_ids
        if ids.size:
            self._fail((h[ids] == ops.restore_gpu) & ~dev[ids] & (sp[ids] == 0), ids, ops.restore_gpu,
                       "restore (host -> device)")
            dev[ids] = True
        ids = ops.split_ids
        if ids.size:
            self._fail((h[ids] == ops.split_lead) & ~dev[ids] & (sp[ids] == 0), ids, ops.split_lead,
                       "split (head shards from the lead's host copy)")
            sp[ids] = ops.split_degree
        if fresh_ids.size:
            self._fail(h[fresh_ids] < 0, fresh_ids, fresh_gpu, "prefill (KV written from scratch)")
            h[fresh_ids], dev[fresh_ids] = fresh_gpu, ~np.asarray(fresh_to_host, bool)

    def check_running(self, ids: np.ndarray, gpus: np.ndarray, device: np.ndarray, degree: np.ndarray) -> None:
        """Sequences about to run: held by their GPU, on device exactly when the state runs them
        device-resident, split exactly as partitioned."""
        self._fail(self.holder[ids] == gpus, ids, gpus, "run")
        self._fail(self.on_device[ids] == device, ids, gpus, "run " + "device-resident / host-resident")
        self._fail(np.where(degree > 1, degree, 0) == self.split[ids], ids, gpus, "run partitioned")


def plan_ops(state, ledger: KVLedger, instance: int, touched: np.ndarray, fresh_ids: np.ndarray = _I,
             moved: np.ndarray = _I) -> KVOps:
    """The KV moves that take the `touched` sequences from where the ledger has their KV to where the state
    (after the decision) runs or keeps them. `fresh_ids` (prefills, first chunks) are to hold no KV before the
    run writes it (an evicted one's old KV is dropped). Derived from the ledger's view: the ops are checked
    against it again by `KVLedger.apply`, which a hand-written (or broadcast) plan goes through too.

    Migrations are carried out one at a time in plan order, so their order matters where a destination is full:
    the running sequences the state MIGRATEd (`moved`, in the order `ClusterState.move_running` carried them out,
    each arrival within the pages its destination has then) come first, in that order; then resumes on another
    GPU (they only arrive: any order fits), by id."""
    gpus = state.instance_gpus(instance)
    if not touched.size:
        return KVOps(gpus)
    t = state.table
    ids = np.unique(touched)
    where, tp, hosted = t.where[ids].astype(np.int64), t.tp[ids].astype(np.int64), t.host_resident[ids]
    fresh = np.isin(ids, fresh_ids) if fresh_ids.size else np.zeros(ids.size, bool)
    running = (where >= 0) & ~fresh
    gone = ((where == FINISHED) | (where == PENDING) | fresh)
    suspended = (where == SUSPENDED) & ~fresh
    want_dev = running & ~hosted & (tp == 1)
    want_split = np.where(running & (tp > 1), tp, 0)
    h, dev, sp = ledger.holder[ids], ledger.on_device[ids].copy(), ledger.split[ids]
    # shards of a partition the state changed (un-partitioned, moved, yielded, finished, evicted) come back first
    join = (sp > 0) & ~(running & (where == h) & (want_split == sp))
    joined = sp * ~join
    stray = (suspended | running) & (h < 0)
    if stray.any():
        sid = int(ids[stray][0])
        raise InvariantError(f"sequence {sid} is {'suspended' if where[stray][0] == SUSPENDED else 'running'} "
                             f"(state) but its KV is {ledger.where(sid)}")
    drop = gone & (h >= 0)
    evicted = where != FINISHED  # dropped for a recompute (pending again, or prefilled again now)
    same = running & (h == where)
    restore = same & want_dev & ~dev
    offload = same & ~want_dev & dev
    migrate = running & ~same
    split = (want_split > 0) & (joined != want_split)
    yields = suspended & dev
    migrate = np.flatnonzero(migrate)
    if moved.size and migrate.size > 1:  # the state's order of its moves first (a stable sort keeps ids' order)
        sorter = np.argsort(moved)
        at = sorter[np.minimum(np.searchsorted(moved, ids[migrate], sorter=sorter), moved.size - 1)]
        key = np.where(moved[at] == ids[migrate], at, moved.size)  # its place among the moves, or after them
        migrate = migrate[np.argsort(key, kind="stable")]
    dst = where[migrate]
    src = h[migrate]
    return KVOps(
        gpus, join_ids=ids[join], join_lead=h[join], join_degree=sp[join], join_keep=~gone[join],
        free_ids=ids[drop & ~evicted], free_gpu=h[drop & ~evicted], evict_ids=ids[drop & evicted],
        evict_gpu=h[drop & evicted], yield_ids=ids[yields], yield_gpu=h[yields], offload_ids=ids[offload],
        offload_gpu=h[offload], migrate_ids=ids[migrate], migrate_src=src, migrate_dst=dst,
        migrate_cross=ledger.gpu_node[src] != ledger.gpu_node[dst], migrate_to_device=want_dev[migrate],
        migrate_host_copy=t.host_node[ids[migrate]] >= 0,
        restore_ids=ids[restore], restore_gpu=h[restore], split_ids=ids[split], split_lead=where[split],
        split_degree=want_split[split])
