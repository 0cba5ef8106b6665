"""The state's memory accounts: KV pages per GPU and KV tokens per node's host memory, kept up to date by the
primitives (batchgen.core.state) and recounted from the sequence table by `check`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.core.sequences import FINISHED, PENDING, SUSPENDED, InvariantError


@dataclass
class Moves:
    """The bytes a boundary's KV ops copy, per GPU and tier (`KVOps.moves`): what the simulator turns into time."""

    h2d: np.ndarray       # host -> device (restore KV on COMBINE)
    d2h: np.ndarray       # device -> host (checkpoint KV)
    network: np.ndarray   # node -> node (MIGRATE), charged to the receiving GPU
    peer: np.ndarray      # GPU -> GPU inside a node (NVLink), charged to the receiving GPU
    local: np.ndarray     # within one GPU's memory (a shared prefix's tail copied to a taker's page)

    @classmethod
    def zeros(cls, num_gpus: int) -> "Moves":
        block = np.zeros((5, num_gpus))
        moves = cls(*block)  # one allocation, a row per tier
        moves._block = block
        return moves

    @classmethod
    def none(cls, num_gpus: int) -> "Moves":
        """No byte moved: one shared, read-only instance per GPU count, for a boundary whose decision calls no
        primitive that moves KV (most boundaries; a primitive that writes into it fails at the write)."""
        moves = _NO_MOVES.get(num_gpus)
        if moves is None:
            moves = cls.zeros(num_gpus)
            for a in (moves._block, moves.h2d, moves.d2h, moves.network, moves.peer, moves.local):
                a.flags.writeable = False
            moves._nothing = True
            _NO_MOVES[num_gpus] = moves
        return moves

    def any(self) -> bool:
        """Whether any byte moved (a backend skips pricing copies when none did)."""
        if self.__dict__.get("_nothing"):
            return False
        b = self.__dict__.get("_block")
        if (b is not None and self.h2d.base is b and self.d2h.base is b
                and self.network.base is b and self.peer.base is b and self.local.base is b):
            return bool(b.any())  # the rows are still the block's: one pass over it
        return bool(self.h2d.any() or self.d2h.any() or self.network.any() or self.peer.any() or self.local.any())

    def plus(self, other: "Moves") -> "Moves":
        """A new account of both (idle boundaries' copies carried into the next run's)."""
        out = Moves.zeros(self.h2d.size)
        for kind in ("h2d", "d2h", "network", "peer", "local"):
            getattr(out, kind)[:] = getattr(self, kind) + getattr(other, kind)
        return out


_NO_MOVES: dict[int, Moves] = {}


_FEW = 8  # ids up to which two primitives work on Python scalars (batchgen.core.few: a boundary's chunks, finishes)


def _int_sum(a: np.ndarray) -> int:
    """The exact sum of a few integers (a boundary's finished or chunked sequences' pages): Python adds a short
    list faster than numpy's reduction is called."""
    return sum(a.tolist()) if a.size <= 32 else int(a.sum())


