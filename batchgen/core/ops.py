"""The KV operations of one boundary, as explicit per-GPU lists a backend executes without a global view.

The state's primitives emit them as they carry out a policy's `Decision` (batchgen.core.oplog): the moves of KV
a backend must make so that its caches follow the state: free (finished)
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

`KVOps.moves` is what the ops copy, per GPU and tier: the simulator prices exactly that, and the executors count
the same bytes from their tensors (tests/exec/test_priced_equals_performed.py).

`KVLedger` is a checker: the engine's record of where each sequence's KV is in the backend's caches (which GPU's
cache holds it, on device or as a host copy only, split into head shards or not), kept where a backend moves real
KV or invariants are checked. `KVLedger.apply` checks every op against it before recording it, so an impossible op
(restore of a sequence that is not on host there, a migration from a GPU that does not hold it) fails with the id
and the GPU, before any backend moves a tensor.

Execution order within a boundary is the order of `KVOps`' fields: unshare (a shared prompt prefix dropped), join,
free, evict, yield, offload, migrate, restore, reshard, share (a shared prompt prefix created or taken:
batchgen.core.prefix_pages), untail (a prefix's tail page freed, after the takers that copy it); then the run
(prefill or chunks, and decode). A sequence is in at most one of free / evict / yield / offload / migrate / restore
per boundary, at most one join, and at most two reshards (a partitioned sequence's group moves to its new lead, then
changes degree there: the state's MIGRATE, then its PARTITION).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from batchgen.core.accounts import Moves
from batchgen.core.reshard import pieces
from batchgen.core.sequences import InvariantError

_I = np.empty(0, np.int64)
_B = np.empty(0, bool)
_F = np.empty(0)
for _a in (_I, _B, _F):
    _a.flags.writeable = False

def _ints():
    return field(default_factory=lambda: _I)


def _flags():
    return field(default_factory=lambda: _B)


def _floats():
    return field(default_factory=lambda: _F)


MOVE_KINDS = ("free", "evict", "yield", "offload", "migrate", "restore")  # at most one per sequence per boundary


@dataclass(frozen=True)
class KVOps:
    """One boundary's KV moves, as arrays (one row per op, a GPU column each), in execution order."""

    gpus: np.ndarray                 # the instance's GPUs (a partition group is a run of them, wrapping)
    unshare_group: np.ndarray = _ints()   # a shared prefix no one holds leaves this GPU (core.prefix_pages): its
    unshare_gpu: np.ndarray = _ints()     # pages are freed as its holders' are gone (no byte moved)
    join_ids: np.ndarray = _ints()        # a PARTITIONed sequence leaves its group (lead, degree) ...
    join_lead: np.ndarray = _ints()
    join_degree: np.ndarray = _ints()
    join_to_host: np.ndarray = _flags()    # ... yielded: what the lead's host copy lacks is gathered into it; else
    #                                        finished or evicted: every GPU drops its shard, the lead its host copy
    join_bytes: np.ndarray = _floats()     # ... the KV gathered and written down (0: the host copy is up to date)
    free_ids: np.ndarray = _ints()        # finished: drop device pages and host copy
    free_gpu: np.ndarray = _ints()
    evict_ids: np.ndarray = _ints()       # evicted (recompute): drop device pages and host copy
    evict_gpu: np.ndarray = _ints()
    yield_ids: np.ndarray = _ints()       # YIELD: device -> host copy, pages freed; the sequence is suspended
    yield_gpu: np.ndarray = _ints()
    yield_bytes: np.ndarray = _floats()   # ... what the host copy lacks (0: kept up to date by host_sync)
    offload_ids: np.ndarray = _ints()     # device -> host copy, pages freed; the sequence runs on host-resident
    offload_gpu: np.ndarray = _ints()
    offload_bytes: np.ndarray = _floats()
    migrate_ids: np.ndarray = _ints()     # MIGRATE: the KV leaves src's cache for dst's ...
    migrate_src: np.ndarray = _ints()
    migrate_dst: np.ndarray = _ints()
    migrate_cross: np.ndarray = _flags()   # ... over the network (another node) or within the node
    migrate_from_device: np.ndarray = _flags()  # from src's device pages (a running sequence) or its host copy
    migrate_to_device: np.ndarray = _flags()  # loaded into dst's device pages, or kept as a host copy there
    migrate_host_copy: np.ndarray = _flags()  # dst keeps a host copy (the state counts one: its host_node >= 0)
    migrate_bytes: np.ndarray = _floats()
    restore_ids: np.ndarray = _ints()     # COMBINE: host copy -> device pages in the same cache
    restore_gpu: np.ndarray = _ints()
    restore_bytes: np.ndarray = _floats()
    reshard_ids: np.ndarray = _ints()     # PARTITION: a running sequence's group (lead, degree; 1: the lead's pages)
    reshard_lead: np.ndarray = _ints()
    reshard_degree: np.ndarray = _ints()
    reshard_to_lead: np.ndarray = _ints()     # ... becomes (to_lead, to_degree), device to device (core.reshard)
    reshard_to_degree: np.ndarray = _ints()
    reshard_host_copy: np.ndarray = _flags()  # the lead holds a host copy (it follows a new lead)
    reshard_bytes: np.ndarray = _floats()  # the sequence's KV (each part carries its share: core.reshard)
    share_ids: np.ndarray = _ints()       # a shared prefix (batchgen.core.prefix_pages), whole pages by reference:
    share_gpu: np.ndarray = _ints()
    share_group: np.ndarray = _ints()
    share_tokens: np.ndarray = _ints()    # ... the prefix's tokens (whole pages) ...
    share_creates: np.ndarray = _flags()  # ... created: the first `tokens` tokens this pending sequence's prefill
    #                                       writes are its group's prefix on that GPU (its pages taken now); else
    #                                       taken: the pending sequence holds the group's prefix pages by reference
    #                                       and its prefill starts at `tokens` + `tail`
    share_tail: np.ndarray = _ints()      # ... tokens copied on the GPU below a page: a taker's, past `tokens`, into
    #                                       its first own page (from its prefix's tail page, or from the creator's
    #                                       rows in the forward that writes them); a creator's, its next `tail`
    #                                       tokens into a page the prefix keeps (0: none)
    share_bytes: np.ndarray = _floats()   # ... the KV those copies write (device to device on one GPU: `local`)
    share_src: np.ndarray = _ints()       # ... a created prefix copied whole from this GPU's (-1: written by the
    #                                       sequence's prefill; core.prefix_fetch), its bytes over NVLink or network
    share_parent: np.ndarray = _ints()    # ... the group whose prefix on that GPU it extends (-1: none; a copy from
    #                                       another GPU copies only the tokens past that one's)
    untail_group: np.ndarray = _ints()    # a shared prefix lets its tail's page go on this GPU (the GPU needed it;
    untail_gpu: np.ndarray = _ints()      # later takers compute those tokens): no byte moved
    gpu_node: np.ndarray = _ints()        # node of each of `gpus` (the tier of a partition's pieces)
    by_heads: bool = True                 # shards split the KV by heads (MLA's latent: replicas)

    def empty(self) -> bool:
        return not (self.join_ids.size or self.free_ids.size or self.evict_ids.size or self.yield_ids.size
                    or self.offload_ids.size or self.migrate_ids.size or self.restore_ids.size
                    or self.reshard_ids.size or self.share_ids.size or self.unshare_group.size
                    or self.untail_group.size)

    def _share_tail(self) -> np.ndarray:
        """share_tail, or (a plan written without it) none copied."""
        return self.share_tail if self.share_tail.size == self.share_ids.size else np.zeros(self.share_ids.size,
                                                                                               np.int64)

    def _share_src(self) -> np.ndarray:
        """share_src, or (a plan written without it) no prefix copied from another GPU."""
        return self.share_src if self.share_src.size == self.share_ids.size else np.full(self.share_ids.size, -1,
                                                                                             np.int64)

    def _share_parent(self) -> np.ndarray:
        """share_parent, or (a plan written without it) none extended."""
        return self.share_parent if self.share_parent.size == self.share_ids.size else np.full(self.share_ids.size,
                                                                                                   -1, np.int64)

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

    def shares(self) -> list[tuple[int, int, int, int, bool, int, int, int]]:
        """(id, GPU, group, tokens, creates, tail, source GPU, parent group) of each shared prefix's op, in plan
        order."""
        return list(zip(self.share_ids.tolist(), self.share_gpu.tolist(), self.share_group.tolist(),
                        self.share_tokens.tolist(), self.share_creates.tolist(), self._share_tail().tolist(),
                        self._share_src().tolist(), self._share_parent().tolist()))

    def resume_prefixes(self) -> dict[int, tuple[int, int]]:
        """{id: (group, prefix tokens)} of the migrations that take a prefix where they land (a resume onto another
        GPU of the node, core.prefix_pages.attach_restored): what backend=dist's source leaves unsent."""
        moving = set(self.migrate_ids.tolist())
        return {sid: (group, tokens) for sid, _, group, tokens, creates, _, src, _ in self.shares()
                if sid in moving and not creates and src < 0}

    def prefix_copies(self) -> list[tuple[int, int, int, int, int, int, bool]]:
        """(source GPU, destination GPU, group, tokens, tail, parent group, across nodes) of each prefix copied from
        another GPU (batchgen.core.prefix_fetch), in plan order: what every process of backend=dist walks alike."""
        node = self.nodes() if self.gpu_node.size == self.gpus.size else {}
        return [(src, g, group, tokens, tail, parent, node.get(src) != node.get(g))
                for _, g, group, tokens, _, tail, src, parent in self.shares() if src >= 0]

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

    def moves(self, num_gpus: int) -> Moves:
        """The bytes these ops copy, per GPU (global index) and tier, each charged to the GPU that receives it: what
        the simulator prices and what the executors copy (batchgen.exec.account counts it from the tensors).

        A yield or offload writes down what the host copy lacks (d2h); a restore reads the copy back (h2d); a
        migration crosses nodes over the network (and a device-resident arrival that keeps a host copy writes it
        again there, d2h), or within a node goes device to device (peer) from a running sequence and host to
        device (h2d) from a suspended one's host copy (a host-resident arrival moves nothing: the node's host
        memory holds it); a reshard copies the parts of the new group's shards their GPUs lack (core.reshard),
        and a host copy follows a lead that changes node (network); a join into the host copy gathers the shards
        into the lead (as a reshard to one GPU) and writes the whole KV down; a share copies a prefix's tail within
        its GPU (local), or a whole prefix from another GPU's (peer within a node, network across)."""
        if not any(getattr(self, f"{k}_bytes").size for k in ("join", "yield", "offload", "migrate", "restore",
                                                             "reshard", "share")):
            return Moves.none(num_gpus)
        m = Moves.zeros(num_gpus)
        if self.share_bytes.size:  # the tails of shared prefixes, copied on their GPU; prefixes copied from another
            src, b, dst = self._share_src(), self.share_bytes, self.share_gpu
            np.add.at(m.local, dst[src < 0], b[src < 0])
            if (src >= 0).any():
                node = self.nodes()
                for s, d, nbytes in zip(src[src >= 0].tolist(), dst[src >= 0].tolist(), b[src >= 0].tolist()):
                    (m.peer if node[s] == node[d] else m.network)[d] += nbytes
        if self.migrate_ids.size:
            b, dst, cross = _sized(self.migrate_ids, self.migrate_bytes), self.migrate_dst, self.migrate_cross
            dev, copy, from_dev = self.migrate_to_device, self._host_copy(), self.migrate_from_device
            np.add.at(m.network, dst[cross], b[cross])
            within = ~cross & dev
            np.add.at(m.peer, dst[within & from_dev], b[within & from_dev])
            np.add.at(m.h2d, dst[within & ~from_dev], b[within & ~from_dev])
            np.add.at(m.d2h, dst[cross & dev & copy], b[cross & dev & copy])
        parts = []  # (old group, new group, KV bytes) of every reshard, a gathering join's included
        if self.join_ids.size:
            b = _sized(self.join_ids, self.join_bytes)
            gather = self.join_to_host & (b > 0)
            for lead, degree, kv in zip(self.join_lead[gather].tolist(), self.join_degree[gather].tolist(),
                                        b[gather].tolist()):
                parts.append((self.group(lead, degree), [lead], kv))
            np.add.at(m.d2h, self.join_lead[gather], b[gather])
        if self.reshard_ids.size:
            b = _sized(self.reshard_ids, self.reshard_bytes)
            node = self.nodes()
            for (_, old, new, copy), kv in zip(self.reshards(), b.tolist()):
                parts.append((old, new, kv))
                if copy and node[old[0]] != node[new[0]]:  # the host copy follows its lead to another node
                    m.network[new[0]] += kv
        if parts:
            node = self.nodes()
            for old, new, kv in parts:
                for p in pieces(tuple(old), tuple(new), self.by_heads):
                    (m.peer if node[p.src] == node[p.dst] else m.network)[p.dst] += p.nbytes(kv)
        for ids, gpu, nbytes in ((self.yield_ids, self.yield_gpu, self.yield_bytes),
                                 (self.offload_ids, self.offload_gpu, self.offload_bytes)):
            np.add.at(m.d2h, gpu, _sized(ids, nbytes))
        np.add.at(m.h2d, self.restore_gpu, _sized(self.restore_ids, self.restore_bytes))
        return m

    def nodes(self) -> dict[int, int]:
        """{GPU: node} of the instance's GPUs (`OpLog.take` gives them; a plan with partition ops needs them)."""
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
            unshare=self.unshare_group[self.unshare_gpu == gpu].tolist(),
            untail=self.untail_group[self.untail_gpu == gpu].tolist(),
            share=[(sid, *rest) for sid, g, *rest in self.shares() if g == gpu],
            nodes=self.nodes() if joins or reshards else {})


