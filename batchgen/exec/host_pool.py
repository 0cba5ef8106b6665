"""A node's host memory for KV: the page pool that holds the host copies of its GPUs' sequences, within a budget.

Laid out like a device pool, [num_layers, planes, pages, page_size, kv_heads, head_dim] (pinned when a CUDA
device copies from it, so that copies are asynchronous DMA): token t of a host copy is at its page t // page_size,
slot t % page_size. The caches of one node's GPUs draw on one pool (`PagedKVCache(host_pool=...)`), as host
memory is the node's, not a GPU's: a sequence that moves between them hands its host pages over, and no byte
moves (what `ClusterState` prices for a host copy that stays on its node: nothing). backend=dist gives each
process a pool of its own.

The pool grows as copies need pages (doubling, which costs amortised O(1) copies per page) up to
`budget_pages`, never past it: a request beyond it raises `HostMemoryFullError` and changes nothing. The
budget comes from the machine (batchgen.exec.fits.host_pool_budget), and the scheduler's host accounting is
given what the pool surely holds (`tokens_within`), so a policy plans within it.
"""

from __future__ import annotations

import torch

from batchgen.core.sequences import InvariantError


class HostMemoryFullError(RuntimeError):
    """The host pool's budget cannot take the pages asked for. Nothing was allocated."""

    def __init__(self, what: str, needed: int, free: int, budget: int, page_bytes: int):
        self.needed, self.free, self.budget = needed, free, budget
        super().__init__(f"host KV pool full: {what} needs {needed} more host pages but only {free} are left of "
                         f"its budget of {budget} pages ({budget * page_bytes / 1e9:.3f} GB): the scheduler's host "
                         "accounting must keep its copies within it (raise backend.host_kv_gb, or give the "
                         "machine more memory)")


class HostPool:
    def __init__(self, num_layers: int, planes: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, *, pages: int, budget_pages: int | None = None, pinned: bool = False,
                 alloc=None):
        """pages: the initial size (at least one page, at most the budget); budget_pages: the most it may hold
        (None: no limit); alloc(shape, dtype) -> a zero-filled CPU tensor (default torch.zeros; backend=dist
        maps each pool onto a shared-memory file, batchgen.dist.shared_host)."""
        if budget_pages is not None and budget_pages < 1:
            raise ValueError(f"a host pool's budget must hold at least one page, got {budget_pages}")
        self.geometry = (num_layers, planes, page_size, num_kv_heads, head_dim, dtype)
        self.pinned, self.alloc, self.budget_pages = bool(pinned), alloc, budget_pages
        pages = max(1, int(pages))
        if budget_pages is not None:
            pages = min(pages, budget_pages)
        self.kv = self._new(pages)
        self.free = list(range(pages - 1, -1, -1))  # a stack; page 0 is handed out first
        # group -> [its host prefix's pages, host copies holding them] (batchgen.core.host_prefixes)
        self.prefixes: dict[int, list] = {}
        self.peak_used = 0
        self.users: list = []  # the caches that draw on it (their sequences own its pages)

    @property
    def page_bytes(self) -> int:
        layers, planes, page, heads, dim, dtype = self.geometry
        return layers * planes * page * heads * dim * torch.empty(0, dtype=dtype).element_size()

    def capacity_pages(self) -> int:
        return self.kv.shape[2]

    def used_pages(self) -> int:
        return self.kv.shape[2] - len(self.free)

    def fits(self, cache) -> bool:
        """Whether a cache's pages are laid out as this pool's."""
        return self.geometry == (cache.num_layers, cache.planes, cache.page_size, cache.num_kv_heads,
                                 cache.head_dim, cache.dtype)

    @torch.inference_mode(False)  # grown inside a forward too, and updated in place outside one
    def _new(self, pages: int) -> torch.Tensor:
        # zeros: pools must hold only finite values (attention may read padding slots with zero weight)
        layers, planes, page, heads, dim, dtype = self.geometry
        shape = (layers, planes, pages, page, heads, dim)
        if self.alloc is not None:
            return self.alloc(shape, dtype)
        return torch.zeros(*shape, dtype=dtype, pin_memory=self.pinned)

    def take(self, n: int, what: str) -> list[int]:
        """n free pages (the pool grows, within its budget, if it must); all or nothing."""
        short = n - len(self.free)
        if short > 0:
            old = self.capacity_pages()
            want = max(2 * old, old + short)
            if self.budget_pages is not None:
                if old + short > self.budget_pages:
                    raise HostMemoryFullError(what, n, len(self.free) + self.budget_pages - old, self.budget_pages,
                                              self.page_bytes)
                want = min(want, self.budget_pages)
            grown = self._new(want)
            grown[:, :, :old].copy_(self.kv)
            self.kv = grown
            self.free = list(range(want - 1, old - 1, -1)) + self.free
        pages = [self.free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.used_pages())
        return pages

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))

    def hold_prefix(self, group: int, pages: int, creates: bool, what: str) -> list[int]:
        """The pages of `group`'s host prefix, for one more host copy that holds them: `pages` fresh ones, which
        that copy writes, where it `creates` the prefix."""
        entry = self.prefixes.get(group)
        if creates != (entry is None) or (entry is not None and len(entry[0]) != pages):
            raise InvariantError(f"group {group}'s host prefix of {pages} pages: " + (
                "created again while this pool holds it" if creates else "taken, but this pool does not hold it"))
        if creates:
            entry = self.prefixes[group] = [self.take(pages, what), 0]
        entry[1] += 1
        return list(entry[0])

    def release_prefix(self, group: int) -> None:
        """A host copy lets go of its group's prefix: the last one's going frees its pages."""
        entry = self.prefixes[group]
        entry[1] -= 1
        if not entry[1]:
            del self.prefixes[group]
            self.give_back(entry[0])

    def flat(self) -> torch.Tensor:
        """[num_layers, planes, pages * page_size, kv_heads, head_dim]: one row per token slot."""
        layers, planes, _, heads, dim, _ = self.geometry
        return self.kv.view(layers, planes, -1, heads, dim)

    def check(self) -> None:
        """Every page owned by exactly one host copy of the caches that use the pool, or free."""
        shared = {p for pages, _ in self.prefixes.values() for p in pages}
        owned = [p for cache in self.users for p in cache.owned_host_pages() if p not in shared] + list(shared)
        holders: dict[int, int] = {}
        for cache in self.users:
            for s in cache._seqs.values():
                if s.host_group >= 0:
                    holders[s.host_group] = holders.get(s.host_group, 0) + 1
        if holders != {g: n for g, (_, n) in self.prefixes.items()}:
            raise InvariantError("a host prefix's holder count drifted from the host copies that hold it")
        every = owned + self.free
        total = self.capacity_pages()
        if len(every) != total or set(every) != set(range(total)):
            raise InvariantError(f"host pages: {len(owned)} owned + {len(self.free)} free != {total}, or a page is "
                                 "owned twice or lost")


def tokens_within(pages: int, page_size: int, min_tokens: int, max_copies: int) -> int:
    """Host KV tokens that `pages` host pages surely hold, however they are split into copies: each copy takes
    ceil(tokens / page_size) pages, at most one of them part-empty, and a copy holds at least `min_tokens` tokens
    (a prompt), so n copies of T tokens in all take at most T / page_size + n pages, with n <= T / min_tokens and
    n <= max_copies (the job's sequences). The scheduler's host accounting counts tokens; this is the number it
    may be given for the pool."""
    by_count = (pages - max_copies) * page_size
    by_size = pages * page_size * min_tokens // (min_tokens + page_size)
    return max(0, by_count, by_size)
