"""Where every sequence lives, and the coroutine primitives that move it.

Both backends keep their bookkeeping here. Each primitive emits the KV ops it implies (batchgen.core.oplog: what
moves, from which GPU and tier to which, how many bytes) as it changes the state; an instance's ops are taken at
its boundary (`take_ops`), priced by the simulator and performed by the executors. Every primitive checks its
preconditions, so a policy that asks for something impossible (admit a sequence that is not suspended, overfill a
GPU) fails loudly at the step that did it.
"""

from __future__ import annotations

import numpy as np

from batchgen.core.accounts import _FEW, Accounts
from batchgen.core.few import FewIds
from batchgen.core.host_prefixes import HostPrefixes
from batchgen.core.move_order import carried_out_in
from batchgen.core.ops import KVOps
from batchgen.core.oplog import OpLog
from batchgen.core.prefix_fetch import PrefixFetch
from batchgen.core.queues import IdQueue
from batchgen.core.sequences import FINISHED, PENDING, SUSPENDED, InvariantError, SequenceTable, without
from batchgen.core.topology import Topology, node_instance

__all__ = ["ClusterState", "Topology"]


class ClusterState(FewIds, HostPrefixes, PrefixFetch, Accounts):
    def __init__(self, table: SequenceTable, topo: Topology, *, page_tokens: int, gpu_pages: np.ndarray,
                 host_kv_tokens: np.ndarray, kv_bytes_per_token: float, kv_split_by_heads: bool = True):
        """kv_split_by_heads: a PARTITIONed sequence's KV is split by heads over its group (MHA/GQA), so each
        rank of the group holds 1/degree of it; False (MLA's latent KV) replicates it on every rank."""
        self.table, self.topo = table, topo
        self.gpu_rank = topo.gpu_rank  # computed once: the engine maps GPUs to ranks at every boundary
        self.page_tokens = int(page_tokens)
        self.gpu_pages = np.asarray(gpu_pages, dtype=np.int64)            # capacity per GPU
        self.host_kv_tokens = np.asarray(host_kv_tokens, dtype=np.int64)  # capacity per node
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.kv_split_by_heads = bool(kv_split_by_heads)
        self._instance_gpus = [topo.instance_gpus(i) for i in range(topo.num_instances)]
        for gpus in self._instance_gpus:
            gpus.flags.writeable = False  # shared by every boundary's snapshot and plan (instance_gpus)
        self._leaving = np.zeros(len(table), bool)  # scratch mask of `without` (all False between calls)
        self.node_instance = node_instance(topo)  # computed once: every snapshot carries it
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
        # one GPU, and the page arithmetic skips the per-sequence degrees (`check` verifies the flag)
        self.partitioned_ever = False
        # running sequences part-way through a chunked prefill (prefilled > 0), kept by the methods that write
        # `prefilled`: at 0 the engine skips looking for them (`check` verifies it)
        self.num_part_prefilled = 0
        self.oplogs = [OpLog() for _ in range(topo.num_instances)]  # ops emitted since each instance's boundary
        self.prefill_computed = 0  # prompt (and recomputed) tokens whose KV a prefill or chunk computed
        self.decode_kv_read = 0    # context tokens whose KV decode queries read, over every forward (cascade.py)
        self.decode_forwards = 0   # instance forwards that decoded
        self.cascade_prefix_read = 0  # of decode_kv_read: what cascades' prefix kernels read (once per call)

    def take_ops(self, instance: int) -> KVOps:
        """The KV ops the instance's primitives emitted since its last boundary (its runs' finishes included),
        in execution order; the log is emptied."""
        gpus = self._instance_gpus[instance]
        return self.oplogs[instance].take(gpus, self.topo.gpu_node[gpus], self.kv_split_by_heads)

    def kv_bytes(self, ids: np.ndarray) -> np.ndarray:
        """Bytes of the KV the sequences hold: every context token's but the newest generated one's, whose KV the
        next forward writes (a sequence done prefilling). What a move of their KV copies, on any tier."""
        t = self.table
        return (t.context(ids) - (t.decoded[ids] > 0)) * self.kv_bytes_per_token

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

    # ---- primitives -----------------------------------------------------------------------------------
    def _leave_gpu(self, instance: int, ids: np.ndarray) -> None:
        self._free_pages(ids)  # frees the whole group's pages, then un-partitions
        if self.partitioned_ever:
            self.table.tp[ids] = 1
        self.table.host_resident[ids] = False
        if self.num_part_prefilled:  # a chunked prefill left unfinished restarts from its first token
            self.num_part_prefilled -= int(np.count_nonzero(self.table.prefilled[ids]))
            self.table.prefilled[ids] = 0
        self.active[instance] = without(self.active[instance], ids, self._leaving)

    def _join_gpu(self, instance: int, ids: np.ndarray, gpus: np.ndarray, lookahead_tokens: int,
                  host_resident: np.ndarray | bool = False, reserve: bool = True) -> None:
        if (self.topo.gpu_instance[gpus] != instance).any():
            raise InvariantError("a sequence can only run on a GPU of the instance that schedules it")
        self.table.where[ids] = gpus
        self.table.kv_gpu[ids] = gpus
        self.table.host_resident[ids] = host_resident
        self.table.instance[ids] = instance
        self.active[instance] = np.concatenate([self.active[instance], ids])
        if reserve:
            self.reserve(ids, lookahead_tokens)

    def _require(self, ids: np.ndarray, ok: np.ndarray, what: str) -> None:
        if not ok.all():
            raise InvariantError(f"sequences {ids[~ok][:5].tolist()} are not {what}")

    def yield_(self, instance: int, ids: np.ndarray) -> None:
        """YIELD: suspend running sequences; their KV is checkpointed to their node's host memory.

        A sequence with a host copy has it up to date already (host_sync keeps it so): nothing moves. One without
        writes its whole KV down from its GPU; a PARTITIONed one first gathers its group's shards into its lead
        (device to device, as a join to one GPU: `partition`), which writes the whole KV down."""
        t = self.table
        gpus = t.where[ids]
        self._require(ids, (gpus >= 0) & (self.topo.gpu_instance[np.maximum(gpus, 0)] == instance),
                      f"running on instance {instance}")
        self._require(ids, t.prefilled[ids] == 0, "done prefilling (a part-prefilled prompt has no KV to yield)")
        ctx = t.context(ids)
        nodes = self.topo.gpu_node[gpus]
        fresh = t.host_node[ids] < 0   # no host copy yet: the whole KV goes down now (past a host prefix it takes)
        written = np.where(fresh, self.kv_bytes(ids), 0.0)
        log = self.oplogs[instance]
        split = (t.tp[ids] > 1) if self.partitioned_ever else np.zeros(ids.size, bool)
        if fresh.any():  # a PARTITIONed one's lead gathers and writes its whole KV (no host prefix taken)
            shares = fresh & ~split
            written[shares] -= self._host_copies(ids[shares], nodes[shares], ctx[shares]) * self.kv_bytes_per_token
            self._host_add(nodes[fresh & split], ctx[fresh & split])
        if split.any():
            log.add("join", ids[split], gpus[split], t.tp[ids[split]].astype(np.int64), np.ones(int(split.sum()), bool),
                    written[split])
        device = ~split & ~t.host_resident[ids]
        log.add("yield", ids[device], gpus[device].astype(np.int64), written[device])
        t.host_node[ids[fresh]] = nodes[fresh]
        self._leave_gpu(instance, ids)
        t.where[ids] = SUSPENDED
        t.yields[ids] += 1
        self._push_by_node(ids, t.host_node[ids])

    def _push_by_node(self, ids: np.ndarray, nodes: np.ndarray) -> None:
        if self.sharing:
            self.parked(ids, 1)
        for node in np.unique(nodes):
            self.suspended[int(node)].push(ids[nodes == node])

    def combine(self, instance: int, node: int, ids: np.ndarray, gpus: np.ndarray, lookahead_tokens: int,
                host_resident: np.ndarray | bool = False, keep_host_copy: bool = True) -> None:
        """COMBINE: resume suspended sequences from `node`'s pool (its head, FIFO) on GPUs of `instance`.

        A GPU on another node pulls the KV over the network (that is MIGRATE folded into the resume). A
        host-resident resume restores nothing now: its KV is restored layer by layer in every iteration.
        keep_host_copy=False frees the host copy once the KV is on the GPU (device-resident resumes only).
        """
        t = self.table
        self.suspended[node].take_head_ids(ids)
        if self.sharing:
            self.parked(ids, -1)
        host_resident = np.asarray(host_resident, bool)
        # one flag for the whole admit (the usual case): a plain array is cheaper to index than a broadcast view
        host_resident = np.full(ids.shape, bool(host_resident)) if host_resident.ndim == 0 else \
            np.broadcast_to(host_resident, ids.shape)
        if not keep_host_copy and host_resident.any():
            raise InvariantError("a host-resident sequence runs from its host copy: it cannot drop it")
        bytes_ = self.kv_bytes(ids)
        remote = self.topo.gpu_node[gpus] != node
        src = t.kv_gpu[ids].astype(np.int64)
        here = src == gpus  # back on the GPU whose host copy it is: restored in place (host-resident: nothing)
        log, restore = self.oplogs[instance], here & ~host_resident
        takes = ~host_resident & ~remote if self.resume_anywhere else restore  # onto another GPU of its node too
        if self.sharing and takes.any():  # onto a GPU with its group's prefix: it takes it, and copies the rest
            bytes_[takes] -= self.attach_restored(instance, ids[takes], gpus[takes]) * self.kv_bytes_per_token
        if restore.all():  # the usual admit: each back onto the device of the GPU it was yielded from
            log.add("restore", ids, src, bytes_)
        else:
            log.add("restore", ids[restore], src[restore], bytes_[restore])
            away = ~here
            if away.any():  # from the host copy another GPU's cache holds (on this node, or over the network)
                n = int(away.sum())
                log.add("resume", ids[away], src[away], gpus[away].astype(np.int64), remote[away], np.zeros(n, bool),
                        ~host_resident[away], np.full(n, keep_host_copy), bytes_[away])
        if remote.any():
            if keep_host_copy:  # the host copy is written again on the new node, from the KV that arrived there
                self._migrate_host_copy(ids[remote], self.topo.gpu_node[gpus[remote]])
            t.migrations[ids[remote]] += 1
        if not keep_host_copy:
            self._host_drop(ids)
        self._join_gpu(instance, ids, gpus, lookahead_tokens, host_resident)

    def _migrate_host_copy(self, ids: np.ndarray, nodes: np.ndarray) -> None:
        """The host copy moves to `nodes` (where the sequence now runs)."""
        t = self.table
        ctx = t.context(ids)
        np.subtract.at(self.host_used, t.host_node[ids], ctx - self._host_release(ids))  # arrives whole
        self._host_add(nodes, ctx)
        t.host_node[ids] = nodes

    def move_running(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """MIGRATE running sequences to other GPUs of their instance, KV and all (straggler rebalancing).

        A PARTITIONed sequence moves as its group: from the group led by its GPU to the group of the same degree
        led by the new one, each GPU of the new group receiving the part of its shard it does not hold yet, device
        to device (`partition`'s resharding); its host copy, if any, follows its lead: within a node it changes
        hands, across nodes it travels as it is (network, charged to the new lead).

        The executors carry the moves out one at a time, each landing before its source lets go: they are taken in
        an order in which every destination has room for each arrival (device pages, and host memory for a host
        copy that crosses nodes) on top of what it holds then (`batchgen.core.move_order`); moves that fit no such
        order (full GPUs swapping sequences) are refused. Returns the ids in that order, the order the plan lists
        their migrations in (the op log keeps the order the primitive emits them in)."""
        t = self.table
        src = t.where[ids]
        self._require(ids, (src >= 0) & (self.topo.gpu_instance[np.maximum(src, 0)] == instance),
                      f"running on instance {instance}")
        order = carried_out_in(self, ids, gpus)
        ids, gpus, src = ids[order], gpus[order], src[order]
        bytes_ = self.kv_bytes(ids)
        cross = self.topo.gpu_node[src] != self.topo.gpu_node[gpus]
        split = (t.tp[ids] > 1) if self.partitioned_ever else np.zeros(ids.size, bool)
        whole = ~split
        copy = t.host_node[ids] >= 0
        device = ~t.host_resident[ids]
        log = self.oplogs[instance]
        src, dst = src.astype(np.int64), gpus.astype(np.int64)
        log.add("migrate", ids[whole], src[whole], dst[whole], cross[whole], device[whole], device[whole],
                copy[whole], bytes_[whole])
        if split.any():  # the group moves to its new lead at its degree
            degree = t.tp[ids[split]].astype(np.int64)
            log.add("reshard", ids[split], src[split], degree, dst[split], degree, copy[split], bytes_[split])
        pages = t.pages[ids] + (self.prefix_held[ids] // self.page_tokens if self.sharing else 0)  # arrives whole
        self._free_pages(ids)
        t.where[ids] = gpus
        t.kv_gpu[ids] = gpus
        self._set_pages(ids, pages)
        t.migrations[ids] += 1
        have = ids[t.host_node[ids] >= 0]
        stale = have[t.host_node[have] != self.topo.gpu_node[t.where[have]]]
        if stale.size:  # the host copy follows the sequence to its new node
            self._migrate_host_copy(stale, self.topo.gpu_node[t.where[stale]])
        return ids

    def offload(self, instance: int, ids: np.ndarray) -> None:
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
        written = np.where(fresh, self.kv_bytes(ids), 0.0)
        nodes = self.topo.gpu_node[gpus[fresh]]
        written[fresh] -= self._host_copies(ids[fresh], nodes, ctx[fresh]) * self.kv_bytes_per_token
        self.oplogs[instance].add("offload", ids, gpus.astype(np.int64), written)
        t.host_node[ids[fresh]] = nodes
        self._free_pages(ids)
        t.host_resident[ids] = True

    def partition(self, instance: int, ids: np.ndarray, degree: np.ndarray) -> None:
        """PARTITION running sequences over `degree` GPUs each (the group starts at the lead GPU, where the sequence
        runs): tensor-parallel attention with the KV split by heads (MHA/GQA: GPU j of the group holds shard j,
        1/degree of the heads) or replicated (MLA's latent: a whole replica on each GPU of the group).

        Resharding is device to device (batchgen.core.reshard): each GPU of the new group receives the part of its
        new shard it does not hold yet from the GPU of the old group that holds it, charged to the GPU that
        receives it (peer within a node, network across), and keeps what it holds. A split (1 -> d) sends shard j
        (MLA: a replica) from the lead's pages to GPU j of the group, the lead keeping shard 0; a join (d -> 1)
        gathers the other shards into the lead's pages (MLA: nothing moves, the lead's replica is whole); another
        degree moves only the heads that change GPU. Only the tokens whose KV exists move (`kv_bytes`).

        A sequence's host copy, if it has one, stays in its lead's host memory and is kept up to date like any
        device-resident sequence's (host_sync: the new tokens' shards are gathered into the lead, which writes
        them down; batchgen.sim.backend.synced_gather_bytes). Only device-resident sequences: a host-resident one
        has no device KV to shard.
        """
        t = self.table
        gpus = t.where[ids]
        self._require(ids, (gpus >= 0) & (t.prefilled[ids] == 0), "running, done prefilling")
        self._require(ids, ~t.host_resident[ids], "device-resident (a host-resident sequence cannot be PARTITIONed)")
        if self.sharing:
            self._require(ids, self.prefix_held[ids] == 0, "holding no shared prefix (its pages are its group's)")
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
        lead = t.where[ids].astype(np.int64)
        self.oplogs[instance].add("reshard", ids, lead, t.tp[ids].astype(np.int64), lead, degree,
                                  t.host_node[ids] >= 0, self.kv_bytes(ids))
        self._free_pages(ids)
        t.tp[ids] = degree
        # each member's pages for the context; the run's lookahead is reserved after this
        self._set_pages(ids, self.pages_needed(ids, t.context(ids)))

    def evict(self, instance: int, ids: np.ndarray) -> None:
        """Drop sequences' KV (running or suspended); they go back to the head of their queue and will be
        recomputed."""
        t = self.table
        gpus = t.where[ids].copy()
        self._require(ids, (gpus >= 0) | (gpus == SUSPENDED), "running or suspended")
        parked = gpus == SUSPENDED
        self._drop_kv(instance, ids, running=~parked)
        for node in np.unique(t.host_node[ids[parked]]):
            self.suspended[int(node)].remove(ids[parked & (t.host_node[ids] == node)])
        if self.sharing and parked.any():
            self.parked(ids[parked], -1)
        self._host_drop(ids)
        if (~parked).any():
            self._leave_gpu(instance, ids[~parked])
        t.where[ids] = PENDING
        t.instance[ids] = instance  # it waits in this instance's queue now
        t.recomputes[ids] += 1
        if self.sharing:
            self.back_to_pending(ids)
        # Recompute means prefilling prompt + generated tokens again: fold generated tokens into the prompt
        # cost by keeping `decoded`; the backend charges prefill over the whole context.
        pinned = t.home_gpu[ids] >= 0
        for g in np.unique(gpus[pinned]):
            self.pinned[int(g)].push_front(ids[pinned & (gpus == g)])
        if (~pinned).any():
            self.pending[instance].push_front(ids[~pinned])

    def _drop_kv(self, instance: int, ids: np.ndarray, running: np.ndarray, evicted: bool = True) -> None:
        """Emit the ops that drop the sequences' KV wherever it is (a partitioned one's group leaves its shards),
        before the state forgets where: evicted (recomputed later) or freed (finished)."""
        t, log = self.table, self.oplogs[instance]
        holder = t.kv_gpu[ids].astype(np.int64)
        held = holder >= 0
        if self.partitioned_ever:
            split = running & (t.tp[ids] > 1)
            if split.any():
                n = int(split.sum())
                log.add("join", ids[split], holder[split], t.tp[ids[split]].astype(np.int64), np.zeros(n, bool),
                        np.zeros(n))
                held &= ~split
        if held.all():
            log.add("evict" if evicted else "free", ids, holder)
        else:
            log.add("evict" if evicted else "free", ids[held], holder[held])
        t.kv_gpu[ids] = -1

    def take_pending(self, instance: int, ids: np.ndarray, gpu: int | None = None) -> None:
        """Remove sequences about to be prefilled from the head of their queue (some of its head may stay)."""
        (self.pending[instance] if gpu is None else self.pinned[gpu]).take_from_head(ids)

    def start_prefill_to_host(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> None:
        self.prefill_computed += int(self.table.context(ids).sum())
        self.prefilling[instance] = np.concatenate([self.prefilling[instance], ids])
        self.table.kv_gpu[ids] = gpus  # the prefill writes its KV there (into that GPU's host copy)

    def prefilled_to_host(self, instance: int, ids: np.ndarray, gpus: np.ndarray,
                          host_held: np.ndarray | None = None) -> None:
        """Prefill output offloaded layer by layer: the sequences join their node's suspended pool (`host_held`:
        what each copy holds of its node's host prefix, as the backend wrote it; None: by the state's rule now)."""
        t = self.table
        self._require(ids, t.where[ids] == PENDING, "pending")
        kept = without(self.prefilling[instance], ids, self._leaving)
        if kept.size + ids.size != self.prefilling[instance].size:
            self._require(ids, np.isin(ids, self.prefilling[instance]), f"being prefilled by instance {instance}")
        self.prefilling[instance] = kept
        nodes = self.topo.gpu_node[gpus]
        self._host_copies(ids, nodes, t.context(ids), host_held)  # written down whole, or past its node's prefix
        t.host_node[ids] = nodes
        t.where[ids] = SUSPENDED
        self._push_by_node(ids, nodes)

    def prefilled_to_gpu(self, instance: int, ids: np.ndarray, gpus: np.ndarray, lookahead_tokens: int) -> None:
        """Prefill output kept in the GPU's paged cache (serving-engine style)."""
        self._require(ids, self.table.where[ids] == PENDING, "pending")
        ctx = self.table.context(ids)
        self.prefill_computed += int(ctx.sum())
        self._join_gpu(instance, ids, gpus, lookahead_tokens)
        if self.sharing:  # the first of its group on its GPU creates its prefix (batchgen.core.prefix_pages)
            self._create(instance, ids, gpus, np.zeros(ids.size, np.int64), ctx)

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
        self.prefill_computed += sum(lengths.tolist()) if lengths.size <= _FEW else int(lengths.sum())
        if (ids.size <= _FEW and not self.partitioned_ever and not self.sharing
                and self._prefill_chunks_few(instance, ids, gpus, starts, lengths)):
            return
        new = starts == 0
        end = starts + lengths
        ctx = t.context(ids)
        where = t.where[ids]
        before = t.prefilled[ids]
        # every precondition in one pass (a boundary chunks a few sequences); the one that fails is named below
        # (a first chunk: pending, so at prefilled 0 too; a later one: on its GPU where its prefill stands)
        ok = (np.where(new, PENDING, gpus) == where) & (before == starts) & (lengths >= 1) & (end <= ctx)
        if not ok.all():
            self._require(ids[new], where[new] == PENDING, "pending (a first chunk starts a prompt)")
            old = ids[~new]
            self._require(old, (t.where[old] == gpus[~new]) & (t.prefilled[old] == starts[~new]),
                          "part-way through a chunked prefill on that GPU at that position")
            self._require(ids, (lengths >= 1) & (end <= ctx), "given chunks within their context")
            self._require(ids[new], before[new] == 0, "without a prefill under way (a first chunk starts at 0)")
        if new.all():
            self._join_gpu(instance, ids, gpus, lookahead_tokens=0, reserve=False)
        elif new.any():
            self._join_gpu(instance, ids[new], gpus[new], lookahead_tokens=0, reserve=False)
        done = end == ctx
        need = self.pages_needed(ids, end + done)
        grow = need > t.pages[ids]
        if grow.all():
            self._set_pages(ids, need)
        elif grow.any():
            self._set_pages(ids[grow], need[grow])
        if self.sharing:
            self._create(instance, ids, gpus, starts, end)
        now = np.where(done, 0, end)
        self.num_part_prefilled += int(np.count_nonzero(now)) - int(np.count_nonzero(before))
        t.prefilled[ids] = now

    def advance(self, ids: np.ndarray, tokens: np.ndarray, host_sync: bool) -> None:
        """Sequences generated `tokens` more; with host_sync their host copy grew too (page-boundary sync).
        A host-resident sequence's copy always grows: its new KV is appended to host at every layer."""
        t = self.table
        t.decoded[ids] += tokens
        if not self.has_host_copies():
            return  # no host copy anywhere: nothing to grow
        copy = (t.host_node[ids] >= 0) & (host_sync | t.host_resident[ids])
        if copy.any():
            self._host_add(t.host_node[ids[copy]], tokens[copy])

    def finish(self, instance: int, ids: np.ndarray, times: np.ndarray) -> None:
        t = self.table
        if (ids.size <= _FEW and not self.partitioned_ever and not self._host_any and not self.sharing
                and not self.prefilling[instance].size and self._finish_few(instance, ids, times)):
            return
        self._require(ids, t.decoded[ids] == t.output_len[ids], "done generating")
        running = t.where[ids] >= 0
        self._drop_kv(instance, ids, running, evicted=False)
        self._host_drop(ids)
        if running.all():
            self._leave_gpu(instance, ids)
        elif running.any():
            self._leave_gpu(instance, ids[running])
        if self.prefilling[instance].size:
            self.prefilling[instance] = without(self.prefilling[instance], ids, self._leaving)
        t.where[ids] = FINISHED
        t.finish_time[ids] = times
        self.num_finished += ids.size
