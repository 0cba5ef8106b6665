"""PARTITION across processes: a straggler's attention split by heads over the processes of its group.

A sequence partitioned over `degree` ranks has a lead (the rank that runs it: its tokens, its sampling, its
host copy) and a group, the lead and the next degree - 1 ranks of the instance (wrapping, `KVOps.group`). Rank j
of the group holds shard j of the sequence's KV in its own pool (`exec/shards.py`: KV heads j*Hkv/degree ..,
or the whole latent for MLA).

KV moves, at a boundary (or after a run, for host_sync), in plan order on every rank of the groups (as migrations:
every rank walks the same list of parts, `batchgen.core.reshard`, so blocking sends and receives pair up):
- reshard (`reshard_kv`): a running sequence goes from one group to another (a split from the lead's pages, a join
  back into them, another degree, another lead), device to device: each rank of the new group receives the parts
  of its shard it lacks from the ranks that hold them and keeps what it holds (the state prices exactly those
  parts, charged to the receiving rank); a new lead takes the old lead's host copy as a migration does;
- gather to host (`gather_to_host_kv`): a lead brings its host copy up to date, the group's other ranks sending it
  their shards of the tokens the copy lacks (the lead tells them from where); after a run with host_sync, and
  when the sequence is yielded (then every rank drops its shard); a finished or evicted one's shards are only
  dropped, nothing moves.

Forward (`HeadShardExchange`), in every layer, after the rank's own attention and before the MoE:
1. dispatch: each lead sends the normed hidden rows of its partitioned sequences to the other ranks of their
   groups (one all_to_all_single over the instance; split sizes known to every rank from the broadcast
   command, so no count exchange is needed);
2. each rank computes the partial attention output of every shard it holds (`shard_attention`: its q/k/v
   head slices, its KV shard, its o_proj column slice), the lead included (shard 0);
3. combine: the partials go back to their leads (the reverse all_to_all_single), and each lead sums them in
   shard order and adds o_proj's bias once, as the single-process runner does, then the residual.
Every rank enters both all-to-alls of every layer of a forward in which any rank has a partitioned sequence,
with zero rows if it has nothing to send (they are collectives, as ExpertParallelMoE's are); a forward with no
partitioned sequence anywhere skips them on every rank alike (the command says so to all). Their seconds are
counted in `Comm.comm_s` (communication), the shards' compute in the rank's attention seconds.

Why outputs equal the single-process executor's: the same rows go through the same layer norm on the lead,
each shard's GEMMs see the same rows in the same order (the group's sequences in the order the runner plans
them, `groups_of`), and the partials are added in the same order (shard 0, 1, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.core.sequences import InvariantError
from batchgen.dist.comm import Comm
from batchgen.core.reshard import overlaps, shard_units
from batchgen.dist.kv_transfer import recv_rows, send_rows
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models.tensor_parallel import shard_attention
from batchgen.exec.shards import (Count, holding, part_of, place_holding, release_holding, shards_of,
                                   write_host)


@dataclass
class Group:
    """The partitioned sequences of one lead and one degree in a forward: one shard piece per rank of the group."""

    lead: int
    degree: int
    seq_ids: list[int]
    new_counts: list[int]
    start_positions: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.new_counts)

    def members(self, ranks: int) -> list[int]:
        """Rank of shard j, for j = 0 (the lead) .. degree - 1."""
        return [(self.lead + j) % ranks for j in range(self.degree)]


def groups_of(lead: int, seq_ids: list[int], new_counts: list[int], start_positions: list[int],
              tp: list[int]) -> list[Group]:
    """A lead rank's partition groups in a forward, in the order `InstanceRunner._plan` makes their pieces:
    degrees ascending, each group's sequences by context length (stable)."""
    if not tp:
        return []
    order = sorted(range(len(seq_ids)), key=lambda i: start_positions[i] + new_counts[i])
    out = []
    for degree in sorted({d for d in tp if d > 1}):
        idx = [i for i in order if tp[i] == degree]
        out.append(Group(lead, degree, [seq_ids[i] for i in idx], [new_counts[i] for i in idx],
                         [start_positions[i] for i in idx]))
    return out


@dataclass
class _Served:
    """A shard this rank holds of another lead's group in this forward, and its metadata (shard coordinates)."""

    group: Group
    shard: int
    meta: AttentionMetadata


