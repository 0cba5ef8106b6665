"""One process's share of a `backend=dist` run: its rank's KV cache, its shard of the experts, its sequences.

Every process (rank 0 too) holds a `RankWorker` and executes the commands rank 0 addresses to it on the control
group (`Command`, broadcast to the instances it concerns: its own, plus the instance at the other end of a migration;
control.CommandChannel), in the order they come, so that every collective they contain
lines up across ranks:

- `kv`: this rank's KV ops of a boundary (`GpuOps`: free, evict, yield, offload, restore on its own cache) and
  the boundary's migrations in plan order, each a send on its source (from its device pages, or its host copy
  when it holds none) and a receive on its destination (into its device pages, or its host copy; a host copy
  kept beside device pages exactly when the plan says) (`kv_transfer`; over the instance's group, or the world
  group when the two ends are in different instances): every rank walks the same list, so sends and receives
  pair up without a global view; PARTITION's joins
  (first: a yielded sequence's lead gathers what its host copy lacks, then every rank of the group drops its
  shard) and reshards (last: each part of a new shard sent device to device by the rank that holds it) likewise,
  within the instance (`partition.gather_to_host_kv` / `reshard_kv`, batchgen.core.reshard's parts);
- `forward`: one forward of this rank's sequences (the single-process runner's code, `InstanceRunner`, over one
  `RankBatch`: paged attention, staged host-resident attention, sampling); its MoE layers are
  `ExpertParallelMoE` collectives, so a rank with no tokens still runs every layer with zero rows; partitioned
  sequences run on their lead, their attention spread over their group by `partition.HeadShardExchange` (two
  all-to-alls per layer, every rank joining); then it samples its sequences and replies with the tokens and its
  timings (gathered on rank 0);
- `to_host` / `sync`: prefills bound for host yielded after the forward, host copies kept in sync (a partitioned
  sequence's by its lead, from its group's shards: `gathers`, walked in order by every rank of the instance);
- `stop` (reply: the run's totals) and `abort` (rank 0 failed: leave without a reply).

The control channel is a `Comm` over a gloo group of its own (its waits are not counted as communication: they
are the worker's idle time); with a heartbeat, a process that dies is found within seconds by the others.

Every byte of KV this rank copies is counted per kind of op and tier (`account`, as batchgen.exec.account: a
migration charged to the rank that receives it), and reported with its totals.

Timings are measured here, on each process's own clock: busy = seconds inside commands minus the seconds
inside communication (`Comm.comm_s`: all-to-alls, PARTITION's exchanges and KV transfers, waits for slower peers
included); idle = everything else (waiting for rank 0's next command, the control messages themselves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from batchgen.core.ops import GpuOps
from batchgen.core.reshard import Part
from batchgen.dist.comm import Comm
from batchgen.dist.control import REPLY_KINDS, broadcast_command, gather_replies, receive_command, send_reply
from batchgen.dist.kv_transfer import recv_rows, recv_sequence, send_rows, send_sequence
from batchgen.dist.partition import HeadShardExchange, gather_to_host_kv, reshard_kv
from batchgen.exec.backend import migration_tiers
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.runner import InstanceRunner, RankBatch
from batchgen.exec.sampling import SamplingParams, sample
from batchgen.exec.shards import shards_of


@dataclass
class Command:
    """One message from rank 0: `kind` and, per addressed rank (global), its part (`parts[r]`), plus what every
    addressed rank needs."""

    kind: str                       # kv, forward, to_host, sync, stop, abort
    parts: dict = field(default_factory=dict)
    # kv: (id, source rank, destination rank, to device, host copy kept, across nodes), plan order
    migrations: list = field(default_factory=list)
    # sync: (id, group's global ranks, lead first) of each partitioned sequence whose lead brings its host copy up
    # to date, in order, and {rank: node} of the instance's ranks (the tier of the parts gathered)
    gathers: list = field(default_factory=list)
    # kv: (source rank, destination rank, group, tokens, tail, parent group, across nodes) of each shared prefix
    # copied between processes (KVOps.prefix_copies), plan order; {id: (group, prefix tokens)} of the migrations
    # that take a prefix where they land (KVOps.resume_prefixes): only the rest is sent
    copies: list = field(default_factory=list)
    resumed: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)
    micro_batch: int = 0            # forward
    cpu_attention: bool = False
    ffn_schedule: str = "combined"
    comm_overlap: bool = False      # forward: each micro-batch's expert all-to-all beside the next's attention
    dp_prefill: bool = False        # forward: each process's tokens through every expert (it prefills)


@dataclass
class ForwardPart:
    """A rank's sequences in one forward (RankBatch's fields without the cache) and, per sampled sequence, how
    many tokens it had generated before (sampling replays the same draws after a recompute)."""

    seq_ids: list
    token_ids: list
    new_counts: list
    start_positions: list
    host_resident: list
    tp: list
    sample: list
    steps: list
    cascade: list = field(default_factory=list)  # RankBatch.cascade
    shared: list = field(default_factory=list)   # RankBatch.shared


@dataclass
class ForwardReply:
    ids: list            # sampled sequences, in batch order
    tokens: list
    attention_s: float
    ffn_s: float
    head_s: float
    gate_tokens: int
    restored_bytes: int
    appended_bytes: int
    host_resident: int
    busy_s: float        # since the last reply: commands' seconds minus communication
    comm_s: float        # since the last reply: Comm.comm_s (all-to-alls, KV transfers)
    prefix_reads: int = 0  # ForwardStats.prefix_reads


@dataclass
class Totals:
    rank: int
    wall_s: float
    busy_s: float
    comm_s: float
    idle_s: float
    moves: dict
    # what this rank moved: reshard_bytes (PARTITION's shards, split and joined), partition_exchange_bytes (the
    # per-layer head-sharded attention's rows sent) over partition_exchange_layers layers
    traffic: dict = field(default_factory=dict)
    cpu_s: float = 0.0   # process CPU seconds over the same span (under load, busy wall seconds include waits
                         # for a core; CPU seconds do not)
    kv_bytes: dict = field(default_factory=dict)  # {kind: {tier: (bytes, sequences)}} this rank's KV copies


class RankWorker:
    def __init__(self, rank: int, cache: PagedKVCache, runner: InstanceRunner, comm: Comm,
                 control: Comm, params: list[SamplingParams], job_seed: int,
                 device: torch.device, world: Comm | None = None, replies: Comm | None = None,
                 channels: list | None = None):
        """comm: this rank's instance (its all-to-alls, migrations within it); world: every process (migrations
        between instances), the instance's comm when there is one instance; control / replies: rank 0's commands
        to this instance and the replies to them (groups.control_groups; one group for both by default);
        channels: on rank 0, every instance's (commands, replies) pair (DistBackend's command channel)."""
        self.rank, self.cache, self.runner, self.comm = rank, cache, runner, comm
        self.world = comm if world is None else world
        self.control, self.params, self.job_seed, self.device = control, params, job_seed, device
        self.replies = control if replies is None else replies
        self.channels = channels
        self.busy_s = 0.0     # totals over the run
        self.comm_s = 0.0
        self._busy_pending = 0.0  # since the last reply
        self._comm_pending = 0.0
        self.moves: dict[str, int] = {}
        self.traffic: dict[str, int] = {}
        self.kv_bytes: dict[str, dict[str, list[int]]] = {}  # kind -> tier -> [bytes, sequences] on this rank
        # PARTITION across processes: the runner hands each layer's head-sharded attention to the exchange
        self.partition = HeadShardExchange(comm, cache) if comm.size > 1 else None
        runner.partition = self.partition
        self.host_files = None  # shared host copies (dist/shared_host.py): this rank's index, published in `_kv`
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    # ---- the control channel ---------------------------------------------------------------------------
    def receive(self, cmd: Command | None = None, channel: Comm | None = None) -> Command:
        """The next command rank 0 broadcast to this rank's instance: pickled bytes after their length, through
        `Comm` (waited in slices under the heartbeat: a dead rank 0 becomes WorkerLost in seconds). During a run
        rank 0 posts through control.CommandChannel; this rank-0 path (`cmd`, broadcast and waited for) is for
        exchanges outside it (a recovery's: over `channel`, every process of the run, when nothing else is in
        flight)."""
        channel = self.control if channel is None else channel
        if self.rank == 0:
            broadcast_command(channel, cmd)
            return cmd
        return receive_command(channel)

    def reply(self, value: Any, channel: Comm | None = None) -> list | None:
        """This worker's reply, gathered on rank 0 (during a run: control.CommandChannel.collect). On rank 0
        (outside a run, as `receive`): every member's reply in rank order, its own first."""
        channel = self.replies if channel is None else channel
        if self.rank != 0:
            send_reply(channel, value)
            return None
        got = gather_replies(channel) if channel.size > 1 else {}
        return [value if r == 0 else got[r] for r in channel.ranks]

    def serve(self) -> Totals | None:
        """A worker (rank > 0): execute commands until stop (its totals) or abort (None)."""
        while True:
            cmd = self.receive()
            if cmd.kind == "abort":
                return None
            result = self.handle(cmd)
            if cmd.kind in REPLY_KINDS:
                self.reply(result)
            if cmd.kind == "stop":
                return result

    # ---- executing a command -----------------------------------------------------------------------------
    def handle(self, cmd: Command) -> Any:
        t0, c0 = time.perf_counter(), self._comm_s()
        if cmd.kind == "stop":
            return self.totals()
        if cmd.kind == "kv":
            self._kv(cmd.parts.get(self.rank) or GpuOps(self.rank), cmd.migrations, cmd.copies, cmd.resumed)
            out = None
        elif cmd.kind == "forward":
            out = self._forward(cmd.parts[self.rank], cmd)
        elif cmd.kind == "to_host":
            self._counted("to_host", "d2h", self.cache.yield_to_host, cmd.parts.get(self.rank, []))
            out = None
        elif cmd.kind == "sync":
            self._counted("sync", "d2h", self.cache.sync_to_host,
                          [s for s in cmd.parts.get(self.rank, []) if self.cache.on_device(s)])
            for sid, group in cmd.gathers:
                if self.rank in group:
                    self._bytes("sync", "d2h", gather_to_host_kv(self.comm, self.cache, sid, self._local(group),
                                                                 self._parts("sync", cmd.nodes), self.comm_device))
            out = None
        else:
            raise ValueError(f"unknown command {cmd.kind!r}")
        comm = self._comm_s() - c0
        busy = time.perf_counter() - t0 - comm
        self.busy_s += busy
        self.comm_s += comm
        if out is None:
            self._busy_pending += busy
            self._comm_pending += comm
        else:
            out.busy_s += busy + self._busy_pending
            out.comm_s += comm + self._comm_pending
            self._busy_pending = self._comm_pending = 0.0
        return out

    def _comm_s(self) -> float:
        return self.comm.comm_s + (self.world.comm_s if self.world is not self.comm else 0.0)

    def _count(self, kind: str, n: int) -> None:
        if n:
            self.moves[kind] = self.moves.get(kind, 0) + n

    def _bytes(self, kind: str, tier: str, nbytes: int, seqs: int = 1) -> None:
        if nbytes:
            entry = self.kv_bytes.setdefault(kind, {}).setdefault(tier, [0, 0])
            entry[0] += int(nbytes)
            entry[1] += int(seqs)

    def _counted(self, kind: str, tier: str, copy, ids: list[int]) -> None:
        """copy(ids) on this rank's cache, its bytes (as the cache measured them) counted as `kind`."""
        before = self.cache.copied.copy()
        copy(ids)
        after = self.cache.copied
        self._bytes(kind, tier, after[tier] - before[tier], after[f"{tier}_seqs"] - before[f"{tier}_seqs"])

    def _kv(self, ops: GpuOps, migrations: list, copies: list = (), resumed: dict | None = None) -> None:
        """This rank's KV ops in the order of `KVOps`' fields (unshare, join, free, evict, yield, offload, migrate,
        restore, reshard, share). Joins and reshards are walked in plan order by every rank of their groups, like
        migrations (partition.py): each rank counts the parts it receives; the new lead counts the partition."""
        if (ops.join or ops.reshard) and self.partition is None:
            raise RuntimeError(f"a plan partitions sequences over one process (rank {self.rank}): PARTITION "
                               "needs a degree of at most backend.procs")
        cache = self.cache
        for group in ops.unshare:  # shared prefixes dropped (batchgen.exec.kv_prefixes)
            cache.unshare_prefix(group)
        for src, dst, group, tokens, tail, parent, cross in copies:  # prefixes copied between processes: every
            if self.rank not in (src, dst):                          # rank walks the same list, the pairs line up
                continue
            comm, (s, d) = self._between(src, dst)
            if src == self.rank:  # past the outer level the destination holds
                send_rows(comm, group, cache.prefix_rows(group, tokens, tail, parent), d, self._device_for(comm))
            else:
                rows = recv_rows(comm, group, s, self._device_for(comm))
                self._bytes("share", "network" if cross else "peer", cache.adopt_prefix(group, tokens, tail, rows,
                                                                                         parent))
        files = self.host_files
        if files is not None:  # the published index must not name a sequence whose pages this boundary may reuse
            files.publish_before_release(cache, [*ops.free, *ops.evict, *(j[0] for j in ops.join),
                                                 *(r[0] for r in ops.reshard),
                                                 *(m[0] for m in migrations if m[1] == self.rank)])
        for sid, group, to_host in ops.join:  # groups of global ranks, within this instance: its group's ranks
            if to_host:
                self._bytes("yield", "d2h", gather_to_host_kv(self.comm, cache, sid, self._local(group),
                                                              self._parts("join", ops.nodes), self.comm_device))
            shards_of(cache).release([sid])
            if not to_host and group[0] == self.rank and sid in cache:
                cache.release([sid])
        cache.release(ops.free)
        cache.release(ops.evict)
        self._count("evict", len(ops.evict))
        self._counted("yield", "d2h", cache.yield_to_host, ops.yield_)
        self._count("yield", len(ops.yield_))
        self._counted("offload", "d2h", cache.yield_to_host, ops.offload)
        self._count("offload", len(ops.offload))
        resumed = resumed or {}
        for sid, src, dst, to_device, host_copy, cross in migrations:  # every rank walks the same list: the pairs
            if self.rank not in (src, dst):                             # line up
                continue
            comm, (s, d) = self._between(src, dst)
            if src == self.rank:
                send_sequence(comm, cache, sid, d, self._device_for(comm), skip=resumed.get(sid, (-1, 0))[1])
                cache.release([sid])  # the destination has adopted it once the send completed
                self._count("migrate", 1)
            else:
                group, past = resumed.get(sid, (-1, 0))
                if past:  # it holds the prefix here first, and receives the rest of its KV past it
                    cache.share_prefix(sid, group, past, False, resuming=True)
                moved = recv_sequence(comm, cache, sid, s, to_device, host_copy, self._device_for(comm), past=past)
                for kind, tier, nbytes in migration_tiers(moved, cross):
                    self._bytes(kind, tier, nbytes)
        restoring = set(ops.restore)
        for sid, group, tokens, creates, _, _, _ in ops.share:  # a restore that takes its prefix: only the rest copied
            if sid in restoring:
                cache.share_prefix(sid, group, tokens, creates)
        self._counted("restore", "h2d", cache.restore, ops.restore)
        self._count("restore", len(ops.restore))
        for sid, old, new, host_copy in ops.reshard:
            reshard_kv(self.comm, cache, sid, self._local(old), self._local(new), self._parts("reshard", ops.nodes),
                       self.comm_device)
            if host_copy and old[0] != new[0] and self.rank in (old[0], new[0]):  # the host copy follows the lead
                comm, (s, d) = self._between(old[0], new[0])
                if self.rank == old[0]:
                    send_sequence(comm, cache, sid, d, self._device_for(comm))
                    cache.release([sid])
                else:
                    moved = recv_sequence(comm, cache, sid, s, False, True, self._device_for(comm))
                    for _, tier, nbytes in migration_tiers(moved, ops.nodes[old[0]] != ops.nodes[new[0]]):
                        self._bytes("reshard_host_copy", tier, nbytes)
            if len(new) > 1 and self.rank in new:
                # the lead counts the partition (as rank 0's plan does), each other rank of the group its shard
                self._count("partition" if new[0] == self.rank else "partition_shard", 1)
        for sid, group, tokens, creates, tail, src, _ in ops.share:  # shared prefixes (batchgen.exec.kv_prefixes): a
            if src >= 0:  # tail below a page copied on the device; one copied from another process came first
                continue
            if sid not in restoring and sid not in resumed:
                self._bytes("share", "local", cache.share_prefix(sid, group, tokens, creates, tail))
        for group in ops.untail:  # tail pages freed, after the takers that copy them
            cache.untail_prefix(group)
        if files is not None:
            files.publish(cache)

    def _local(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """A partition group's global ranks as ranks of this instance's group (the same for one instance)."""
        return tuple(self.comm.ranks.index(g) for g in group)

    def _parts(self, kind: str, nodes: dict):
        """A `shards.Count` for this rank: each part of a reshard or gather it receives (ranks of its instance's
        group), as `kind`: peer from a rank of its node, network from another."""
        def count(part: Part, nbytes: int) -> None:
            src, dst = self.comm.ranks[part.src], self.comm.ranks[part.dst]
            self._bytes(kind, "peer" if nodes[src] == nodes[dst] else "network", nbytes)
            if kind == "reshard":
                self.traffic["reshard_bytes"] = self.traffic.get("reshard_bytes", 0) + nbytes
        return count

    def _between(self, src: int, dst: int) -> tuple[Comm, tuple[int, int]]:
        """The group a migration between global ranks src and dst goes over, and their ranks in it: the
        instance's when both are in it, else the world's (a sequence one instance yielded, resumed by another)."""
        ranks = self.comm.ranks
        if src in ranks and dst in ranks:
            return self.comm, (ranks.index(src), ranks.index(dst))
        return self.world, (self.world.ranks.index(src), self.world.ranks.index(dst))

    def _device_for(self, comm: Comm) -> torch.device:
        return self.device if dist.get_backend(comm.group) == "nccl" else torch.device("cpu")

    @property
    def comm_device(self) -> torch.device:
        return self._device_for(self.comm)

    @torch.inference_mode()
    def _forward(self, part: ForwardPart, cmd: Command) -> ForwardReply:
        batch = RankBatch(self.cache, part.seq_ids, part.token_ids, part.new_counts, part.start_positions,
                          part.host_resident, part.tp, part.sample, part.cascade, part.shared)
        if self.partition is not None:  # every rank: the instance's partition groups, from every rank's part
            self.partition.begin([cmd.parts[r] for r in self.comm.ranks])  # in the instance's rank order
        logits, stats = self.runner.forward([batch], cmd.micro_batch, cmd.cpu_attention, cmd.ffn_schedule,
                                            cmd.comm_overlap, cmd.dp_prefill)
        ids = [s for s, keep in zip(part.seq_ids, part.sample or [True] * len(part.seq_ids)) if keep]
        start = time.perf_counter()
        tokens: list[int] = []
        if ids:
            tokens = sample(logits[0], [self.params[s] for s in ids], ids, part.steps,
                            job_seed=self.job_seed).tolist()
        head = stats.head_s + time.perf_counter() - start
        return ForwardReply(ids, tokens, stats.rank_attention_s[0], stats.ffn_s, head, stats.gate_tokens,
                            stats.restored_bytes, stats.appended_bytes, stats.host_resident, 0.0, 0.0,
                            stats.prefix_reads)

    def totals(self) -> Totals:
        wall = time.perf_counter() - self._start
        if self.partition is not None and self.partition.layers:
            self.traffic["partition_exchange_layers"] = self.partition.layers
            self.traffic["partition_exchange_bytes"] = self.partition.sent_bytes
        return Totals(self.rank, wall, self.busy_s, self.comm_s, max(wall - self.busy_s - self.comm_s, 0.0),
                      dict(self.moves), dict(self.traffic), time.process_time() - self._cpu_start,
                      {k: {t: tuple(v) for t, v in tiers.items()} for k, tiers in self.kv_bytes.items()})
