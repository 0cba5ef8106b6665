"""The KV operations of one boundary, as explicit per-GPU lists a backend executes without a global view.

The engine applies a policy's `Decision` to `ClusterState` (where every sequence should be); `plan_ops` turns
what that decision touched into the moves of KV a backend must make so that its caches follow: free (finished)
and evict (dropped for recompute), yield (device -> host copy, suspended), offload (device -> host copy, runs on
host-resident), migrate (from one GPU's cache to another's, device or host copy, across nodes or not), restore
(host copy -> device, same cache), and the partition groups (batchgen.core.reshard): join (a PARTITIONed sequence
leaves its group: its shards are dropped with a finished or evicted sequence, or, when it is yielded, gathered into
its lead and written into the lead's host copy, as far as that copy lacks them) and reshard (a running sequence's
group changes: split, join back to one GPU, another degree, another lead; each GPU of the new group receives the
part of its shard it lacks, device to device, and the lead's host copy follows the lead). A migration says whether
the destination keeps a host copy: exactly when the state counts one for the sequence after the decision (its
`host_node`), so that the caches hold the host copies the state's host accounting counts.

GPUs are global indices (the world rank of its worker under a one-process-per-GPU backend): a migration's
source can be a GPU of another instance (a suspended sequence another instance yielded on a shared node).

`KVLedger` is the engine's record of where each sequence's KV is in the backend's caches (which GPU's cache holds
it, on device or as a host copy only, split into head shards or not). It is the one global view, kept on the
engine's side: `plan_ops` diffs only the sequences a decision touched against it, and `KVLedger.apply` checks
every op against it before recording it, so an impossible op (restore of a sequence that is not on host there,
a migration from a GPU that does not hold it) fails with the id and the GPU, before any backend moves a tensor.

Execution order within a boundary is the order of `KVOps`' fields: join, free, evict, yield, offload, migrate,
restore, reshard; then the run (prefill or chunks, and decode). A sequence is in at most one of free / evict /
yield / offload / migrate / restore per boundary, at most one join, and at most two reshards (a partitioned
sequence's group moves to its new lead, then changes degree there: the state's MIGRATE, then its PARTITION).
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
    join_ids: np.ndarray = _ints()        # a PARTITIONed sequence leaves its group (lead, degree) ...
    join_lead: np.ndarray = _ints()
    join_degree: np.ndarray = _ints()
    join_to_host: np.ndarray = _flags()    # ... yielded: what the lead's host copy lacks is gathered into it; else
    #                                        finished or evicted: every GPU drops its shard, the lead its host copy
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
    reshard_ids: np.ndarray = _ints()     # PARTITION: a running sequence's group (lead, degree; 1: the lead's pages)
    reshard_lead: np.ndarray = _ints()
    reshard_degree: np.ndarray = _ints()
    reshard_to_lead: np.ndarray = _ints()     # ... becomes (to_lead, to_degree), device to device (core.reshard)
    reshard_to_degree: np.ndarray = _ints()
    reshard_host_copy: np.ndarray = _flags()  # the lead holds a host copy (it follows a new lead)
    gpu_node: np.ndarray = _ints()        # node of each of `gpus` (the tier of a partition's pieces)

    def empty(self) -> bool:
        return not (self.join_ids.size or self.free_ids.size or self.evict_ids.size or self.yield_ids.size
                    or self.offload_ids.size or self.migrate_ids.size or self.restore_ids.size
                    or self.reshard_ids.size)

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

    def reshards(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...], bool]]:
        """(id, old group, new group, host copy) of each reshard, in plan order (groups: GPUs, lead first)."""
        return [(sid, tuple(self.group(a, d)), tuple(self.group(b, e)), bool(h)) for sid, a, d, b, e, h in zip(
            self.reshard_ids.tolist(), self.reshard_lead.tolist(), self.reshard_degree.tolist(),
            self.reshard_to_lead.tolist(), self.reshard_to_degree.tolist(), self.reshard_host_copy.tolist(),
            strict=True)]

    def nodes(self) -> dict[int, int]:
        """{GPU: node} of the instance's GPUs (`plan_ops` gives them; a plan with partition ops needs them)."""
        if self.gpu_node.size != self.gpus.size:
            raise InvariantError("a plan with partition ops must name its GPUs' nodes (gpu_node): the tiers of the "
                                 "parts it moves depend on them")
        return dict(zip(self.gpus.tolist(), self.gpu_node.tolist()))

    def for_gpu(self, gpu: int) -> "GpuOps":
        """What one GPU's worker does: its own cache's ops, migrations it sends or receives, and the partition
        groups it is a member of (before or after a reshard)."""
        def mine(ids, where):
            return ids[where == gpu].tolist()

        joins = []
        for sid, lead, degree, to_host in zip(self.join_ids.tolist(), self.join_lead.tolist(),
                                              self.join_degree.tolist(), self.join_to_host.tolist()):
            group = tuple(self.group(lead, degree))
            if gpu in group:
                joins.append((sid, group, bool(to_host)))
        reshards = [r for r in self.reshards() if gpu in r[1] or gpu in r[2]]
        send = self.migrate_src == gpu
        recv = self.migrate_dst == gpu
        return GpuOps(
            gpu=gpu, join=joins,
            free=mine(self.free_ids, self.free_gpu), evict=mine(self.evict_ids, self.evict_gpu),
            yield_=mine(self.yield_ids, self.yield_gpu), offload=mine(self.offload_ids, self.offload_gpu),
            send=list(zip(self.migrate_ids[send].tolist(), self.migrate_dst[send].tolist(),
                          self.migrate_cross[send].tolist())),
            receive=list(zip(self.migrate_ids[recv].tolist(), self.migrate_src[recv].tolist(),
                             self.migrate_cross[recv].tolist(), self.migrate_to_device[recv].tolist(),
                             self._host_copy()[recv].tolist())),
            restore=mine(self.restore_ids, self.restore_gpu), reshard=reshards,
            nodes=self.nodes() if joins or reshards else {})