class Accounts:
    """Pages and host tokens of `ClusterState` (which owns the attributes these methods read and write: the
    table, the capacities, `pages_used`, `host_used`, their peaks and the flags that let the hot paths skip work)."""

    # ---- memory ------------------------------------------------------------------------------------
    def group_gpus(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into ids, GPU) for every GPU that holds part of a running sequence: its own GPU, and for a
        PARTITIONed one the next tp - 1 ranks of its instance (wrapping), the group that shares its heads."""
        t = self.table
        if not self.partitioned_ever:  # nothing partitioned (usual): one GPU each
            return np.arange(ids.size), t.where[ids].astype(np.int64)
        tp = t.tp[ids].astype(np.int64)
        rep = np.repeat(np.arange(ids.size), tp)
        if rep.size == ids.size:
            return rep, t.where[ids].astype(np.int64)
        offset = np.arange(rep.size) - np.repeat(np.cumsum(tp) - tp, tp)
        lead = t.where[ids[rep]]
        inst = self.topo.gpu_instance[lead]
        rank = self.gpu_rank[lead]
        gpus = np.empty(rep.size, np.int64)
        for i in np.unique(inst):
            mine = inst == i
            members = self._instance_gpus[int(i)]
            gpus[mine] = members[(rank[mine] + offset[mine]) % members.size]
        return rep, gpus

    def group_of(self, lead: int, degree: int) -> tuple[int, ...]:
        """The GPUs of a group of `degree` led by GPU `lead` (one row of `group_gpus`): the lead and the next
        degree - 1 GPUs of its instance, wrapping."""
        members = self._instance_gpus[int(self.topo.gpu_instance[lead])]
        rank = int(self.gpu_rank[lead])
        return tuple(int(members[(rank + j) % members.size]) for j in range(int(degree)))

    def pages_needed(self, ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Pages each GPU of a running sequence's group holds for `tokens` tokens: a head shard packs tp times
        the tokens into a page (KV split by heads), a replicated latent does not."""
        if not self.partitioned_ever:  # every degree is 1
            pages = -(-np.asarray(tokens, np.int64) // self.page_tokens)
        else:
            per_page = self.page_tokens * (self.table.tp[ids].astype(np.int64) if self.kv_split_by_heads else 1)
            pages = -(-np.asarray(tokens, np.int64) // per_page)
        return self.prefix_pages_needed(ids, pages) if self.sharing else pages

    def _set_pages(self, ids: np.ndarray, pages: np.ndarray) -> None:
        t = self.table
        if ids.size and self._one_gpu_pages(ids, pages):
            return
        delta = pages - t.pages[ids]
        t.pages[ids] = pages
        self._add_pages(ids, delta)
        over = self.pages_used > self.gpu_pages
        if over.any() and self.sharing:  # prefixes no one holds make room first, as a prefix cache evicts them
            for g in np.flatnonzero(over).tolist():
                self._make_room(g)
            over = self.pages_used > self.gpu_pages
        if over.any():
            g = int(np.flatnonzero(over)[0])
            raise InvariantError(f"GPU {g} would hold {self.pages_used[g]} KV pages, capacity {self.gpu_pages[g]}: "
                                 "the policy must yield or evict before it grows")
        np.maximum(self.peak_pages, self.pages_used, out=self.peak_pages)

    def _one_gpu_pages(self, ids: np.ndarray, pages: np.ndarray) -> bool:
        """`_set_pages` where every sequence runs unpartitioned on one GPU (one rank's sequences: the usual), as
        sums instead of a scatter: the same counts (integers), the same check (only that GPU's count changed,
        and every other one was within capacity already). False, having changed nothing, elsewhere."""
        t = self.table
        if self.partitioned_ever and t.tp[ids].max() != 1:
            return False
        where = t.where[ids].tolist()  # a few ids, or one rank's: Python counts them faster than numpy is called
        g = where[0]
        if g < 0 or where.count(g) != len(where):
            return False
        used = int(self.pages_used[g]) + (_int_sum(pages) - _int_sum(t.pages[ids]))
        t.pages[ids] = pages
        self._gpu_holds(g, used)
        return True

    def _gpu_holds(self, g: int, used: int) -> None:
        """GPU g now holds `used` KV pages (a scalar path's count): within its capacity, its peak kept."""
        self.pages_used[g] = used
        if used > self.gpu_pages[g] and self.sharing:  # prefixes no one holds make room first
            used = self._make_room(g)
        if used > self.gpu_pages[g]:
            raise InvariantError(f"GPU {g} would hold {used} KV pages, capacity {self.gpu_pages[g]}: "
                                 "the policy must yield or evict before it grows")
        if used > self.peak_pages[g]:
            self.peak_pages[g] = used

    def _free_pages(self, ids: np.ndarray) -> None:
        """`_set_pages` to 0 (and a shared prefix let go): pages only fall, so no capacity or peak to check."""
        if self.sharing:
            self._let_go(ids)
        self._add_pages(ids, -self.table.pages[ids])
        self.table.pages[ids] = 0

    def _add_pages(self, ids: np.ndarray, delta: np.ndarray) -> None:
        """Each running sequence's page change `delta` counted on every GPU of its group."""
        if self.partitioned_ever:
            rep, gpus = self.group_gpus(ids)
            np.add.at(self.pages_used, gpus, delta[rep])
        else:  # one GPU each (group_gpus without its index)
            np.add.at(self.pages_used, self.table.where[ids], delta)

    def reserve(self, ids: np.ndarray, lookahead_tokens: int, context: np.ndarray | None = None) -> None:
        """Grow running device-resident sequences' pages lazily so that the next `lookahead_tokens` fit
        (host-resident ones hold no pages). `context`: the sequences' contexts where the caller has them."""
        if self.has_host_copies():  # without a host copy none is host-resident
            keep = ~self.table.host_resident[ids]
            ids, context = ids[keep], None
        if context is None:
            context = self.table.context(ids)
        need = self.pages_needed(ids, context + lookahead_tokens)
        grow = need > self.table.pages[ids]
        if grow.any():
            self._set_pages(ids[grow], need[grow])

    def _host_add(self, nodes: np.ndarray, tokens: np.ndarray) -> None:
        np.add.at(self.host_used, nodes, tokens)
        over = self.host_used > self.host_kv_tokens
        if over.any():
            n = int(np.flatnonzero(over)[0])
            raise InvariantError(f"node {n} host memory would hold {self.host_used[n]} KV tokens, "
                                 f"capacity {self.host_kv_tokens[n]}")
        np.maximum(self.peak_host, self.host_used, out=self.peak_host)
        self._host_any = bool(self.host_used.any())

    def _host_drop(self, ids: np.ndarray) -> None:
        t = self.table
        if not self.has_host_copies():
            return  # no host copy anywhere: none to drop
        keep = t.host_node[ids] >= 0
        if keep.any():
            kept = ids[keep]
            own = t.context(kept) - self._host_release(kept)  # a host prefix's tokens go with its last holder
            np.subtract.at(self.host_used, t.host_node[kept], own)
            self._host_any = bool(self.host_used.any())
            t.host_node[kept] = -1

    def reserve_host(self, instance: int, nodes: np.ndarray, tokens: np.ndarray) -> None:
        if not nodes.size:  # nothing to add (most runs): the bincount would be all zeros
            if self._reserving[instance]:
                self.host_reserved[instance] = 0
                self._reserving[instance] = False
            return
        self._reserving[instance] = True
        self.host_reserved[instance] = np.bincount(nodes, weights=tokens, minlength=self.topo.num_nodes)

    def host_committed(self, except_instance: int) -> np.ndarray:
        """Host KV in use plus what other instances' runs in flight will add."""
        if self.topo.num_instances == 1:
            return self.host_used.copy()
        others = self.host_reserved.sum(axis=0) - self.host_reserved[except_instance]  # integers: exact
        return self.host_used + others

    def has_host_copies(self) -> bool:
        """Whether any sequence has a KV copy in host memory (each holds at least one token there)."""
        return self._host_any  # kept in step by every method that changes host_used (`check` verifies it)

    # ---- invariants ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Recount everything from the table and compare with the incremental bookkeeping."""
        t = self.table
        t.check()
        if not self.partitioned_ever and np.any(t.tp != 1):
            raise InvariantError("a sequence is partitioned although the state never partitioned one")
        if not self.num_part_prefilled and t.prefilled.any():
            raise InvariantError("a chunked prefill is under way although num_part_prefilled says none is")
        running = np.flatnonzero(t.where >= 0)
        rep, gpus = self.group_gpus(running)
        counted = np.bincount(gpus, t.pages[running][rep], self.topo.num_gpus).astype(np.int64)
        if not np.array_equal(counted + self.check_prefixes(), self.pages_used):
            raise InvariantError("GPU page counts drifted from the per-sequence pages")
        if np.any(self.pages_used > self.gpu_pages):
            raise InvariantError("a GPU holds more KV pages than its capacity")
        partial = np.flatnonzero(t.prefilled)
        if partial.size and np.any(t.pages[partial] != self.pages_needed(partial, t.prefilled[partial])):
            raise InvariantError("a part-prefilled sequence must hold exactly the pages of the chunks it has written")
        host = np.flatnonzero(t.host_node >= 0)
        own = t.context(host) - (self.host_held[host] if self.host_sharing else 0)
        recount = np.bincount(t.host_node[host], own, self.topo.num_nodes) + self.check_host_prefixes()
        if not np.array_equal(recount.astype(np.int64), self.host_used):
            raise InvariantError("host KV accounting drifted from the per-sequence host copies")
        if np.any(self.host_used > self.host_kv_tokens):
            raise InvariantError("a node's host memory holds more KV than its capacity")
        if self._host_any != bool(self.host_used.any()):
            raise InvariantError("has_host_copies() drifted from the host KV in use")
        places = np.zeros(len(t), np.int64)
        for q in [*self.pending, *self.pinned]:
            ids = q.to_array()
            places[ids] += 1
            if np.any(t.where[ids] != PENDING):
                raise InvariantError("a queued sequence is not marked pending")
        for node, q in enumerate(self.suspended):
            ids = q.to_array()
            places[ids] += 1
            if np.any(t.where[ids] != SUSPENDED) or np.any(t.host_node[ids] != node):
                raise InvariantError(f"node {node}'s pool holds a sequence that is not suspended there")
        for inst, ids in enumerate(self.active):
            places[ids] += 1
            if np.any(t.where[ids] < 0) or np.any(self.topo.gpu_instance[t.where[ids]] != inst):
                raise InvariantError(f"instance {inst}'s active set holds a sequence not running on it")
            hr = ids[t.host_resident[ids]]
            if np.any(t.host_node[hr] != self.topo.gpu_node[t.where[hr]]):
                raise InvariantError(f"instance {inst}: a host-resident sequence's KV is not on its GPU's node")
        for ids in self.prefilling:
            places[ids] += 1
            if np.any(t.where[ids] != PENDING):
                raise InvariantError("a sequence being prefilled to host is not marked pending")
        places[t.where == FINISHED] += 1
        if np.any(places != 1):
            bad = np.flatnonzero(places != 1)[:5]
            raise InvariantError(f"sequences {bad.tolist()} are in {places[bad].tolist()} places, not exactly one")
        if self.num_finished != int((t.where == FINISHED).sum()):
            raise InvariantError("finished count drifted")
