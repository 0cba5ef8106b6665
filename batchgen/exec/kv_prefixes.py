"""A paged cache's shared prompt prefixes: pages that several sequences hold by reference (the executors' side of
batchgen.core.prefix_pages, performed from the state's `share` ops).

A group's prefix is the first pages of the sequence that created it; a sequence that takes it starts its page list
with those pages and its KV at the prefix's end, so its prefill writes only the rest and attention reads the
prefix from the same pages as every other holder. A shared page is never written again (a holder's new tokens land
past the prefix, in its own pages). The prefix itself holds its pages too, until the state drops it (`unshare`): a
page goes back to the free list when neither the prefix nor any sequence holds it (`_free_device`).

Below a page (a `tail`, copy-on-write): the shared tokens past the prefix's whole pages are copied into a taker's
first own page, its KV starting past them. In the forward that writes the prefix, the creator's rows for them are
written to those slots too, beside its own (`AttentionMetadata.fanout_*`, attached by `prepare`), before any
taker's attention reads them; the prefix may keep them in one page of its own, from which later takers copy.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.core.sequences import InvariantError
from batchgen.exec.kv_pages import CacheFullError, _Seq


class SharedPrefixes:
    """Reference counts of shared pages, mixed into `PagedKVCache` (which owns `_seqs`, `_free` and `page_size`)."""

    def _prefixes_init(self) -> None:
        self._refs: dict[int, int] = {}              # shared page -> holders: its prefix and each sequence
        self._prefix_pages: dict[int, list[int]] = {}  # group -> its prefix's pages in this cache
        # sequences whose coming forward writes a prefix others may read in it -> their wave: 0, or one past the
        # wave of the creator whose prefix (an outer level written in the same forward) they read
        self._creating: dict[int, int] = {}
        self._reads_from: dict[int, int] = {}  # takers of a prefix written in the same forward -> its creator
        self._attached: set[int] = set()  # host copies holding a prefix here, about to restore the rest (`restore`)
        self._prefix_tail: dict[int, tuple[int, int]] = {}  # group -> (its tail's page, tokens in it)
        self._creator_of: dict[int, int] = {}  # group -> the sequence whose coming forward writes its prefix here
        self._fanout: dict[int, list[tuple[int, list[int]]]] = {}  # writer -> (first position, slots it fills)

    def share_prefix(self, seq_id: int, group: int, tokens: int, creates: bool, tail: int = 0,
                     resuming: bool = False) -> int:
        """creates: the sequence's first `tokens` tokens (its prefill writes them) become the group's prefix here,
        their pages taken now, and its next `tail` tokens the prefix's tail, in a page of its own; else the sequence
        (new to this cache, or a host copy about to be restored: here, or with `resuming` from another cache of the
        node's pool, `kv_migration.migrate`) holds the group's prefix pages and its KV on device starts at `tokens`,
        past its `tail` tokens copied into its first own page. Returns the bytes the tail's copies write (now, or in
        the coming forward)."""
        if tokens % self.page_size or tokens < self.page_size or not 0 <= tail < self.page_size:
            raise InvariantError(f"a shared prefix is whole pages of {self.page_size} tokens and a tail of less than "
                                 f"a page, got {tokens} and {tail}")
        n = tokens // self.page_size
        if creates:
            if group in self._prefix_pages:
                raise InvariantError(f"group {group} already has a prefix in this cache")
            self._grow_to({seq_id: max(tokens, self._resident_tokens(seq_id))}, f"group {group}'s prefix")
            pages = self._seqs[seq_id].pages[:n]
            reads = self._reads_from.get(seq_id)
            self._creating[seq_id] = 0 if reads is None else self._creating.get(reads, 0) + 1
            self._creator_of[group] = seq_id
            self._prefix_pages[group] = pages
            for p in pages:  # the prefix's own hold, then its creator's (counted already on an outer level's pages)
                self._refs[p] = self._refs[p] + 1 if p in self._refs else 2
            if tail:
                if not self._free:
                    raise CacheFullError(f"group {group}'s prefix tail", 1, 0, self.num_pages, self.page_size)
                page = self._free.pop()
                self._prefix_tail[group] = (page, tail)
                self._fanout.setdefault(seq_id, []).append((tokens, [page * self.page_size + j for j in range(tail)]))
            return tail * self.bytes_per_token
        pages = self._prefix_pages.get(group)
        if pages is None or len(pages) != n:
            raise InvariantError(f"sequence {seq_id} takes group {group}'s prefix of {tokens} tokens, which this "
                                 "cache does not hold")
        s = self._seqs.get(seq_id)
        if s is None:
            s = self._seqs[seq_id] = _Seq(pages=list(pages), device_len=tokens)
            if resuming:
                self._attached.add(seq_id)
        elif not s.pages and s.synced > tokens and not s.pending and not tail:  # its host copy is restored next
            s.pages, s.device_len = list(pages), tokens
            self._attached.add(seq_id)
        else:
            raise InvariantError(f"sequence {seq_id} takes a prefix but already has KV on device in this cache")
        for p in pages:
            self._refs[p] += 1
        creator = self._creator_of.get(group)
        if creator is not None:  # it reads a prefix written in the same forward: if it writes one too, after that
            self._reads_from[seq_id] = creator
        if tail:
            self._copy_tail(seq_id, s, group, tokens, tail)
        return tail * self.bytes_per_token

    def fetch_prefix(self, group: int, tokens: int, tail: int, source: "SharedPrefixes", parent: int = -1) -> int:
        """The group's prefix (`tokens` in whole pages, and `tail`) copied from another cache's, held here by the
        prefix alone until sequences take it; past `parent`'s prefix here (an outer level: its pages are this one's
        first, held once more), which is not copied. Returns the bytes copied."""
        return self.adopt_prefix(group, tokens, tail, source.prefix_rows(group, tokens, tail, parent), parent)

    def prefix_rows(self, group: int, tokens: int, tail: int, parent: int = -1) -> torch.Tensor:
        """The KV of the group's prefix here past `parent`'s (an outer level the destination holds: as many pages
        there as here), and its tail: what a copy to another cache carries ([layers, planes, tokens, ...], as
        `migration_rows`)."""
        skip = len(self._prefix_pages.get(parent, [])) if parent >= 0 else 0
        pages, kept = self._prefix_pages.get(group), self._prefix_tail.get(group, (-1, 0))
        if pages is None or len(pages) != tokens // self.page_size or kept[1] < tail or skip >= len(pages):
            raise InvariantError(f"group {group}'s prefix of {tokens} + {tail} tokens copied from a cache that does "
                                 f"not hold it (past {skip} pages)")
        src = [p * self.page_size + j for p in pages[skip:] for j in range(self.page_size)]
        src += [kept[0] * self.page_size + j for j in range(tail)]
        return self._device_flat().index_select(2, torch.tensor(src, dtype=torch.int64, device=self.device))

    def adopt_prefix(self, group: int, tokens: int, tail: int, rows: torch.Tensor, parent: int = -1) -> int:
        """A copy of the group's prefix (`prefix_rows` of another cache's) lands here: past `parent`'s prefix here
        when given (its pages are this one's first, held once more), held by the prefix alone until sequences take
        it. Returns the bytes copied."""
        n = tokens // self.page_size
        outer = self._prefix_pages.get(parent, []) if parent >= 0 else []
        if group in self._prefix_pages or (parent >= 0 and (not outer or len(outer) >= n)):
            raise InvariantError(f"group {group}'s prefix copied into a cache that holds it, or past group {parent}'s, "
                                 "which it does not hold shorter")
        n -= len(outer)
        if rows.shape[2] != n * self.page_size + tail:
            raise InvariantError(f"group {group}'s prefix copy carries {rows.shape[2]} tokens, not {n} pages + {tail}")
        need = n + (tail > 0)
        if need > len(self._free):
            raise CacheFullError(f"group {group}'s prefix copied in", need, len(self._free), self.num_pages,
                                 self.page_size)
        mine = [self._free.pop() for _ in range(need)]
        dst = [p * self.page_size + j for p in mine for j in range(self.page_size)][:rows.shape[2]]
        self._device_flat().index_copy_(2, torch.tensor(dst, dtype=torch.int64, device=self.device),
                                        rows.to(self.device))
        self._prefix_pages[group] = list(outer) + mine[:n]
        for p in outer:
            self._refs[p] += 1
        for p in mine[:n]:
            self._refs[p] = 1  # the prefix's own hold
        if tail:
            self._prefix_tail[group] = (mine[n], tail)
        return (n * self.page_size + tail) * self.bytes_per_token

    def _copy_tail(self, seq_id: int, s: _Seq, group: int, tokens: int, tail: int) -> None:
        """A taker's first own page gets the prefix's `tail` tokens past `tokens`: from its creator's rows in the
        forward that writes them, else from the prefix's tail page now."""
        self._grow_to({seq_id: tokens + tail}, f"group {group}'s prefix tail")
        s.device_len = tokens + tail
        slots = [s.pages[tokens // self.page_size] * self.page_size + j for j in range(tail)]
        creator = self._creator_of.get(group)
        if creator is not None:
            self._fanout.setdefault(creator, []).append((tokens, slots))
            return
        page, kept = self._prefix_tail.get(group, (-1, 0))
        if kept < tail:
            raise InvariantError(f"sequence {seq_id} copies {tail} tail tokens of group {group}'s prefix, of which "
                                 f"this cache keeps {kept}")
        flat = self._device_flat()
        src = torch.arange(page * self.page_size, page * self.page_size + tail, device=self.device)
        flat.index_copy_(2, torch.tensor(slots, dtype=torch.int64, device=self.device), flat.index_select(2, src))

    def fanout(self, seq_ids: list[int], new_tokens: list[int], start_positions: list[int]):
        """(rows, slots) of a call's rows that a prefix's writer also writes elsewhere (its tail, for the prefix and
        its takers), taken now; None when none of its sequences has any."""
        if not self._fanout:
            return None
        rows: list[int] = []
        slots: list[int] = []
        offset = 0
        for sid, n, p in zip(seq_ids, new_tokens, start_positions):
            for first, dest in self._fanout.pop(sid, ()):
                if not (p <= first and first + len(dest) <= p + n):
                    raise InvariantError(f"sequence {sid} writes its prefix's tail [{first}, {first + len(dest)}) "
                                         f"outside this call's tokens [{p}, {p + n})")
                rows.extend(range(offset + first - p, offset + first - p + len(dest)))
                slots.extend(dest)
            offset += n
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)

    def unshare_prefix(self, group: int) -> None:
        """The group's prefix leaves this cache: its pages go as their last holder does."""
        pages = self._prefix_pages.pop(group, None)
        if pages is None:
            raise InvariantError(f"group {group} has no prefix in this cache to drop")
        self._release_pages(pages)
        tail = self._prefix_tail.pop(group, None)
        if tail is not None:  # its tail's page is its own
            self._free.append(tail[0])

    def untail_prefix(self, group: int) -> None:
        """The group's prefix lets its tail's page go (later takers compute those tokens)."""
        tail = self._prefix_tail.pop(group, None)
        if tail is None:
            raise InvariantError(f"group {group}'s prefix keeps no tail in this cache to drop")
        self._free.append(tail[0])

    def cascade_metadata(self, meta, seq_ids: list[int], group: int):
        """`meta` of a call whose decode queries all hold `group`'s prefix here, as a cascaded call
        (batchgen.core.cascade): the prefix's pages, read once by the call."""
        pages = self._prefix_pages.get(group)
        if pages is None:
            raise InvariantError(f"a cascade over group {group}'s prefix, which this cache does not hold")
        n = len(pages)
        for sid in seq_ids:
            if self._seqs[sid].pages[:n] != pages:
                raise InvariantError(f"sequence {sid} is cascaded over group {group}'s prefix but does not hold it")
        if not all(q == 1 for q in meta.query_lens().tolist()):
            raise InvariantError("a cascaded call holds decode queries only (one new token each)")
        meta.prefix_pages = torch.tensor(pages, dtype=torch.int64, device=meta.block_table.device)
        meta.prefix_tokens = n * self.page_size
        return meta

    def drop_prefixes(self) -> None:
        """Every prefix leaves this cache (a recovery: the next generation's state starts with none); a sequence
        that holds one keeps its pages, which go with it."""
        for group in list(self._prefix_pages):
            self.unshare_prefix(group)
        self._creating.clear()
        self._reads_from.clear()
        self._attached.clear()
        self._creator_of.clear()
        self._fanout.clear()

    def share_host_prefix(self, seq_id: int, group: int, tokens: int, creates: bool) -> None:
        """Before the sequence's first host copy is written (batchgen.core.host_prefixes): its first `tokens` tokens
        are its group's prefix in this node's host pool, held by reference. A taker's copy then holds them written
        already (its write covers the rest); a creator's gets fresh pages for them, which its write fills."""
        s = self._get(seq_id)
        if s.host_pages or s.synced or tokens % self.page_size or tokens < self.page_size:
            raise InvariantError(f"sequence {seq_id}: a host prefix of {tokens} tokens is taken by a host copy not yet "
                                 f"written, in whole pages of {self.page_size}")
        s.host_pages = self.host_pool.hold_prefix(group, tokens // self.page_size, creates,
                                                  f"group {group}'s host prefix")
        s.host_group = group
        if not creates:
            s.synced = tokens

    def take_creating(self) -> dict[int, int]:
        """The sequences whose forward writes a prefix that others read in the same forward (their attention must
        run first, wave by wave: a nested level's creator after the creator of the level it reads) -> their wave,
        once: the forward that asks is that one."""
        creating, self._creating = self._creating, {}
        self._creator_of.clear()  # takers from here on copy from the prefix's tail page
        self._reads_from.clear()
        return creating

    def _free_device(self, s: _Seq) -> None:
        """The sequence's pages go back to the free list, a shared one only with its last holder."""
        if self._refs:
            self._release_pages(s.pages)
        else:
            self._free.extend(reversed(s.pages))
        s.pages, s.device_len = [], 0

    def _release_pages(self, pages: list[int]) -> None:
        """One holder lets go of each page: an unshared page, or a shared one's last holder, frees it."""
        freed = []
        for p in pages:
            n = self._refs.get(p)
            if n is None:
                freed.append(p)
            elif n == 1:
                del self._refs[p]
                freed.append(p)
            else:
                self._refs[p] = n - 1
        self._free.extend(reversed(freed))

    def _check_prefixes(self, owned: list[int]) -> list[int]:
        """The pages the sequences and the prefixes own, each once; raises InvariantError where a shared page's
        count is wrong."""
        counts: dict[int, int] = {}
        tails = [page for page, _ in self._prefix_tail.values()]
        for p in owned + [p for pages in self._prefix_pages.values() for p in pages] + tails:
            counts[p] = counts.get(p, 0) + 1
        for p, n in counts.items():
            if n != self._refs.get(p, 1):
                raise InvariantError(f"page {p} is owned twice or lost a holder: {n} sequences hold it, "
                                     f"{self._refs.get(p, 0)} counted as sharing it")
        return list(counts)


def share_host_prefixes(state, caches: list, ids: np.ndarray, gpus: np.ndarray) -> None:
    """The host copies these yields and offloads write hold their node's host prefix where the state's primitives
    had them take or create it (`ClusterState.host_held`; batchgen.core.host_prefixes), in the order the state made
    them: the first of a group on a node creates it."""
    if not state.host_sharing:
        return
    for sid, g in zip(ids.tolist(), gpus.tolist()):
        tokens, cache = int(state.host_held[sid]), caches[g]
        if tokens and not cache.host_pages(sid):  # a copy written now (one written earlier holds its prefix)
            group = int(state.prefix_group[sid])
            cache.share_host_prefix(sid, group, tokens, creates=group not in cache.host_pool.prefixes)
