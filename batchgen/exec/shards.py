"""Head shards of PARTITIONed sequences, kept in a rank's device pool beside its whole sequences.

A sequence partitioned over `degree` ranks keeps, on each rank of its group, the K/V of its shard of KV heads
(GQA) or a replica of its latent (MLA). A shard is stored in pages of the rank's own pool, taken from the same
free list, so the device budget is shared: a page of [page_size, kv_heads, head_dim] holds page_size * degree
tokens of kv_heads / degree heads (the same bytes viewed another way), so a shard needs 1/degree of the pages
(a latent replica needs all of them). Attention reads a shard through `layer(l, degree)`, a view of the pool in
that geometry, with metadata from `prepare` in the same coordinates.

While partitioned, a sequence's host copy keeps what it held when it was split; `take` returns the shard's
whole KV (new tokens included) when the sequence is joined again, and the lead rank appends the new tokens to
the host copy then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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

    def take(self, seq_id: int) -> torch.Tensor:
        """The shard's whole KV [layers, planes, tokens, heads, head_dim], and its pages back to the pool."""
        s = self._shards.pop(seq_id)
        kv = self._flat(s.degree).index_select(2, self._slots(s, 0, s.length).to(self.cache.device))
        self.cache._free.extend(reversed(s.pages))
        return kv

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


def host_shards(lead: PagedKVCache, seq_id: int, degree: int) -> list[torch.Tensor]:
    """The lead's host copy of a sequence cut into its `degree` head shards (GQA; MLA: the latent, replicated),
    each [layers, planes, tokens, heads, head_dim]: shard j is what rank j of the group holds."""
    tokens = lead.synced_tokens(seq_id)
    pages = torch.tensor(lead.host_pages(seq_id), dtype=torch.int64)
    host = lead._host.index_select(2, pages)  # [layers, planes, pages, page_size, heads, head_dim]
    kv = host.reshape(host.shape[0], host.shape[1], -1, *host.shape[-2:])[:, :, :tokens]
    store = shards_of(lead)
    heads = store.heads(degree)
    return [kv[..., j * heads:(j + 1) * heads, :] if store.split else kv for j in range(degree)]


def split(group: list[PagedKVCache], seq_id: int, degree: int) -> list[int]:
    """PARTITION: group[0] (the lead) holds the sequence host-only with a complete host copy; shard j of its KV
    goes to group[j]'s pool. Returns the bytes written to each rank's device (host -> device: the resharding
    traffic)."""
    moved = []
    for j, (cache, part) in enumerate(zip(group, host_shards(group[0], seq_id, degree))):
        shards_of(cache).put(seq_id, degree, j, part)
        moved.append(part.numel() * part.element_size())
    return moved


def join_host(lead: PagedKVCache, seq_id: int, parts: list[torch.Tensor]) -> None:
    """The shards taken back from every rank of the group (in shard order) into the lead's host copy: what it
    lacks (the tokens decoded while partitioned) is appended; the lead then holds the sequence host-only."""
    kv = torch.cat(parts, dim=3) if shards_of(lead).split else parts[0]
    have = lead.synced_tokens(seq_id)
    new = kv.shape[2] - have
    if new > 0:
        meta = lead.prepare_host([seq_id], [new], [have])
        lead.write_host_tokens(meta.slot_mapping, kv[:, :, have:].to("cpu"))
        lead.host_advance([seq_id])


def join(group: list[PagedKVCache], seq_id: int) -> list[int]:
    """Undo `split`: gather the shards (with the tokens decoded since) and append what the lead's host copy
    lacks; the lead then holds the sequence host-only again. Returns the bytes gathered from each rank's device
    (device -> host)."""
    parts = [shards_of(cache).take(seq_id) for cache in group]
    join_host(group[0], seq_id, parts)
    return [p.numel() * p.element_size() for p in parts]
