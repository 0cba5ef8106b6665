"""Where every sequence lives, and the coroutine primitives that move it.

Both backends keep their bookkeeping here: the simulator charges time for the bytes each primitive reports,
the executor moves the tensors. Every primitive checks its preconditions, so a policy that asks for something
impossible (admit a sequence that is not suspended, overfill a GPU) fails loudly at the step that did it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen import fastpath
from batchgen.core.queues import IdQueue
from batchgen.core.sequences import FINISHED, PENDING, SUSPENDED, InvariantError, SequenceTable


@dataclass(frozen=True)
class Topology:
    """Which node and which expert-parallel instance each GPU belongs to."""

    gpu_node: np.ndarray      # node of each global GPU index
    gpu_instance: np.ndarray  # instance of each global GPU index
    num_nodes: int
    num_instances: int

    @property
    def gpu_rank(self) -> np.ndarray:
        """Rank of each GPU within its instance (GPUs of an instance in increasing order)."""
        rank = np.empty(self.gpu_instance.size, np.int64)
        for inst in range(self.num_instances):
            gpus = self.instance_gpus(inst)
            rank[gpus] = np.arange(gpus.size)
        return rank

    @property
    def num_gpus(self) -> int:
        return self.gpu_node.size

    def instance_gpus(self, instance: int) -> np.ndarray:
        return np.flatnonzero(self.gpu_instance == instance)


@dataclass
class Moves:
    """Bytes a batch of primitives moved, per GPU, for the backend to turn into time."""

    h2d: np.ndarray       # host -> device (restore KV on COMBINE)
    d2h: np.ndarray       # device -> host (checkpoint KV)
    network: np.ndarray   # node -> node (MIGRATE), charged to the receiving GPU
    peer: np.ndarray      # GPU -> GPU inside a node (NVLink), charged to the receiving GPU

    @classmethod
    def zeros(cls, num_gpus: int) -> "Moves":
        block = np.zeros((4, num_gpus))
        moves = cls(*block)  # one allocation, four rows (one per kind)
        moves._block = block
        return moves

    @classmethod
    def none(cls, num_gpus: int) -> "Moves":
        """No byte moved: one shared, read-only instance per GPU count, for a boundary whose decision calls no
        primitive that moves KV (most boundaries; a primitive that writes into it fails at the write)."""
        moves = _NO_MOVES.get(num_gpus)
        if moves is None:
            moves = cls.zeros(num_gpus)
            for a in (moves._block, moves.h2d, moves.d2h, moves.network, moves.peer):
                a.flags.writeable = False
            moves._nothing = True
            _NO_MOVES[num_gpus] = moves
        return moves

    def any(self) -> bool:
        """Whether any byte moved (a backend skips pricing copies when none did)."""
        if fastpath.ENABLED and self.__dict__.get("_nothing"):
            return False
        b = self.__dict__.get("_block")
        if (fastpath.ENABLED and b is not None and self.h2d.base is b and self.d2h.base is b
                and self.network.base is b and self.peer.base is b):
            return bool(b.any())  # the four rows are still the block's: one pass over it
        return bool(self.h2d.any() or self.d2h.any() or self.network.any() or self.peer.any())


_NO_MOVES: dict[int, Moves] = {}


_FEW = 8  # ids up to which a primitive's fast path works on Python scalars (a boundary's chunks, its finishes)


def _int_sum(a: np.ndarray) -> int:
    """The exact sum of a few integers (a boundary's finished or chunked sequences' pages): Python adds a short
    list faster than numpy's reduction is called."""
    return sum(a.tolist()) if a.size <= 32 else int(a.sum())