class HeadShardExchange:
    """One rank's part in the head-sharded attention of partitioned sequences (the runner's `partition` hook)."""

    def __init__(self, comm: Comm, cache: PagedKVCache):
        self.comm, self.cache = comm, cache
        self.store = shards_of(cache)
        self.groups: list[Group] = []
        self._led: list[Group] = []
        self._served: list[_Served] = []
        self.layers = 0       # layers exchanged (each: two all-to-alls), over the run
        self.sent_bytes = 0   # rows this rank sent in them (normed hidden rows out, partial outputs back)

    def begin(self, parts: list) -> None:
        """Before a forward, on every rank: every lead's groups (from the broadcast command's per-rank parts,
        `worker.ForwardPart`), and the metadata of the shards this rank holds for other leads (its shard pools
        grow by the new tokens now, once per forward, as the lead's own shard does in `_plan`)."""
        P, me = self.comm.size, self.comm.rank
        if len(parts) != P:
            raise InvariantError(f"a forward command of {len(parts)} parts on a group of {P} ranks")
        self.groups = [g for r, p in enumerate(parts)
                       for g in groups_of(r, p.seq_ids, p.new_counts, p.start_positions, p.tp)]
        for g in self.groups:
            if g.degree > P:
                raise InvariantError(f"sequences {g.seq_ids} are partitioned over {g.degree} ranks; the instance "
                                     f"has {P} processes")
        self._led = [g for g in self.groups if g.lead == me]
        self._served = []
        for g in self.groups:  # leads in rank order, degrees ascending: the order their rows arrive in
            members = g.members(P)
            if g.lead != me and me in members:
                j = members.index(me)
                self._served.append(_Served(g, j, self.store.prepare(g.seq_ids, g.new_counts, g.start_positions)))

    def _splits(self) -> tuple[list[int], list[int]]:
        """Rows this rank sends to each rank (its groups' tokens, once per other member) and receives from each
        (the tokens of the groups it serves, by lead)."""
        P = self.comm.size
        send, recv = [0] * P, [0] * P
        for g in self._led:
            for q in g.members(P)[1:]:
                send[q] += g.tokens
        for s in self._served:
            recv[s.group.lead] += s.group.tokens
        return send, recv

    def layer(self, model, layer: int, hidden: torch.Tensor, pieces: list, timer) -> None:
        """Layer `layer`'s attention for every partitioned sequence of the instance, this rank's part of it:
        `pieces` are the runner's shard-0 pieces of the groups this rank leads (rows in `hidden`, metadata in
        its own shard pool); their rows get attention output + residual in place."""
        if not self.groups:
            return
        if [p.seq_ids for p in pieces] != [g.seq_ids for g in self._led]:
            raise InvariantError(f"rank {self.comm.rank} plans partitioned pieces {[p.seq_ids for p in pieces]} "
                                 f"but the command makes it lead {[g.seq_ids for g in self._led]}")
        P = self.comm.size
        block = model.layers[layer]
        attn = block.self_attn
        start = timer.start()
        xs = [block.input_layernorm(hidden[p.rows]) for p in pieces]
        send_splits, recv_splits = self._splits()
        x_send = torch.cat([x for q in range(P) for g, x in zip(self._led, xs) if q in g.members(P)[1:]]
                           or [hidden.new_empty(0, hidden.shape[1])])
        timer.stop(start, 0)
        x_recv = hidden.new_empty(sum(recv_splits), hidden.shape[1])
        self.comm.all_to_all_single(x_recv, x_send, recv_splits, send_splits, what="PARTITION dispatch")
        start = timer.start()
        own = [shard_attention(attn, x, p.meta, self.store.layer(layer, p.degree), 0, p.degree)
               for p, x in zip(pieces, xs)]
        partials, row = [], 0
        for s in self._served:
            x = x_recv[row:row + s.group.tokens]
            row += s.group.tokens
            partials.append(shard_attention(attn, x, s.meta, self.store.layer(layer, s.group.degree), s.shard,
                                            s.group.degree))
        y_send = torch.cat(partials) if partials else hidden.new_empty(0, hidden.shape[1])
        timer.stop(start, 0)
        y_recv = hidden.new_empty(sum(send_splits), hidden.shape[1])
        self.comm.all_to_all_single(y_recv, y_send, send_splits, recv_splits, what="PARTITION combine")
        start = timer.start()
        # y_recv: by source rank, each source's partials of this rank's groups in degree order
        offsets, row = {}, 0
        for q in range(P):
            for i, g in enumerate(self._led):
                if q in g.members(P)[1:]:
                    offsets[(q, i)] = row
                    row += g.tokens
        bias = attn.o_proj.bias
        for i, (g, p) in enumerate(zip(self._led, pieces)):
            total = own[i]
            for q in g.members(P)[1:]:  # shard order, as the single-process sum
                total = total + y_recv[offsets[(q, i)]:offsets[(q, i)] + g.tokens]
            hidden[p.rows] = hidden[p.rows] + (total if bias is None else total + bias)
        timer.stop(start, 0)
        self.layers += 1
        self.sent_bytes += (x_send.numel() + y_send.numel()) * hidden.element_size()


