"""Head shards of PARTITIONed sequences, kept in a rank's device pool beside its whole sequences.

A sequence partitioned over `degree` ranks keeps, on each rank of its group, the K/V of its shard of KV heads
(GQA) or a replica of its latent (MLA). A shard is stored in pages of the rank's own pool, taken from the same
free list, so the device budget is shared: a page of [page_size, kv_heads, head_dim] holds page_size * degree
tokens of kv_heads / degree heads (the same bytes viewed another way), so a shard needs 1/degree of the pages
(a latent replica needs all of them). Attention reads a shard through `layer(l, degree)`, a view of the pool in
that geometry, with metadata from `prepare` in the same coordinates.

KV moves (batchgen.core.reshard: what the state prices, part by part). A running sequence is held by a group: its
lead's device pages (a group of one) or its shards. `reshard` takes it from one group to another device to device:
every GPU of the new group receives the parts of its shard it lacks from the GPUs that hold them (counted, per
receiving GPU) and keeps the parts it holds (re-laid out in its own pool: a copy within the device, uncounted): a
split turns the lead's pages into its shard 0 and sends the other shards (MLA: replicas) to the group, a join
builds the lead's pages from the shards. A partitioned sequence's host copy, when it has one, stays in its lead's
cache (a host-only entry beside the lead's shard) and is brought up to date by `gather_to_host`: the lead takes the
group's shards of the tokens its copy lacks (counted) and writes them down (host_sync's checkpoint; a YIELD of the
sequence). Without a host copy the lead's cache holds no entry for the sequence while it is partitioned, only its
shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from batchgen.core.reshard import Part, overlaps, shard_units
from batchgen.core.sequences import InvariantError
from batchgen.exec.kv_cache import CacheFullError, PagedKVCache
from batchgen.exec.metadata import AttentionMetadata


@dataclass(eq=False)
class _Shard:
    degree: int
    shard: int
    pages: list[int] = field(default_factory=list)
    length: int = 0


class ShardStore:
    """The head shards one rank's cache holds, keyed by sequence id."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.split = cache.v_head_dim != 0  # K/V split by heads; MLA's latent (no V pool) is replicated
        self._shards: dict[int, _Shard] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._shards

    def seq_ids(self) -> list[int]:
        return list(self._shards)

    def owned_pages(self) -> list[int]:
        return [p for s in self._shards.values() for p in s.pages]

    def heads(self, degree: int) -> int:
        return self.cache.num_kv_heads // degree if self.split else self.cache.num_kv_heads

    def tokens_per_page(self, degree: int) -> int:
        return self.cache.page_size * (degree if self.split else 1)

    def layer(self, l: int, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's pools viewed in the shard geometry of `degree`: [pages, tokens per page, heads, head_dim]."""
        k, v = self.cache.layer(l)
        if not self.split:
            return k, v
        shape = (k.shape[0], self.tokens_per_page(degree), self.heads(degree), k.shape[-1])
        return k.view(shape), v.view(shape)

    def _flat(self, degree: int) -> torch.Tensor:
        """Every layer and plane of the pool as [layers, planes, slots, heads, head_dim] in this geometry."""
        kv = self.cache._kv
        return kv.view(kv.shape[0], kv.shape[1], -1, self.heads(degree), kv.shape[-1])

    def _grow(self, s: _Shard, tokens: int, what: str) -> None:
        need = -(-tokens // self.tokens_per_page(s.degree)) - len(s.pages)
        free = self.cache._free
        if need > len(free):
            raise CacheFullError(what, need, len(free), self.cache.num_pages, self.cache.page_size)
        s.pages.extend(free.pop() for _ in range(max(need, 0)))

    def _slots(self, s: _Shard, start: int, end: int) -> torch.Tensor:
        tpp = self.tokens_per_page(s.degree)
        pos = torch.arange(start, end)
        return torch.tensor(s.pages, dtype=torch.int64)[pos // tpp] * tpp + pos % tpp

    def put(self, seq_id: int, degree: int, shard: int, kv: torch.Tensor) -> None:
        """Adopt shard `shard` of `degree` of a sequence: kv [layers, planes, tokens, heads, head_dim]."""
        if seq_id in self._shards:
            raise ValueError(f"sequence {seq_id} already has a shard on this rank")
        s = _Shard(degree, shard)
        self._grow(s, kv.shape[2], f"shard {shard}/{degree} of sequence {seq_id}")
        self._shards[seq_id] = s
        s.length = kv.shape[2]
        self._flat(degree).index_copy_(2, self._slots(s, 0, s.length).to(self.cache.device),
                                       kv.to(self.cache.device, self.cache.dtype))

    def rows(self, seq_id: int, start: int = 0) -> torch.Tensor:
        """The shard's KV of tokens [start, length): [layers, planes, tokens, heads, head_dim] (a copy)."""
        s = self._shards[seq_id]
        return self._flat(s.degree).index_select(2, self._slots(s, start, s.length).to(self.cache.device))

    def length(self, seq_id: int) -> int:
        return self._shards[seq_id].length

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.cache._free.extend(reversed(self._shards.pop(sid).pages))

    def prepare(self, seq_ids: list[int], new_tokens: list[int], start_positions: list[int]) -> AttentionMetadata:
        """A step of partitioned sequences (all of one degree) in this rank's shard coordinates."""
        shards = [self._shards[sid] for sid in seq_ids]
        degree = shards[0].degree
        for sid, s, n, p in zip(seq_ids, shards, new_tokens, start_positions):
            if s.degree != degree:
                raise ValueError(f"one step of shards must share a degree: sequence {sid} has {s.degree}")
            if p != s.length:
                raise ValueError(f"sequence {sid}: its shard holds {s.length} tokens, the step starts at {p}")
            self._grow(s, p + n, f"a step of sequence {sid}'s shard")
        starts = torch.tensor(start_positions, dtype=torch.int64)
        lens = torch.tensor(new_tokens, dtype=torch.int64)
        width = max(len(s.pages) for s in shards)
        table = torch.full((len(shards), width), -1, dtype=torch.int64)
        for row, s in enumerate(shards):
            table[row, :len(s.pages)] = torch.tensor(s.pages, dtype=torch.int64)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(start_positions, new_tokens)])
        slots = torch.cat([self._slots(s, p, p + n) for s, p, n in zip(shards, start_positions, new_tokens)])
        query_starts = torch.zeros(len(shards) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=query_starts[1:])
        for s, n in zip(shards, new_tokens):
            s.length += int(n)
        return AttentionMetadata(positions, query_starts, starts + lens, table, slots,
                                 self.tokens_per_page(degree)).to(self.cache.device)

    def check(self) -> None:
        for sid, s in self._shards.items():
            if len(s.pages) * self.tokens_per_page(s.degree) < s.length:
                raise InvariantError(f"shard of sequence {sid}: {s.length} tokens in {len(s.pages)} pages")


def shards_of(cache: PagedKVCache) -> ShardStore:
    """The cache's shard store, made on first use."""
    store = getattr(cache, "shards", None)
    if store is None:
        store = cache.shards = ShardStore(cache)
    return store


def holding(cache: PagedKVCache, seq_id: int, degree: int, start: int = 0) -> torch.Tensor:
    """What this GPU holds of a running sequence, tokens [start, end): its whole KV from its device pages (a group
    of one) or its shard, [layers, planes, tokens, heads it holds, head_dim]."""
    if degree > 1:
        return shards_of(cache).rows(seq_id, start)
    rows, source = cache.migration_rows(seq_id)
    if source != "device":
        raise InvariantError(f"sequence {seq_id} is resharded from its GPU's pages, but it holds none there")
    return rows[:, :, start:]


def part_of(rows: torch.Tensor, part: Part, held: tuple[int, int], by_heads: bool) -> torch.Tensor:
    """The heads of `part` out of rows that hold units `held` of the KV (MLA: the whole replica)."""
    if not by_heads:
        return rows
    per_unit = rows.shape[3] // (held[1] - held[0])
    return rows[:, :, :, (part.lo - held[0]) * per_unit:(part.hi - held[0]) * per_unit]


def release_holding(cache: PagedKVCache, seq_id: int, degree: int) -> None:
    """This GPU gives up what it holds of a sequence in a group of `degree`: its shard, or (a group of one) its
    device pages, keeping the host copy it has (up to date: host_sync keeps it so), else forgetting it."""
    if degree > 1:
        shards_of(cache).release([seq_id])
        return
    s = cache._get(seq_id)
    if not s.synced:
        cache.release([seq_id])
    elif s.synced < s.device_len:
        raise InvariantError(f"sequence {seq_id}: its host copy holds {s.synced} of its {s.device_len} tokens; it "
                             "must be up to date before its pages are given up (host_sync)")
    else:
        cache._free_device(s)


def place_holding(cache: PagedKVCache, seq_id: int, degree: int, shard: int, kv: torch.Tensor) -> None:
    """This GPU takes its part of a sequence in a group of `degree`: shard `shard`, or (a group of one) the whole
    KV in its device pages, beside the host copy it may hold."""
    if degree > 1:
        shards_of(cache).put(seq_id, degree, shard, kv)
        return
    if seq_id not in cache:
        cache.adopt(seq_id, kv, "device", to_device=True, host_copy=False)
        return
    s, n = cache._get(seq_id), kv.shape[2]
    if s.on_device or s.pending or s.synced > n:
        raise InvariantError(f"sequence {seq_id} cannot take {n} tokens onto its lead's pages: it holds "
                             f"{s.device_len} on device, {s.synced} on host")
    cache._grow_to({seq_id: n}, f"joining sequence {seq_id} ({n} tokens)")
    cache._write_device(cache._token_slots([s], "pages", [0], [n]), kv)
    s.device_len = n


Count = Callable[[Part, int], None]  # a part copied from one GPU to another, and its bytes


def reshard(caches: list[PagedKVCache], seq_id: int, old: tuple[int, ...], new: tuple[int, ...],
            count: Count) -> None:
    """A running sequence goes from group `old` to group `new` (GPUs, lead first; a group of one holds the whole KV
    in its pages), device to device: each part of each new shard comes from the GPU that holds it
    (`batchgen.core.reshard.overlaps`), `count`ed where it crosses to another GPU. Everything is read before
    anything is given up, so a GPU of both groups rebuilds its part from what it held."""
    by_heads = shards_of(caches[old[0]]).split
    held = {g: holding(caches[g], seq_id, len(old)) for g in old}
    parts: dict[int, list[torch.Tensor]] = {g: [] for g in new}
    for p in overlaps(tuple(old), tuple(new), by_heads):
        rows = part_of(held[p.src], p, shard_units(old.index(p.src), len(old), p.units), by_heads)
        if p.src != p.dst:
            rows = rows.to(caches[p.dst].device, copy=True)
            count(p, rows.numel() * rows.element_size())
        parts[p.dst].append(rows)
    for g in old:
        release_holding(caches[g], seq_id, len(old))
    for k, g in enumerate(new):
        place_holding(caches[g], seq_id, len(new), k, torch.cat(parts[g], dim=3) if by_heads else parts[g][0])


def gather_to_host(caches: list[PagedKVCache], seq_id: int, group: tuple[int, ...], count: Count) -> int:
    """A partitioned sequence's lead (group[0]) brings its host copy up to date: it takes every shard's part of
    the tokens the copy lacks (`count`ed: the other GPUs', as a join to the lead would move them) and writes them
    down, making the host copy if it has none. Returns the bytes written (device -> host); the shards stay."""
    lead = caches[group[0]]
    start = lead.synced_tokens(seq_id) if seq_id in lead else 0
    if shards_of(lead).length(seq_id) == start:
        return 0
    by_heads = shards_of(lead).split
    held = {g: holding(caches[g], seq_id, len(group), start) for g in group}
    parts = []
    for p in overlaps(tuple(group), (group[0],), by_heads):
        part = part_of(held[p.src], p, shard_units(group.index(p.src), len(group), p.units), by_heads)
        if p.src != p.dst:
            part = part.to(lead.device, copy=True)
            count(p, part.numel() * part.element_size())
        parts.append(part)
    return write_host(lead, seq_id, start, torch.cat(parts, dim=3) if by_heads else parts[0])


def write_host(lead: PagedKVCache, seq_id: int, start: int, kv: torch.Tensor) -> int:
    """The lead writes a partitioned sequence's tokens [start, start + kv's) down into its host copy (making it at
    start 0); returns the bytes written (device -> host)."""
    if seq_id not in lead:
        lead.adopt(seq_id, kv, "device", to_device=False, host_copy=True)
    else:
        meta = lead.prepare_host([seq_id], [kv.shape[2]], [start])
        lead.write_host_tokens(meta.slot_mapping, kv.to("cpu"))
        lead.host_advance([seq_id])
    return kv.numel() * kv.element_size()


def drop(caches: list[PagedKVCache], seq_id: int, group: tuple[int, ...], keep_host_copy: bool) -> None:
    """A partitioned sequence leaves its group: every GPU drops its shard; the lead keeps its host copy (a
    yielded sequence's, brought up to date by `gather_to_host` first) or drops it too (finished, evicted)."""
    for g in group:
        shards_of(caches[g]).release([seq_id])
    if not keep_host_copy and seq_id in caches[group[0]]:
        caches[group[0]].release([seq_id])
