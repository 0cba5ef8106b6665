"""Host-resident decode: each layer's KV of an attention micro-batch restored from the host copies into a
device staging buffer, attention there, and the new tokens' KV sent back to host.

A host-resident sequence holds no device pages; its KV lives in its cache's host pool (the source of truth).
For every layer, each micro-batch (B_attn sequences) of such sequences has that layer's pages restored into
one of two staging buffers laid out as pages, so the attention code and its metadata are the ones device-
resident sequences use (the block table just points into the staging pages). Restores are double-buffered:
micro-batch j + 1 is restored into the other buffer while j attends, and the first micro-batch of layer
l + 1 while layer l's experts run. On CUDA the host pages are gathered on the CPU into a pinned bounce buffer
(one gather per micro-batch and layer) and copied on a side stream; events order the copy before the attention
that reads it and after the attention that last used the buffer. On CPU the gather writes the staging buffer
directly (a plain copy). The new tokens' KV, collected per layer from the staging buffer into one tensor per
micro-batch, goes back to the host pool in one index_copy after the forward (it is not read again before).

Sizing (decided here; the paper leaves it open): two buffers per rank, each of the cache's `staging_pages`
pages of one layer (the executor carves them out of the KV budget: by default B_attn x ceil(longest context /
page)), allocated once by the first staged step of the job; host micro-batches are cut to fit them. A step
that needs more (no size was given, or one sequence longer than a buffer) grows them, counted in
`allocations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.core.sequences import InvariantError
from batchgen.exec.metadata import AttentionMetadata

if TYPE_CHECKING:
    from batchgen.exec.kv_cache import PagedKVCache

BUFFERS = 2


def staging_pages(b_attn: int, max_context: int, page_size: int) -> int:
    """Pages of one staging buffer: B_attn sequences of the longest context."""
    return int(b_attn) * -(-int(max_context) // int(page_size))


@dataclass
class StagedBatch:
    """A micro-batch of host-resident sequences as staging sees it."""

    seq_ids: list[int]
    host_pages: torch.Tensor   # [P] int64 on CPU: host pages to restore per layer, sequence after sequence
    host_slots: torch.Tensor   # [T] int64 on CPU: host slots of the new tokens (where their KV goes back)
    meta: AttentionMetadata    # on the device; staging page j holds host page host_pages[j]
    appended: torch.Tensor     # [num_layers, planes, T, kv_heads, head_dim] on the device: the new tokens' KV

    @property
    def num_pages(self) -> int:
        return self.host_pages.numel()


def stage(seq_ids: list[int], host_meta: AttentionMetadata, cache: "PagedKVCache",
          prefix_tokens: int = 0) -> StagedBatch:
    """Renumber a `prepare_host` step's pages into staging pages 0..P-1 (vectorised, no loop). `prefix_tokens`: a
    cascaded call (batchgen.core.cascade) whose members' host copies all begin with that shared prefix, whole
    pages: its pages are restored once, from the first member's copy, and read by the call once (staging pages
    0..n-1, the metadata's prefix); each member's own pages follow."""
    table = host_meta.block_table
    valid = table >= 0
    ps = host_meta.page_size
    n = prefix_tokens // ps
    if n and (prefix_tokens % ps or not bool(valid[:, :n].all())):
        raise InvariantError(f"a staged cascade over a prefix of {prefix_tokens} tokens: it must be whole pages of "
                             f"{ps}, and every member's host copy must hold it")
    own = valid
    if n:
        own = valid.clone()
        own[:, :n] = False
    host_pages = torch.cat([table[0, :n], table[own]])  # row-major: each sequence's pages in order
    staged = torch.full_like(table, -1)
    staged[:, :n] = torch.arange(n)
    staged[own] = n + torch.arange(host_pages.numel() - n)
    seq = torch.repeat_interleave(torch.arange(table.shape[0]), host_meta.query_lens())
    pos = host_meta.positions
    slots = staged[seq, pos // ps] * ps + pos % ps
    meta = AttentionMetadata(pos, host_meta.query_starts, host_meta.context_lens, staged, slots, ps)
    if n:
        meta.prefix_pages, meta.prefix_tokens = torch.arange(n), n * ps
    appended = torch.empty(cache.num_layers, cache.planes, pos.numel(), cache.num_kv_heads, cache.head_dim,
                           dtype=cache.dtype, device=cache.device)
    return StagedBatch(list(seq_ids), host_pages, host_meta.slot_mapping, meta.to(cache.device), appended)


class StagingArea:
    """One rank's two staging buffers (and on CUDA its pinned bounce buffers, side stream and events)."""

    def __init__(self, cache: "PagedKVCache", pages: int):
        self.cache = cache
        self.device = cache.device
        self.cuda = self.device.type == "cuda"
        self.allocations = 0
        self.restored_bytes = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
        self._allocate(pages)

    @torch.inference_mode(False)  # persistent buffers, built by the first forward that stages
    def _allocate(self, pages: int) -> None:
        c = self.cache
        self.pages = int(pages)
        numel = c.planes * self.pages * c.page_size * c.num_kv_heads * c.head_dim
        # zeros: slots past a context are masked, and attention zeroes what it gathers there anyway
        self._buffers = [torch.zeros(numel, dtype=c.dtype, device=self.device) for _ in range(BUFFERS)]
        if self.cuda:
            self._bounce = [torch.empty(numel, dtype=c.dtype, pin_memory=True) for _ in range(BUFFERS)]
            self._ready = [torch.cuda.Event() for _ in range(BUFFERS)]    # restore into buffer i done
            self._free = [None] * BUFFERS                                 # attention on buffer i done
            self._copied = [None] * BUFFERS                               # bounce buffer i read by its DMA
        self.allocations += 1

    def ensure(self, pages: int, hint: int = 0) -> None:
        """Room for a micro-batch of `pages` pages; a first or larger need allocates max(pages, hint)."""
        if pages > self.pages:
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._allocate(max(pages, hint))

    @property
    def nbytes(self) -> int:
        return BUFFERS * self._buffers[0].numel() * self._buffers[0].element_size()

    def _view(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        c = self.cache
        return flat[:c.planes * n * c.page_size * c.num_kv_heads * c.head_dim].view(
            c.planes, n, c.page_size, c.num_kv_heads, c.head_dim)

    def restore(self, i: int, layer: int, batch: StagedBatch) -> None:
        """Buffer i <- layer `layer` of the batch's host pages (asynchronous on CUDA)."""
        n = batch.num_pages
        self.restored_bytes += n * self.cache.layer_page_bytes
        if not self.cuda:
            self.cache.gather_host_pages(layer, batch.host_pages, self._view(self._buffers[i], n))
            return
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # the bounce buffer's previous DMA has read it
        self.cache.gather_host_pages(layer, batch.host_pages, self._view(self._bounce[i], n))
        with torch.cuda.stream(self.stream):
            if self._free[i] is not None:
                self.stream.wait_event(self._free[i])
            self._view(self._buffers[i], n).copy_(self._view(self._bounce[i], n), non_blocking=True)
            self._ready[i].record(self.stream)
            self._copied[i] = self._ready[i]

    def acquire(self, i: int, batch: StagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer i as a layer's (K, V) pools of the batch's pages, once its restore is done."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[i])
        view = self._view(self._buffers[i], batch.num_pages)
        return view[0], (view[1] if self.cache.planes == 2 else view[0].new_zeros(*view.shape[1:4], 0))

    def release(self, i: int, layer: int, batch: StagedBatch) -> None:
        """Attention on buffer i is launched: keep the new tokens' KV, and let the buffer be reused after it."""
        flat = self._view(self._buffers[i], batch.num_pages).flatten(1, 2)  # [planes, pages * page, H, D]
        torch.index_select(flat, 1, batch.meta.slot_mapping, out=batch.appended[layer])
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._free[i] = event


class RestorePipeline:
    """One forward's staged jobs on one rank, in order: every micro-batch of layer 0, then of layer 1, ...
    Job j uses buffer j % 2; restoring job j + 1 is issued as soon as job j's attention is launched."""

    def __init__(self, area: StagingArea, batches: list[StagedBatch], num_layers: int):
        self.area, self.batches = area, batches
        self.jobs = [(layer, k) for layer in range(num_layers) for k in range(len(batches))]
        self.index = {job: j for j, job in enumerate(self.jobs)}
        if self.jobs:
            self._issue(0)

    def _issue(self, j: int) -> None:
        layer, k = self.jobs[j]
        self.area.restore(j % BUFFERS, layer, self.batches[k])

    def acquire(self, layer: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.index[(layer, k)]
        return self.area.acquire(j % BUFFERS, self.batches[k])

    def release(self, layer: int, k: int) -> None:
        j = self.index[(layer, k)]
        self.area.release(j % BUFFERS, layer, self.batches[k])
        if j + 1 < len(self.jobs):
            self._issue(j + 1)