def _sized(ids: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """An op kind's bytes, one per op: a plan written by hand, without them, is performed but cannot be priced."""
    if nbytes.size != ids.size:
        if not ids.size:
            return _F
        raise InvariantError("these KV ops carry no bytes (a hand-written plan): the state's primitives emit the "
                             "bytes of every op they price")
    return nbytes


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
    share: list = field(default_factory=list)    # (id, group, tokens, creates, tail, src, parent): shared prefixes
    unshare: list = field(default_factory=list)  # groups whose shared prefix leaves this GPU, first
    untail: list = field(default_factory=list)   # groups whose prefix lets its tail's page go, after the shares
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

    def __init__(self, num_sequences: int, gpu_node: np.ndarray):
        self.holder = np.full(num_sequences, -1, np.int64)
        self.on_device = np.zeros(num_sequences, bool)
        self.split = np.zeros(num_sequences, np.int64)
        self.gpu_node = gpu_node

    @classmethod
    def of(cls, state) -> "KVLedger":
        ledger = cls._by_state.get(state)
        if ledger is None:
            ledger = cls._by_state[state] = cls(len(state.table), state.topo.gpu_node)
        return ledger

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
        # taken by a restore, or a resume from another GPU's host copy: the rest of its KV copied in
        restored = np.isin(ops.share_ids, ops.restore_ids) | np.isin(ops.share_ids, ops.migrate_ids)
        if restored.any():
            ids, gpus = ops.share_ids[restored], ops.share_gpu[restored]
            self._fail((h[ids] == gpus) & dev[ids], ids, gpus, "share (a prefix taken by a restore onto that GPU)")
        taken = ~ops.share_creates & ~np.isin(ops.share_ids, fresh_ids) & ~restored  # prefilled to host: as fresh
        ids = ops.share_ids[taken] if ops.share_ids.size else _I
        if ids.size:  # a prefix taken: the KV starts on device there (a created one is written by the first chunk)
            gpus = ops.share_gpu[taken]
            self._fail(h[ids] < 0, ids, gpus, "share (a prefix taken by a pending sequence)")
            h[ids], dev[ids] = gpus, True
        if fresh_ids.size:
            self._fail(h[fresh_ids] < 0, fresh_ids, fresh_gpu, "prefill (KV written from scratch)")
            h[fresh_ids], dev[fresh_ids] = fresh_gpu, ~np.asarray(fresh_to_host, bool)

    def check_running(self, ids: np.ndarray, gpus: np.ndarray, device: np.ndarray, degree: np.ndarray) -> None:
        """Sequences about to run: held by their GPU, on device (pages or shards) exactly when the state runs them
        device-resident, split exactly as partitioned."""
        self._fail(self.holder[ids] == gpus, ids, gpus, "run")
        self._fail(self.on_device[ids] == device, ids, gpus, "run " + "device-resident / host-resident")
        self._fail(np.where(degree > 1, degree, 0) == self.split[ids], ids, gpus, "run partitioned")