# ---- KV moves ---------------------------------------------------------------------------------------------

def reshard_kv(comm: Comm, cache: PagedKVCache, seq_id: int, old: tuple[int, ...], new: tuple[int, ...],
               count: Count, device=None) -> None:
    """A running sequence from group `old` to group `new` (ranks of `comm`, lead first; a group of one holds the
    whole KV in its pages), on each rank of either: it sends the parts of what it holds that another rank of the
    new group needs, receives the parts of its new shard it lacks (`count`ed), then gives up its old holding and
    takes its new one (`shards.reshard` in one process)."""
    device = torch.device("cpu") if device is None else device
    me = comm.rank
    by_heads = shards_of(cache).split
    mine = holding(cache, seq_id, len(old)) if me in old else None
    parts = []
    for p in overlaps(tuple(old), tuple(new), by_heads):
        if p.src == me:
            rows = part_of(mine, p, shard_units(old.index(me), len(old), p.units), by_heads)
            if p.dst == me:
                parts.append(rows)
            else:
                send_rows(comm, seq_id, rows.contiguous(), p.dst, device)
        elif p.dst == me:
            rows = recv_rows(comm, seq_id, p.src, device).to(cache.device)
            count(p, rows.numel() * rows.element_size())
            parts.append(rows)
    if me in old:
        release_holding(cache, seq_id, len(old))
    if me in new:
        place_holding(cache, seq_id, len(new), new.index(me), torch.cat(parts, dim=3) if by_heads else parts[0])


def gather_to_host_kv(comm: Comm, cache: PagedKVCache, seq_id: int, group: tuple[int, ...], count: Count,
                      device=None) -> int:
    """A partitioned sequence's lead (group[0]) brings its host copy up to date, on each rank of `group`: the lead
    tells the others how many tokens its copy holds, they send their shards of the rest (`count`ed on the lead:
    MLA's lead holds the whole latent, so nobody sends), the lead writes it down (`shards.gather_to_host` in one
    process). Returns the bytes the lead wrote (device -> host); 0 on the other ranks. The shards stay."""
    device = torch.device("cpu") if device is None else device
    me, lead = comm.rank, group[0]
    store = shards_of(cache)
    start = torch.zeros(1, dtype=torch.int64)
    if me == lead:
        start[0] = cache.synced_tokens(seq_id) if seq_id in cache else 0
    if store.split:  # the members need to know which tokens the lead lacks
        for g in group[1:]:
            if me == lead:
                comm.send(start.to(device), g, what=f"host copy length of sequence {seq_id}")
            elif me == g:
                got = torch.empty(1, dtype=torch.int64, device=device)
                comm.recv(got, lead, what=f"host copy length of sequence {seq_id}")
                start[0] = int(got.item())
    if store.length(seq_id) == int(start[0]):
        return 0
    mine = holding(cache, seq_id, len(group), int(start[0]))
    parts = []
    for p in overlaps(tuple(group), (lead,), store.split):
        if p.src == me == p.dst:
            parts.append(part_of(mine, p, shard_units(0, len(group), p.units), store.split))
        elif p.src == me:
            rows = part_of(mine, p, shard_units(group.index(me), len(group), p.units), store.split)
            send_rows(comm, seq_id, rows.contiguous(), lead, device)
        elif p.dst == me:
            rows = recv_rows(comm, seq_id, p.src, device).to(cache.device)
            count(p, rows.numel() * rows.element_size())
            parts.append(rows)
    if me != lead:
        return 0
    return write_host(cache, seq_id, int(start[0]), torch.cat(parts, dim=3) if store.split else parts[0])