@dataclass
class GpuOps:
    """One GPU's share of a boundary (lists of plain ints, as a worker process would receive them)."""

    gpu: int
    join: list = field(default_factory=list)     # (id, group GPUs, to host)
    free: list = field(default_factory=list)     # ids
    evict: list = field(default_factory=list)
    yield_: list = field(default_factory=list)
    offload: list = field(default_factory=list)
    send: list = field(default_factory=list)     # (id, destination GPU, across nodes)
    receive: list = field(default_factory=list)  # (id, source GPU, across nodes, to device, host copy kept)
    restore: list = field(default_factory=list)
    reshard: list = field(default_factory=list)  # (id, old group GPUs, new group GPUs, host copy)
    nodes: dict = field(default_factory=dict)    # {GPU: node} of the instance, where it has joins or reshards
    prefill: list = field(default_factory=list)  # ids: whole contexts (prompt + generated, for a recompute)
    chunks: list = field(default_factory=list)   # (id, start, length) of chunked prefill
    decode: list = field(default_factory=list)   # ids


class KVLedger:
    """Where each sequence's KV is in the backend's caches, as the ops so far have put it: the GPU whose cache
    holds it (-1: nowhere), whether on device (pages, or the group's shards; else a host copy only), and the degree
    of its shards (0: not split; the lead is the holder). One per `ClusterState` (`of`), shared by its instances'
    loops."""

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
        if ops.join_ids.size != np.unique(ops.join_ids).size:
            raise InvariantError(f"a sequence is in two join ops in one boundary: {ops.join_ids.tolist()}")
        if np.intersect1d(ops.join_ids, ops.reshard_ids).size or (
                np.unique(ops.reshard_ids, return_counts=True)[1] > 2).any():
            raise InvariantError(f"a sequence leaves its group and is resharded, or is resharded more than twice, in "
                                 f"one boundary: joins {ops.join_ids.tolist()}, reshards {ops.reshard_ids.tolist()}")
        h, dev, sp = self.holder, self.on_device, self.split
        ids = ops.join_ids
        if ids.size:
            self._fail((h[ids] == ops.join_lead) & (sp[ids] == ops.join_degree) & (ops.join_degree > 1), ids,
                       ops.join_lead, "join (the group's shards)")
            sp[ids] = 0
            dev[ids] = False  # on the lead's host copy (yielded), or dropped everywhere
            h[ids] = np.where(ops.join_to_host, h[ids], -1)
        for kind, ids, gpus in (("free", ops.free_ids, ops.free_gpu), ("evict", ops.evict_ids, ops.evict_gpu)):
            if ids.size:
                self._fail((h[ids] == gpus) & (sp[ids] == 0), ids, gpus, kind)
                h[ids], dev[ids] = -1, False
        for kind, ids, gpus in (("yield", ops.yield_ids, ops.yield_gpu), ("offload", ops.offload_ids,
                                                                         ops.offload_gpu)):
            if ids.size:
                self._fail((h[ids] == gpus) & dev[ids] & (sp[ids] == 0), ids, gpus, f"{kind} (device -> host)")
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
        for i, sid in enumerate(ops.reshard_ids.tolist()):  # one by one: a second reshard starts where the first ends
            row = slice(i, i + 1)
            lead, degree = ops.reshard_lead[row], ops.reshard_degree[row]
            to_lead, to_degree = ops.reshard_to_lead[row], ops.reshard_to_degree[row]
            self._fail((h[sid] == lead) & dev[sid] & (max(int(sp[sid]), 1) == degree), ops.reshard_ids[row], lead,
                       "reshard (a group's KV, device to device)")
            self._fail((lead != to_lead) | (degree != to_degree), ops.reshard_ids[row], lead, "reshard to its group")
            h[sid], sp[sid] = int(to_lead[0]), int(to_degree[0]) if to_degree[0] > 1 else 0
        if fresh_ids.size:
            self._fail(h[fresh_ids] < 0, fresh_ids, fresh_gpu, "prefill (KV written from scratch)")
            h[fresh_ids], dev[fresh_ids] = fresh_gpu, ~np.asarray(fresh_to_host, bool)

    def check_running(self, ids: np.ndarray, gpus: np.ndarray, device: np.ndarray, degree: np.ndarray) -> None:
        """Sequences about to run: held by their GPU, on device (pages or shards) exactly when the state runs them
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

    A PARTITIONed sequence's group changes as the state's primitives change it, in their order: MIGRATE moves the
    group to its new lead at its degree, then PARTITION changes the degree there (a reshard each); one that stops
    running leaves its group (join: dropped, or gathered into its lead's host copy when suspended).

    Migrations are carried out one at a time in plan order, so their order matters where a destination is full:
    the running sequences the state MIGRATEd (`moved`, in the order `ClusterState.move_running` carried them out,
    each arrival within the pages its destination has then) come first, in that order; then resumes on another
    GPU (they only arrive: any order fits), by id."""
    gpus = state.instance_gpus(instance)
    nodes = ledger.gpu_node[gpus]
    if not touched.size:
        return KVOps(gpus, gpu_node=nodes)
    t = state.table
    ids = np.unique(touched)
    where, tp, hosted = t.where[ids].astype(np.int64), t.tp[ids].astype(np.int64), t.host_resident[ids]
    fresh = np.isin(ids, fresh_ids) if fresh_ids.size else np.zeros(ids.size, bool)
    running = (where >= 0) & ~fresh
    gone = ((where == FINISHED) | (where == PENDING) | fresh)
    suspended = (where == SUSPENDED) & ~fresh
    want_dev = running & ~hosted
    h, dev, sp = ledger.holder[ids].copy(), ledger.on_device[ids].copy(), ledger.split[ids]
    stray = (suspended | running) & (h < 0)
    if stray.any():
        sid = int(ids[stray][0])
        raise InvariantError(f"sequence {sid} is {'suspended' if where[stray][0] == SUSPENDED else 'running'} "
                             f"(state) but its KV is {ledger.where(sid)}")
    # a partition that stops running leaves its group first: dropped (finished, evicted) or into the lead's host copy
    join = (sp > 0) & ~running
    join_lead = h[join]
    h[join & gone] = -1
    dev[join] = False
    # a partition that runs on: its group follows its lead (MIGRATE), then changes degree (PARTITION)
    regroup = (sp > 0) & running
    move = regroup & (h != where)
    drop = gone & (h >= 0)
    evicted = where != FINISHED  # dropped for a recompute (pending again, or prefilled again now)
    same = running & ((h == where) | regroup)
    restore = same & want_dev & ~dev
    offload = same & ~want_dev & dev
    migrate = running & ~same
    yields = suspended & dev
    degree = np.maximum(sp, 1)  # 1: the whole KV in the holder's pages
    change = running & (degree != tp)
    # reshards, each sequence's in order: its group's move at its degree, then its degree change at the new lead
    group_moves, changed = np.flatnonzero(move), np.flatnonzero(change)
    rows = np.concatenate([group_moves, changed])
    is_move = np.arange(rows.size) < group_moves.size
    order = np.argsort(rows, kind="stable")
    rows, is_move = rows[order], is_move[order]
    r_lead = np.where(is_move, h[rows], where[rows])
    r_to_degree = np.where(is_move, degree[rows], tp[rows])
    migrate = np.flatnonzero(migrate)
    if moved.size and migrate.size > 1:  # the state's order of its moves first (a stable sort keeps ids' order)
        sorter = np.argsort(moved)
        at = sorter[np.minimum(np.searchsorted(moved, ids[migrate], sorter=sorter), moved.size - 1)]
        key = np.where(moved[at] == ids[migrate], at, moved.size)  # its place among the moves, or after them
        migrate = migrate[np.argsort(key, kind="stable")]
    dst = where[migrate]
    src = h[migrate]
    return KVOps(
        gpus, join_ids=ids[join], join_lead=join_lead, join_degree=sp[join],
        join_to_host=suspended[join],
        free_ids=ids[drop & ~evicted], free_gpu=h[drop & ~evicted], evict_ids=ids[drop & evicted],
        evict_gpu=h[drop & evicted], yield_ids=ids[yields], yield_gpu=h[yields], offload_ids=ids[offload],
        offload_gpu=h[offload], migrate_ids=ids[migrate], migrate_src=src, migrate_dst=dst,
        migrate_cross=ledger.gpu_node[src] != ledger.gpu_node[dst], migrate_to_device=want_dev[migrate],
        migrate_host_copy=t.host_node[ids[migrate]] >= 0,
        restore_ids=ids[restore], restore_gpu=h[restore], reshard_ids=ids[rows], reshard_lead=r_lead,
        reshard_degree=degree[rows], reshard_to_lead=where[rows], reshard_to_degree=r_to_degree,
        reshard_host_copy=t.host_node[ids[rows]] >= 0, gpu_node=nodes)