class ClusterState:
    def __init__(self, table: SequenceTable, topo: Topology, *, page_tokens: int, gpu_pages: np.ndarray,
                 host_kv_tokens: np.ndarray, kv_bytes_per_token: float, kv_split_by_heads: bool = True):
        """kv_split_by_heads: a PARTITIONed sequence's KV is split by heads over its group (MHA/GQA), so each
        rank of the group holds 1/degree of it; False (MLA's latent KV) replicates it on every rank."""
        self.table = table
        self.topo = topo
        self.gpu_rank = topo.gpu_rank  # computed once: the engine maps GPUs to ranks at every boundary
        self.page_tokens = int(page_tokens)
        self.gpu_pages = np.asarray(gpu_pages, dtype=np.int64)            # capacity per GPU
        self.host_kv_tokens = np.asarray(host_kv_tokens, dtype=np.int64)  # capacity per node
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.kv_split_by_heads = bool(kv_split_by_heads)
        self._instance_gpus = [topo.instance_gpus(i) for i in range(topo.num_instances)]
        for gpus in self._instance_gpus:
            gpus.flags.writeable = False  # shared by every boundary's snapshot and plan (instance_gpus)
        self._leaving = np.zeros(len(table), bool)  # scratch mask of _leave_gpu (all False between calls)
        self.node_instance = _node_instance(topo)  # computed once: every snapshot carries it
        self.pages_used = np.zeros(topo.num_gpus, np.int64)
        self.peak_pages = np.zeros(topo.num_gpus, np.int64)
        self.host_used = np.zeros(topo.num_nodes, np.int64)
        self._host_any = False  # host_used.any(), kept by the methods that change host_used (has_host_copies)
        self.peak_host = np.zeros(topo.num_nodes, np.int64)
        self.pending = [IdQueue() for _ in range(topo.num_instances)]      # not yet pinned
        self.pinned = [IdQueue() for _ in range(topo.num_gpus)]            # pending, pinned to a GPU
        self.suspended = [IdQueue() for _ in range(topo.num_nodes)]        # KV on that node's host
        self.active = [np.empty(0, np.int64) for _ in range(topo.num_instances)]
        # host KV that instances' in-flight runs will add (decode growth, prefill output), per instance and
        # node: instances sharing a node see each other's reservations, so they cannot overfill it together
        self.host_reserved = np.zeros((topo.num_instances, topo.num_nodes), np.int64)
        self._reserving = [False] * topo.num_instances  # host_reserved[i] may be nonzero (reserve_host)
        # prompts being prefilled straight to host: between their queue and the host pool for one step
        self.prefilling = [np.empty(0, np.int64) for _ in range(topo.num_instances)]
        self.num_finished = 0
        # whether any sequence was ever PARTITIONed (tp > 1): until then every running sequence holds its pages on
        # one GPU, and the page arithmetic skips the per-sequence degrees (a fast path; `check` verifies it)
        self.partitioned_ever = False
        # running sequences part-way through a chunked prefill (prefilled > 0), kept by the methods that write
        # `prefilled`: at 0 the engine skips looking for them (`check` verifies it)
        self.num_part_prefilled = 0

    # ---- placement at the start -------------------------------------------------------------------
    def assign_instances(self, instance_of_seq: np.ndarray) -> None:
        """The upper-level split of the input over instances; each instance's pool keeps input order."""
        self.table.instance[:] = instance_of_seq
        for inst in range(self.topo.num_instances):
            self.pending[inst].push(np.flatnonzero(instance_of_seq == inst))

    def pin(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> None:
        """Bind pending sequences to GPUs (what serving engines do at arrival)."""
        self.pending[instance].take_head_ids(ids)
        self.table.home_gpu[ids] = gpus
        order = np.argsort(gpus, kind="stable")
        ids, gpus = ids[order], gpus[order]
        bounds = np.flatnonzero(np.diff(gpus)) + 1
        for chunk_ids, chunk_gpus in zip(np.split(ids, bounds), np.split(gpus, bounds)):
            if chunk_ids.size:
                self.pinned[int(chunk_gpus[0])].push(chunk_ids)

    # ---- queries ---------------------------------------------------------------------------------
    def instance_gpus(self, instance: int) -> np.ndarray:
        """The instance's GPUs (global indices, increasing), computed once: a read-only array."""
        return self._instance_gpus[instance]

    def active_ids(self, instance: int) -> np.ndarray:
        return self.active[instance]

    def remaining_work(self, instance: int) -> bool:
        gpus = self._instance_gpus[instance]
        nodes = np.unique(self.topo.gpu_node[gpus])
        return bool(self.active[instance].size or len(self.pending[instance])
                    or any(len(self.pinned[g]) for g in gpus) or any(len(self.suspended[n]) for n in nodes))

    def all_finished(self) -> bool:
        return self.num_finished == len(self.table)

    # ---- memory ------------------------------------------------------------------------------------
    def group_gpus(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into ids, GPU) for every GPU that holds part of a running sequence: its own GPU, and for a
        PARTITIONed one the next tp - 1 ranks of its instance (wrapping), the group that shares its heads."""
        t = self.table
        if fastpath.ENABLED and not self.partitioned_ever:  # nothing partitioned (usual): one GPU each
            return np.arange(ids.size), t.where[ids].astype(np.int64)
        tp = t.tp[ids].astype(np.int64)
        if fastpath.ENABLED and (not tp.size or tp.max() == 1):
            return np.arange(ids.size), t.where[ids].astype(np.int64)
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

    def pages_needed(self, ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Pages each GPU of a running sequence's group holds for `tokens` tokens: a head shard packs tp times
        the tokens into a page (KV split by heads), a replicated latent does not."""
        if fastpath.ENABLED and not self.partitioned_ever:  # every degree is 1
            return -(-np.asarray(tokens, np.int64) // self.page_tokens)
        per_page = self.page_tokens * (self.table.tp[ids].astype(np.int64) if self.kv_split_by_heads else 1)
        return -(-np.asarray(tokens, np.int64) // per_page)

    def _set_pages(self, ids: np.ndarray, pages: np.ndarray) -> None:
        t = self.table
        if fastpath.ENABLED and ids.size and self._one_gpu_pages(ids, pages):
            return
        delta = pages - t.pages[ids]
        t.pages[ids] = pages
        rep, gpus = self.group_gpus(ids)
        np.add.at(self.pages_used, gpus, delta[rep])
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
        if used > self.gpu_pages[g]:
            raise InvariantError(f"GPU {g} would hold {used} KV pages, capacity {self.gpu_pages[g]}: "
                                 "the policy must yield or evict before it grows")
        if used > self.peak_pages[g]:
            self.peak_pages[g] = used

    def reserve(self, ids: np.ndarray, lookahead_tokens: int, context: np.ndarray | None = None) -> None:
        """Grow running device-resident sequences' pages lazily so that the next `lookahead_tokens` fit
        (host-resident ones hold no pages). `context`: the sequences' contexts where the caller has them."""
        if not fastpath.ENABLED or self.has_host_copies():  # without a host copy none is host-resident
            keep = ~self.table.host_resident[ids]
            ids, context = ids[keep], None
        if context is None:
            context = self.table.context(ids)
        if fastpath.ENABLED and not self.partitioned_ever:  # pages_needed, as (x + P - 1) // P for x >= 0
            need = (context + (lookahead_tokens + self.page_tokens - 1)) // self.page_tokens
        else:
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
        if fastpath.ENABLED and not self.has_host_copies():
            return  # no host copy anywhere: none to drop
        keep = t.host_node[ids] >= 0
        if keep.any():
            np.subtract.at(self.host_used, t.host_node[ids[keep]], t.context(ids[keep]))
            self._host_any = bool(self.host_used.any())
            t.host_node[ids[keep]] = -1

    # ---- primitives -----------------------------------------------------------------------------------
    def _leave_gpu(self, instance: int, ids: np.ndarray) -> None:
        self._set_pages(ids, np.zeros(ids.size, np.int64))  # frees the whole group's pages, then un-partitions
        if not fastpath.ENABLED or self.partitioned_ever:
            self.table.tp[ids] = 1
        self.table.host_resident[ids] = False
        if self.num_part_prefilled:
            self.num_part_prefilled -= int(np.count_nonzero(self.table.prefilled[ids]))
        self.table.prefilled[ids] = 0  # a chunked prefill left unfinished restarts from its first token
        # np.setdiff1d(active, ids, assume_unique=True) without its sort: keep the active order, drop ids
        active, leaving = self.active[instance], self._leaving
        if not fastpath.ENABLED:
            self.active[instance] = np.setdiff1d(active, ids, assume_unique=True)
            return
        if ids.size == 1:  # one sequence leaves (a finish, mostly): one comparison
            self.active[instance] = active[active != ids[0]]
            return
        leaving[ids] = True
        self.active[instance] = active[~leaving[active]]
        leaving[ids] = False

    def _join_gpu(self, instance: int, ids: np.ndarray, gpus: np.ndarray, lookahead_tokens: int,
                  host_resident: np.ndarray | bool = False, reserve: bool = True) -> None:
        if (self.topo.gpu_instance[gpus] != instance).any():
            raise InvariantError("a sequence can only run on a GPU of the instance that schedules it")
        self.table.where[ids] = gpus
        self.table.host_resident[ids] = host_resident
        self.table.instance[ids] = instance
        self.active[instance] = np.concatenate([self.active[instance], ids])
        if reserve:
            self.reserve(ids, lookahead_tokens)

    def _require(self, ids: np.ndarray, ok: np.ndarray, what: str) -> None:
        if not ok.all():
            raise InvariantError(f"sequences {ids[~ok][:5].tolist()} are not {what}")

    def yield_(self, instance: int, ids: np.ndarray, moves: Moves) -> None:
        """YIELD: suspend running sequences; their KV is checkpointed to their node's host memory."""
        t = self.table
        gpus = t.where[ids]
        self._require(ids, (gpus >= 0) & (self.topo.gpu_instance[np.maximum(gpus, 0)] == instance),
                      f"running on instance {instance}")
        self._require(ids, t.prefilled[ids] == 0, "done prefilling (a part-prefilled prompt has no KV to yield)")
        ctx = t.context(ids)
        nodes = self.topo.gpu_node[gpus]
        fresh = t.host_node[ids] < 0   # no host copy yet: the whole KV goes down now
        np.add.at(moves.d2h, gpus[fresh], ctx[fresh] * self.kv_bytes_per_token)
        self._host_add(nodes[fresh], ctx[fresh])
        t.host_node[ids[fresh]] = nodes[fresh]
        self._leave_gpu(instance, ids)
        t.where[ids] = SUSPENDED
        t.yields[ids] += 1
        self._push_by_node(ids, t.host_node[ids])

    def _push_by_node(self, ids: np.ndarray, nodes: np.ndarray) -> None:
        for node in np.unique(nodes):
            self.suspended[int(node)].push(ids[nodes == node])

    def combine(self, instance: int, node: int, ids: np.ndarray, gpus: np.ndarray, moves: Moves,
                lookahead_tokens: int, host_resident: np.ndarray | bool = False, keep_host_copy: bool = True) -> None:
        """COMBINE: resume suspended sequences from `node`'s pool (its head, FIFO) on GPUs of `instance`.

        A GPU on another node pulls the KV over the network (that is MIGRATE folded into the resume). A
        host-resident resume restores nothing now: its KV is restored layer by layer in every iteration.
        keep_host_copy=False frees the host copy once the KV is on the GPU (device-resident resumes only).
        """
        t = self.table
        self.suspended[node].take_head_ids(ids)
        host_resident = np.asarray(host_resident, bool)
        # one flag for the whole admit (the usual case): a plain array is cheaper to index than a broadcast view
        host_resident = np.full(ids.shape, bool(host_resident)) if host_resident.ndim == 0 else \
            np.broadcast_to(host_resident, ids.shape)
        bytes_ = t.context(ids) * self.kv_bytes_per_token
        remote = self.topo.gpu_node[gpus] != node
        local = ~remote & ~host_resident
        np.add.at(moves.h2d, gpus[local], bytes_[local])
        if not keep_host_copy and host_resident.any():
            raise InvariantError("a host-resident sequence runs from its host copy: it cannot drop it")
        if remote.any():
            np.add.at(moves.network, gpus[remote], bytes_[remote])
            if keep_host_copy:
                self._migrate_host_copy(ids[remote], self.topo.gpu_node[gpus[remote]])
            t.migrations[ids[remote]] += 1
        if not keep_host_copy:
            self._host_drop(ids)
        self._join_gpu(instance, ids, gpus, lookahead_tokens, host_resident)

    def _migrate_host_copy(self, ids: np.ndarray, nodes: np.ndarray) -> None:
        """The host copy moves to `nodes` (where the sequence now runs)."""
        t = self.table
        ctx = t.context(ids)
        np.subtract.at(self.host_used, t.host_node[ids], ctx)
        self._host_add(nodes, ctx)
        t.host_node[ids] = nodes

    def move_running(self, instance: int, ids: np.ndarray, gpus: np.ndarray, moves: Moves) -> None:
        """MIGRATE running sequences to other GPUs of their instance, KV and all (straggler rebalancing)."""
        t = self.table
        src = t.where[ids]
        self._require(ids, (src >= 0) & (self.topo.gpu_instance[np.maximum(src, 0)] == instance),
                      f"running on instance {instance}")
        # a host-resident sequence's KV stays in its node's host memory: only a move to another node carries it
        bytes_ = t.context(ids) * self.kv_bytes_per_token
        cross = self.topo.gpu_node[src] != self.topo.gpu_node[gpus]
        np.add.at(moves.network, gpus[cross], bytes_[cross])
        peer = ~cross & ~t.host_resident[ids]
        np.add.at(moves.peer, gpus[peer], bytes_[peer])
        pages = t.pages[ids].copy()
        self._set_pages(ids, np.zeros(ids.size, np.int64))
        t.where[ids] = gpus
        self._set_pages(ids, pages)
        t.migrations[ids] += 1
        have = ids[t.host_node[ids] >= 0]
        stale = have[t.host_node[have] != self.topo.gpu_node[t.where[have]]]
        if stale.size:  # the host copy follows the sequence to its new node
            self._migrate_host_copy(stale, self.topo.gpu_node[t.where[stale]])

    def offload(self, instance: int, ids: np.ndarray, moves: Moves) -> None:
        """Running device-resident sequences go on running host-resident: KV checkpointed, pages freed."""
        t = self.table
        gpus = t.where[ids]
        self._require(ids, (gpus >= 0) & (self.topo.gpu_instance[np.maximum(gpus, 0)] == instance)
                      & ~t.host_resident[ids] & (t.prefilled[ids] == 0),
                      f"running device-resident on instance {instance}, done prefilling")
        self._require(ids, t.tp[ids] == 1, "unpartitioned (a PARTITIONed sequence is joined back before it is "
                      "offloaded)")
        ctx = t.context(ids)
        fresh = t.host_node[ids] < 0
        np.add.at(moves.d2h, gpus[fresh], ctx[fresh] * self.kv_bytes_per_token)
        self._host_add(self.topo.gpu_node[gpus[fresh]], ctx[fresh])
        t.host_node[ids[fresh]] = self.topo.gpu_node[gpus[fresh]]
        self._set_pages(ids, np.zeros(ids.size, np.int64))
        t.host_resident[ids] = True

    def partition(self, instance: int, ids: np.ndarray, degree: np.ndarray, moves: Moves) -> None:
        """PARTITION running sequences over `degree` GPUs each (the group starts at the lead GPU): tensor-parallel
        attention with the KV split by heads (MHA/GQA; each rank keeps 1/degree) or replicated (MLA's latent).

        Resharding is a copy over the GPUs' links: a device-resident sequence's shards (or, for MLA, whole
        replicas) go from the lead to the new group members; going back to fewer ranks gathers them to the lead.
        Only device-resident sequences: a host-resident one has no device KV to shard, and the executors would
        have to build its shards from the host copy, a move this account does not price.
        """
        t = self.table
        gpus = t.where[ids]
        self._require(ids, (gpus >= 0) & (t.prefilled[ids] == 0), "running, done prefilling")
        self._require(ids, ~t.host_resident[ids], "device-resident (a host-resident sequence cannot be PARTITIONed)")
        degree = np.asarray(degree, np.int64)
        n_gpus = self.topo.instance_gpus(instance).size
        if np.any(degree < 1) or np.any(degree > n_gpus):
            raise InvariantError(f"partition degree must be within 1..{n_gpus}")
        change = t.tp[ids] != degree
        ids, degree = ids[change], degree[change]
        if not ids.size:
            return
        t.partitions[ids] += 1
        self.partitioned_ever = self.partitioned_ever or bool((degree > 1).any())
        kv = t.context(ids) * self.kv_bytes_per_token
        old = t.tp[ids].astype(np.int64)
        # bytes that land on ranks other than the lead: a shard per new member (or a replica for MLA), or the
        # lead gathering what other members held
        grow, shrink = degree > old, degree < old
        share = (lambda d: kv * (d - 1) / d) if self.kv_split_by_heads else (lambda d: kv * (d - 1))
        moved = np.where(grow, share(degree) - share(old), 0.0) + np.where(shrink, kv * (old - 1) / old, 0.0)
        self._set_pages(ids, np.zeros(ids.size, np.int64))
        t.tp[ids] = degree
        np.add.at(moves.peer, t.where[ids], moved)  # priced on the lead's link
        # each member's pages for the context; the run's lookahead is reserved after this
        self._set_pages(ids, self.pages_needed(ids, t.context(ids)))

    def evict(self, instance: int, ids: np.ndarray) -> None:
        """Drop sequences' KV (running or suspended); they go back to the head of their queue and will be
        recomputed."""
        t = self.table
        gpus = t.where[ids].copy()
        self._require(ids, (gpus >= 0) | (gpus == SUSPENDED), "running or suspended")
        parked = gpus == SUSPENDED
        for node in np.unique(t.host_node[ids[parked]]):
            self.suspended[int(node)].remove(ids[parked & (t.host_node[ids] == node)])
        self._host_drop(ids)
        if (~parked).any():
            self._leave_gpu(instance, ids[~parked])
        t.where[ids] = PENDING
        t.instance[ids] = instance  # it waits in this instance's queue now
        t.recomputes[ids] += 1
        # Recompute means prefilling prompt + generated tokens again: fold generated tokens into the prompt
        # cost by keeping `decoded`; the backend charges prefill over the whole context.
        pinned = t.home_gpu[ids] >= 0
        for g in np.unique(gpus[pinned]):
            self.pinned[int(g)].push_front(ids[pinned & (gpus == g)])
        if (~pinned).any():
            self.pending[instance].push_front(ids[~pinned])

    def take_pending(self, instance: int, ids: np.ndarray, gpu: int | None = None) -> None:
        """Remove sequences about to be prefilled from the head of their queue."""
        queue = self.pending[instance] if gpu is None else self.pinned[gpu]
        queue.take_head_ids(ids)

    def reserve_host(self, instance: int, nodes: np.ndarray, tokens: np.ndarray) -> None:
        if fastpath.ENABLED and not nodes.size:  # nothing to add (most runs): the bincount would be all zeros
            if self._reserving[instance]:
                self.host_reserved[instance] = 0
                self._reserving[instance] = False
            return
        self._reserving[instance] = True
        self.host_reserved[instance] = np.bincount(nodes, weights=tokens, minlength=self.topo.num_nodes)

    def host_committed(self, except_instance: int) -> np.ndarray:
        """Host KV in use plus what other instances' runs in flight will add."""
        if not fastpath.ENABLED:
            return self.host_used + np.delete(self.host_reserved, except_instance, axis=0).sum(axis=0)
        if self.topo.num_instances == 1:
            return self.host_used.copy()
        others = self.host_reserved.sum(axis=0) - self.host_reserved[except_instance]  # integers: exact
        return self.host_used + others

    def has_host_copies(self) -> bool:
        """Whether any sequence has a KV copy in host memory (each holds at least one token there)."""
        if fastpath.ENABLED:  # kept in step by every method that changes host_used (`check` verifies it)
            return self._host_any
        return bool(self.host_used.any())

    def start_prefill_to_host(self, instance: int, ids: np.ndarray) -> None:
        self.prefilling[instance] = np.concatenate([self.prefilling[instance], ids])

    def prefilled_to_host(self, instance: int, ids: np.ndarray, gpus: np.ndarray, moves: Moves) -> None:
        """Prefill output offloaded layer by layer: the sequences join their node's suspended pool."""
        t = self.table
        self._require(ids, t.where[ids] == PENDING, "pending")
        self._require(ids, np.isin(ids, self.prefilling[instance]), f"being prefilled by instance {instance}")
        self.prefilling[instance] = np.setdiff1d(self.prefilling[instance], ids, assume_unique=True)
        nodes = self.topo.gpu_node[gpus]
        ctx = t.context(ids)
        np.add.at(moves.d2h, gpus, ctx * self.kv_bytes_per_token)
        self._host_add(nodes, ctx)
        t.host_node[ids] = nodes
        t.where[ids] = SUSPENDED
        self._push_by_node(ids, nodes)

    def prefilled_to_gpu(self, instance: int, ids: np.ndarray, gpus: np.ndarray, lookahead_tokens: int) -> None:
        """Prefill output kept in the GPU's paged cache (serving-engine style)."""
        self._require(ids, self.table.where[ids] == PENDING, "pending")
        self._join_gpu(instance, ids, gpus, lookahead_tokens)

    def prefill_chunks(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
                       lengths: np.ndarray) -> None:
        """Chunked prefill: each sequence's KV grows by the chunk [start, start + length) of its context in the
        coming forward. A first chunk (start 0) takes a pending sequence (already removed from its queue) onto its
        GPU; a later one continues a sequence part-way through its prefill on that GPU. Pages are allocated for
        what the chunk writes (and for the first generated token when the chunk completes the context), and the
        progress is recorded now, as pages are (other instances check the state while this forward runs): a
        sequence whose chunk completes its context is an ordinary running one (prefilled 0) from here on."""
        t = self.table
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        if fastpath.ENABLED and ids.size <= _FEW and not self.partitioned_ever and self._prefill_chunks_few(
                instance, ids, gpus, starts, lengths):
            return
        new = starts == 0
        end = starts + lengths
        ctx = t.context(ids)
        where = t.where[ids]
        # every precondition in one pass (a boundary chunks a few sequences); the one that fails is named below
        ok = np.where(new, where == PENDING, (where == gpus) & (t.prefilled[ids] == starts)) & (lengths >= 1) & (
            end <= ctx)
        if not ok.all():
            self._require(ids[new], where[new] == PENDING, "pending (a first chunk starts a prompt)")
            old = ids[~new]
            self._require(old, (t.where[old] == gpus[~new]) & (t.prefilled[old] == starts[~new]),
                          "part-way through a chunked prefill on that GPU at that position")
            self._require(ids, (lengths >= 1) & (end <= ctx), "given chunks within their context")
        if new.any():
            self._join_gpu(instance, ids[new], gpus[new], lookahead_tokens=0, reserve=False)
        need = self.pages_needed(ids, end + (end == ctx))
        grow = need > t.pages[ids]
        if grow.any():
            self._set_pages(ids[grow], need[grow])
        now = np.where(end == ctx, 0, end)
        self.num_part_prefilled += int(np.count_nonzero(now)) - int(np.count_nonzero(t.prefilled[ids]))
        t.prefilled[ids] = now

    def _prefill_chunks_few(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
                            lengths: np.ndarray) -> bool:
        """`prefill_chunks` of a few chunks, nothing partitioned, on Python scalars (a fast path of
        batchgen.fastpath: the same checks, the same state after). False, having changed nothing, where a
        precondition fails: the array code then names it."""
        t, P = self.table, self.page_tokens
        rows = []
        for sid, g, s, n in zip(ids.tolist(), gpus.tolist(), starts.tolist(), lengths.tolist()):
            w, c, e = int(t.where[sid]), int(t.input_len[sid]) + int(t.decoded[sid]), s + n
            if not ((w == PENDING if s == 0 else w == g and int(t.prefilled[sid]) == s) and n >= 1 and e <= c):
                return False
            rows.append((sid, g, s, e, c))
        new = [(sid, g) for sid, g, s, _, _ in rows if s == 0]
        if new:  # _join_gpu without its reserve
            if any(int(self.topo.gpu_instance[g]) != instance for _, g in new):
                raise InvariantError("a sequence can only run on a GPU of the instance that schedules it")
            for sid, g in new:
                t.where[sid] = g
                t.host_resident[sid] = False
                t.instance[sid] = instance
            self.active[instance] = np.concatenate([self.active[instance], np.array([sid for sid, _ in new], np.int64)])
        grown: dict[int, int] = {}  # GPU -> pages its chunks add
        for sid, g, s, e, c in rows:
            need, held = -(-(e + (e == c)) // P), int(t.pages[sid])
            if need > held:
                t.pages[sid] = need
                grown[g] = grown.get(g, 0) + need - held
            t.prefilled[sid] = 0 if e == c else e
            self.num_part_prefilled += (e != c) - (s != 0)  # s != 0: it was part-way (prefilled == s)
        for g, added in grown.items():
            self._gpu_holds(g, int(self.pages_used[g]) + added)
        return True

    def advance(self, ids: np.ndarray, tokens: np.ndarray, host_sync: bool) -> None:
        """Sequences generated `tokens` more; with host_sync their host copy grew too (page-boundary sync).
        A host-resident sequence's copy always grows: its new KV is appended to host at every layer."""
        t = self.table
        t.decoded[ids] += tokens
        if fastpath.ENABLED and not self.has_host_copies():
            return  # no host copy anywhere: nothing to grow
        copy = (t.host_node[ids] >= 0) & (host_sync | t.host_resident[ids])
        if copy.any():
            self._host_add(t.host_node[ids[copy]], tokens[copy])

    def finish(self, instance: int, ids: np.ndarray, times: np.ndarray) -> None:
        t = self.table
        if (fastpath.ENABLED and ids.size <= _FEW and not self.partitioned_ever and not self._host_any
                and not self.prefilling[instance].size and self._finish_few(instance, ids, times)):
            return
        self._require(ids, t.decoded[ids] == t.output_len[ids], "done generating")
        running = t.where[ids] >= 0
        self._host_drop(ids)
        if running.any():
            self._leave_gpu(instance, ids[running])
        if self.prefilling[instance].size:
            self.prefilling[instance] = np.setdiff1d(self.prefilling[instance], ids, assume_unique=True)
        t.where[ids] = FINISHED
        t.finish_time[ids] = times
        self.num_finished += ids.size

    def _finish_few(self, instance: int, ids: np.ndarray, times: np.ndarray) -> bool:
        """`finish` of a few sequences, nothing partitioned, no host copy, nothing prefilling to host, on Python
        scalars (a fast path of batchgen.fastpath: the same check, the same state after). False, having changed
        nothing, where a sequence is not done: the array code then names it."""
        t = self.table
        freed: dict[int, int] = {}  # GPU -> pages the finished sequences held
        running = []
        for sid in ids.tolist():
            if int(t.decoded[sid]) != int(t.output_len[sid]):
                return False
            g = int(t.where[sid])
            if g >= 0:
                running.append(sid)
                freed[g] = freed.get(g, 0) + int(t.pages[sid])
        for sid in running:  # _leave_gpu
            t.pages[sid] = 0
            t.host_resident[sid] = False
            if t.prefilled[sid]:
                self.num_part_prefilled -= 1
                t.prefilled[sid] = 0
        for g, pages in freed.items():
            self.pages_used[g] -= pages
        if running:
            active = self.active[instance]
            if len(running) == 1:
                self.active[instance] = active[active != running[0]]
            else:
                self._leaving[running] = True
                self.active[instance] = active[~self._leaving[active]]
                self._leaving[running] = False
        t.where[ids] = FINISHED
        t.finish_time[ids] = times
        self.num_finished += ids.size
        return True

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
        if not np.array_equal(np.bincount(gpus, t.pages[running][rep], self.topo.num_gpus)
                              .astype(np.int64), self.pages_used):
            raise InvariantError("GPU page counts drifted from the per-sequence pages")
        if np.any(self.pages_used > self.gpu_pages):
            raise InvariantError("a GPU holds more KV pages than its capacity")
        partial = np.flatnonzero(t.prefilled)
        if partial.size and np.any(t.pages[partial] != self.pages_needed(partial, t.prefilled[partial])):
            raise InvariantError("a part-prefilled sequence must hold exactly the pages of the chunks it has written")
        host = t.host_node >= 0
        recount = np.bincount(t.host_node[host], t.context(np.flatnonzero(host)), self.topo.num_nodes)
        if not np.array_equal(recount.astype(np.int64), self.host_used):
            raise InvariantError("host KV accounting drifted from the per-sequence host copies")
        if np.any(self.host_used > self.host_kv_tokens):
            raise InvariantError("a node's host memory holds more KV than its capacity")
        if not self._host_any and self.host_used.any():
            raise InvariantError("host KV in use although has_host_copies() says there is none")
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


def _node_instance(topo: Topology) -> np.ndarray:
    """The instance whose GPUs fill each node, or -1 where the node's GPUs serve several instances."""
    node_instance = np.full(topo.num_nodes, -1, np.int64)
    node_instance[topo.gpu_node] = topo.gpu_instance
    shared = np.bincount(topo.gpu_node, minlength=topo.num_nodes) != np.bincount(
        topo.gpu_node, weights=(topo.gpu_instance == node_instance[topo.gpu_node]), minlength=topo.num_nodes)
    node_instance[shared] = -1
    return node_instance
