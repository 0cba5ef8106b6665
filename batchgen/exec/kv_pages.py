"""The pieces of a paged KV cache that every part of it shares: a sequence's pages and host copy, and the
arithmetic of pages and slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch


class CacheFullError(RuntimeError):
    """Not enough free pages: the scheduler must yield or evict before asking again. State is unchanged."""

    def __init__(self, what: str, needed: int, free: int, num_pages: int, page_size: int):
        self.needed, self.free = needed, free
        super().__init__(f"KV cache full: {what} needs {needed} more pages of {page_size} tokens but only {free} "
                         f"of {num_pages} are free; yield or evict sequences first")


@dataclass(eq=False)  # hashed by identity: host allocation maps sequences to page counts
class _Seq:
    pages: list[int] = field(default_factory=list)       # device pages
    device_len: int = 0           # tokens whose KV is (or, after prepare, is being) written on device
    host_pages: list[int] = field(default_factory=list)  # host pages: exactly those covering synced + pending
    synced: int = 0               # tokens of the host copy; a prefix of the sequence
    pending: int = 0              # tokens a host-resident step is writing (prepare_host .. host_advance)
    host_group: int = -1          # the group whose host prefix its host copy's first pages are (-1: none)

    @property
    def on_device(self) -> bool:
        return bool(self.pages)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _v_width(head_dim: int, v_head_dim: int | None) -> int:
    """The V pool's width: head_dim (None: the default) or 0 (no V pool)."""
    if v_head_dim is None or v_head_dim == head_dim:
        return head_dim
    if v_head_dim == 0:
        return 0
    raise ValueError(f"v_head_dim must be head_dim ({head_dim}) or 0 (no V pool, e.g. MLA's latent cache), "
                     f"got {v_head_dim}")


def _index(ids: list[int], device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _block_table(page_lists: list[list[int]]) -> torch.Tensor:
    """Rows of page ids padded with -1, built from one flat list (no tensor per row)."""
    lens = torch.tensor([len(p) for p in page_lists], dtype=torch.int64)
    width = int(lens.max()) if len(page_lists) else 0
    table = torch.full((len(page_lists), width), -1, dtype=torch.int64)
    if width:
        rows = torch.repeat_interleave(torch.arange(len(page_lists)), lens)
        cols = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[rows]
        table[rows, cols] = torch.tensor(list(chain.from_iterable(page_lists)), dtype=torch.int64)
    return table
