"""One device's paged KV cache, with the host copy that is each sequence's source of truth.

The tensor-side counterpart of `batchgen.core.state.ClusterState`: the scheduler decides who runs, yields,
migrates or is evicted; this object moves the tensors and refuses anything that would break the device-memory
budget, so an over-eager policy fails at the step that caused it instead of running out of memory later.

Layout decisions (the paper is silent on them):

- All layers' K and V live in one device tensor [num_layers, planes, num_pages, page_size, kv_heads, head_dim],
  planes = 2 (K, V) or 1 (K only, see MLA below). `layer(l)` hands attention contiguous per-layer views, while
  sync/restore move every layer of every sequence in a call with one gather / one index_copy over the pool.
- MLA (DeepSeek-V3) caches the compressed latent, not per-head K/V: per token and layer one "head" of width
  kv_lora_rank + qk_rope_head_dim holding [c_kv (after kv_a_layernorm) | k_pe (after RoPE)], in the K pool,
  and no V pool at all (`v_head_dim=0`; `layer(l)` then returns a zero-width V tensor), so every byte of the
  budget holds latent and `bytes_per_token` is layers x (kv_lora_rank + qk_rope_head_dim) x dtype size.
  Attention re-derives per-head k_nope and v from c_kv with kv_b_proj. Build any model's cache from its
  geometry: `PagedKVCache.from_budget(**model.kv_cache_geometry()._asdict(), page_size=..., budget_bytes=...)`.
  A V pool must be as wide as K (v_head_dim == head_dim) or absent: no architecture here needs another width.
- A sequence holds exactly the pages its context needs, extended lazily by `prepare` (or ahead of time by
  `reserve`, which lets a scheduler claim memory at a boundary and never fail mid-step).
- Host copies live in a host page pool laid out like the device pool, [num_layers, planes, host_pages,
  page_size, kv_heads, head_dim] (pinned when the device is CUDA, unless host_pinned=False, so that copies
  are asynchronous DMA). A sequence's host copy is a list of host pages, token t at host page t // page_size,
  slot t % page_size, exactly as on device: moving KV either way is one gather and one index_copy of whole
  pages for any number of sequences, and one layer of a batch of sequences (what host-resident decode
  restores) is one gather too. The pool has no budget of its own (the scheduler's host accounting is the
  limit): it doubles when full, which costs amortised O(1) copies per page.
- A sequence is in one of two places: on device (pages held; its first `synced` tokens also on host) or on
  host only (no pages; the host copy holds all of it). Evicted and released sequences are forgotten: a
  recomputed sequence comes back through `prepare` with start position 0, like a new one.
- Host-resident decode runs a host-only sequence without giving it device pages: `prepare_host` reserves host
  room for the new tokens and describes the step in host-pool coordinates (block tables of host pages); per
  layer, a runner either restores the pages into a device staging buffer (`batchgen.exec.staging`), attends
  there and appends the new tokens' KV back (`write_host_tokens`), or attends on the host pool itself on the
  CPU (`host_layer`); `host_advance` then counts the new tokens. In between, the sequence cannot be moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from batchgen.core.sequences import InvariantError
from batchgen.exec.metadata import AttentionMetadata


class CacheFullError(RuntimeError):
    """Not enough free pages: the scheduler must yield or evict before asking again. State is unchanged."""

    def __init__(self, what: str, needed: int, free: int, num_pages: int, page_size: int):
        self.needed, self.free = needed, free
        super().__init__(f"KV cache full: {what} needs {needed} more pages of {page_size} tokens but only {free} "
                         f"of {num_pages} are free; yield or evict sequences first")


@dataclass
class HostKV:
    """A sequence's KV in host memory as token-major rows: what MIGRATE carries between caches."""

    kv: torch.Tensor  # [capacity, num_layers, planes, kv_heads, head_dim] on CPU; rows [:length] are valid
    length: int

    @property
    def capacity(self) -> int:
        return self.kv.shape[0]

    def tokens(self) -> torch.Tensor:
        return self.kv[:self.length]


@dataclass(eq=False)  # hashed by identity: host allocation maps sequences to page counts
class _Seq:
    pages: list[int] = field(default_factory=list)       # device pages
    device_len: int = 0           # tokens whose KV is (or, after prepare, is being) written on device
    host_pages: list[int] = field(default_factory=list)  # host pages: exactly those covering synced + pending
    synced: int = 0               # tokens of the host copy; a prefix of the sequence
    pending: int = 0              # tokens a host-resident step is writing (prepare_host .. host_advance)

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


class PagedKVCache:
    """One device's paged KV pool for all layers, plus the host copy that is each sequence's source of truth."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int, num_pages: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 host_pinned: bool | None = None, v_head_dim: int | None = None, host_pages: int | None = None,
                 max_context: int | None = None, staging_pages: int | None = None, host_alloc=None):
        """v_head_dim: None or head_dim for a V pool like the K pool; 0 for no V pool (MLA's latent cache).
        host_alloc: where the host pool's storage comes from, `host_alloc(shape, dtype) -> zero-filled CPU
        tensor` (default: torch.zeros, pinned per host_pinned); backend=dist passes a shared-memory file per
        pool (`batchgen.dist.shared_host`) so that host copies outlive the process.
        host_pages: the host pool's initial size (default num_pages; it doubles when full). Host-resident
        decode's staging buffers (`batchgen.exec.staging`) hold `staging_pages` pages of one layer each (host
        micro-batches are cut to fit), or, without it, B_attn sequences of `max_context` tokens (the job's
        longest sequence)."""
        if min(num_layers, num_kv_heads, head_dim, page_size, num_pages) < 1:
            raise ValueError(f"KV cache dimensions must be positive: num_layers={num_layers} "
                             f"num_kv_heads={num_kv_heads} head_dim={head_dim} page_size={page_size} "
                             f"num_pages={num_pages}")
        self.v_head_dim = _v_width(head_dim, v_head_dim)
        self.planes = 2 if self.v_head_dim else 1  # K and V, or K only
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.dtype, self.device = dtype, torch.device(device)
        self.max_context = max_context
        self.staging_pages = staging_pages
        self.host_alloc = host_alloc
        self.host_pinned = self.device.type == "cuda" if host_pinned is None else bool(host_pinned)
        if self.host_pinned and not torch.cuda.is_available():
            raise ValueError("host_pinned=True needs CUDA (pinned memory is allocated through the CUDA driver)")
        # zeros, not empty: attention may read padding slots with zero weight, and 0 * NaN garbage is NaN
        self._kv = torch.zeros(num_layers, self.planes, num_pages, page_size, num_kv_heads, head_dim,
                               dtype=dtype, device=self.device)
        self._no_v = None if self.v_head_dim else torch.zeros(num_pages, page_size, num_kv_heads, 0, dtype=dtype,
                                                             device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack; page 0 is handed out first
        self._host = self._new_host(max(1, num_pages if host_pages is None else int(host_pages)))
        self._host_free = list(range(self._host.shape[2] - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        self.staging = None  # host-resident decode's staging buffers, built by the first staged step
        self.shards = None   # PARTITIONed sequences' head shards in this pool (batchgen.exec.shards)

    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                   v_head_dim: int | None = None) -> int:
        width = head_dim + _v_width(head_dim, v_head_dim)
        return num_layers * page_size * num_kv_heads * width * torch.empty(0, dtype=dtype).element_size()

    @classmethod
    def from_budget(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int,
                    budget_bytes: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    host_pinned: bool | None = None, v_head_dim: int | None = None,
                    max_context: int | None = None, staging_pages: int | None = None,
                    host_alloc=None) -> "PagedKVCache":
        """As many pages as fit in the device-memory budget given to the KV cache (the budget is a hard cap)."""
        per_page = cls.page_bytes(num_layers, num_kv_heads, head_dim, page_size, dtype, v_head_dim)
        num_pages = int(budget_bytes) // per_page
        if num_pages < 1:
            pools = "K only" if v_head_dim == 0 else "K,V"
            raise ValueError(f"KV budget of {int(budget_bytes)} bytes holds no page: one page of {page_size} "
                             f"tokens x {num_layers} layers x {pools} x {num_kv_heads} heads x {head_dim} dims "
                             f"in {dtype} takes {per_page} bytes")
        return cls(num_layers, num_kv_heads, head_dim, page_size=page_size, num_pages=num_pages, dtype=dtype,
                   device=device, host_pinned=host_pinned, v_head_dim=v_head_dim, max_context=max_context,
                   staging_pages=staging_pages, host_alloc=host_alloc)

    # ---- views and queries --------------------------------------------------------------------------
    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's K and V pools, [num_pages, page_size, kv_heads, head_dim], contiguous (attention writes).
        Without a V pool (v_head_dim=0) the V tensor is [num_pages, page_size, kv_heads, 0]: it holds nothing."""
        return self._kv[l, 0], (self._kv[l, 1] if self._no_v is None else self._no_v)

    def host_layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's host K and V pools, [host_pages, page_size, kv_heads, head_dim] on CPU, contiguous: what
        attention on the host CPU reads and writes, with metadata from `prepare_host`. Stale once the host pool
        grows (any call that adds host pages): fetch them after the step's `prepare_host` calls."""
        k = self._host[l, 0]
        return k, (self._host[l, 1] if self.v_head_dim else k.new_zeros(*k.shape[:3], 0))

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, 1, self.dtype, self.v_head_dim)

    @property
    def layer_page_bytes(self) -> int:
        """One page of one layer, K and V: the unit a host-resident restore moves."""
        return self.bytes_per_token * self.page_size // self.num_layers

    def free_pages(self) -> int:
        return len(self._free)

    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def host_capacity_pages(self) -> int:
        return self._host.shape[2]

    def host_used_pages(self) -> int:
        return self._host.shape[2] - len(self._host_free)

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def host_copies(self) -> dict[int, tuple[object, int, int]]:
        """{id: (its record, tokens synced to host, host pages held)} of every sequence with a host copy. The
        record tells a sequence released and taken again (another record) from one that stayed (compare it by
        identity)."""
        return {sid: (s, s.synced, len(s.host_pages)) for sid, s in self._seqs.items() if s.synced}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def on_device(self, seq_id: int) -> bool:
        return self._get(seq_id).on_device

    def pages(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).pages)

    def host_pages(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).host_pages)

    def device_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).device_len

    def synced_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).synced

    def pending_tokens(self, seq_id: int) -> int:
        """Tokens a host-resident step is writing (between `prepare_host` and `host_advance`)."""
        return self._get(seq_id).pending

    def truncate(self, seq_id: int, tokens: int) -> None:
        """Forget a step that was interrupted before its token was recorded (a lost worker's recovery): a
        device-resident sequence keeps its first `tokens` tokens (its pages stay held: the next forward writes
        the same slots again), a host-resident one drops its pending tokens. Never grows a sequence."""
        seq = self._get(seq_id)
        if seq.on_device:
            if not 0 <= tokens <= seq.device_len:
                raise ValueError(f"sequence {seq_id} holds {seq.device_len} device tokens: cannot keep {tokens}")
            seq.device_len = tokens
        else:
            seq.pending = 0

    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no KV in this cache") from None

    def _resident_tokens(self, seq_id: int) -> int:
        """Tokens the sequence must hold on device before taking new ones (a host-only one restores first)."""
        s = self._seqs.get(seq_id)
        if s is None:
            return 0
        return s.device_len if s.on_device else s.synced

    # ---- capacity ----------------------------------------------------------------------------------
    def pages_needed(self, extra_tokens_by_seq: dict[int, int]) -> int:
        """Pages to allocate so each sequence holds its resident tokens plus the extra ones."""
        return sum(max(0, _cdiv(self._resident_tokens(sid) + int(extra), self.page_size) - self._held(sid))
                   for sid, extra in extra_tokens_by_seq.items())

    def can_fit(self, extra_tokens_by_seq: dict[int, int]) -> bool:
        """Whether these sequences (new, host-only counted as restored, or on device) can take the extra tokens."""
        return self.pages_needed(extra_tokens_by_seq) <= len(self._free)

    def _allocate(self, counts: dict[int, int], what: str) -> None:
        """All or nothing, so a refused step leaves the cache as it was."""
        total = sum(counts.values())
        if total > len(self._free):
            raise CacheFullError(what, total, len(self._free), self.num_pages, self.page_size)
        for sid, n in counts.items():
            s = self._seqs.setdefault(sid, _Seq())
            s.pages.extend(self._free.pop() for _ in range(n))

    def _grow_to(self, tokens_by_seq: dict[int, int], what: str) -> None:
        counts = {sid: _cdiv(n, self.page_size) - self._held(sid) for sid, n in tokens_by_seq.items()}
        self._allocate({sid: n for sid, n in counts.items() if n > 0}, what)

    def _held(self, seq_id: int) -> int:
        s = self._seqs.get(seq_id)
        return 0 if s is None else len(s.pages)

    def reserve(self, extra_tokens_by_seq: dict[int, int]) -> None:
        """Claim pages ahead for running sequences (the per-sequence reservation, extended lazily)."""
        for sid in extra_tokens_by_seq:
            if not self.on_device(sid):
                raise ValueError(f"sequence {sid} is not on device: restore it before reserving for it")
        self._grow_to({sid: self._seqs[sid].device_len + int(n) for sid, n in extra_tokens_by_seq.items()},
                      f"reserving for {len(extra_tokens_by_seq)} sequences")

    # ---- the host pool -------------------------------------------------------------------------------
    @torch.inference_mode(False)  # grown inside a forward too, and updated in place outside one
    def _new_host(self, pages: int) -> torch.Tensor:
        # zeros: restores copy whole pages, and pools must hold only finite values (see AttentionMetadata)
        if self.host_alloc is not None:
            return self.host_alloc((self.num_layers, self.planes, pages, self.page_size, self.num_kv_heads,
                                    self.head_dim), self.dtype)
        return torch.zeros(self.num_layers, self.planes, pages, self.page_size, self.num_kv_heads, self.head_dim,
                           dtype=self.dtype, pin_memory=self.host_pinned)

    def _host_cover(self, tokens_by_seq: dict[_Seq, int]) -> None:
        """Give each sequence the host pages that cover its first `tokens` tokens (it never shrinks here)."""
        need = {s: _cdiv(n, self.page_size) - len(s.host_pages) for s, n in tokens_by_seq.items()}
        total = sum(n for n in need.values() if n > 0)
        if total > len(self._host_free):
            old = self._host.shape[2]
            grown = self._new_host(max(2 * old, old + total - len(self._host_free)))
            grown[:, :, :old].copy_(self._host)
            self._host = grown
            self._host_free = list(range(grown.shape[2] - 1, old - 1, -1)) + self._host_free
        for s, n in need.items():
            if n > 0:
                s.host_pages.extend(self._host_free.pop() for _ in range(n))

    def _host_flat(self) -> torch.Tensor:
        return self._host.view(self.num_layers, self.planes, -1, self.num_kv_heads, self.head_dim)

    def _pages_of(self, seqs: list[_Seq], which: str, first: list[int], last: list[int]) -> list[int]:
        return list(chain.from_iterable(getattr(s, which)[a:b] for s, a, b in zip(seqs, first, last)))

    # ---- the forward pass --------------------------------------------------------------------------
    def prepare(self, seq_ids: list[int], new_tokens: list[int], start_positions: list[int]) -> AttentionMetadata:
        """Give each sequence room for its new tokens and describe where they go.

        The new tokens of a sequence follow its existing KV, so start_positions must equal its device tokens
        (0 for a new or evicted sequence); a sequence whose KV is on host only must be restored first (or run
        host-resident with `prepare_host`), since running it from scratch would silently drop its checkpoint.
        The returned tensors are on the device. The new tokens count as on device from here: sync only after
        the forward pass has written them.
        """
        self._check_prepare_args(seq_ids, new_tokens, start_positions)
        self._grow_to({sid: int(p) + int(n) for sid, n, p in zip(seq_ids, new_tokens, start_positions)},
                      f"a step of {sum(new_tokens)} new tokens over {len(seq_ids)} sequences")
        for sid, n in zip(seq_ids, new_tokens):
            self._seqs[sid].device_len += int(n)
        return self._metadata([self._seqs[sid].pages for sid in seq_ids], new_tokens,
                              start_positions).to(self.device)

    def _metadata(self, page_lists: list[list[int]], new_tokens, start_positions) -> AttentionMetadata:
        starts = torch.tensor(start_positions, dtype=torch.int64).reshape(-1)
        lens = torch.tensor(new_tokens, dtype=torch.int64).reshape(-1)
        table = _block_table(page_lists)
        positions, slots = self._slots(table, starts, starts + lens)
        query_starts = torch.zeros(len(page_lists) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=query_starts[1:])
        return AttentionMetadata(positions, query_starts, starts + lens, table, slots, self.page_size)

    def _check_prepare_args(self, seq_ids, new_tokens, start_positions) -> None:
        if not len(seq_ids) == len(new_tokens) == len(start_positions):
            raise ValueError(f"prepare got {len(seq_ids)} sequence ids, {len(new_tokens)} token counts and "
                             f"{len(start_positions)} start positions")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"prepare got a sequence twice: {seq_ids}")
        for sid, n, p in zip(seq_ids, new_tokens, start_positions):
            s = self._seqs.get(sid)
            if n < 1:
                raise ValueError(f"sequence {sid}: a step must add at least one token, got {n}")
            if s is not None and not s.on_device:
                raise ValueError(f"sequence {sid} has its KV on host only: restore it before running it")
            have = s.device_len if s is not None else 0
            if p != have:
                raise ValueError(f"sequence {sid}: new tokens start at position {p} but its KV holds {have} "
                                 "tokens (new tokens must follow the existing KV)")

    def _slots(self, table: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
        """Positions [starts[b], ends[b]) of each row, and their flat slots in the pool, vectorised."""
        lens = ends - starts
        row = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        offsets = torch.cumsum(lens, 0) - lens
        positions = torch.arange(int(lens.sum())) - offsets[row] + starts[row]
        slots = table[row, positions // self.page_size] * self.page_size + positions % self.page_size
        return positions, slots

    # ---- host-resident steps -------------------------------------------------------------------------
    def prepare_host(self, seq_ids: list[int], new_tokens: list[int],
                     start_positions: list[int]) -> AttentionMetadata:
        """A step of host-resident sequences (held here on host only), in host-pool coordinates, on CPU.

        Host pages for the new tokens are reserved now (the pool may grow: fetch `host_layer` views after
        this); block_table names host pages and slot_mapping host slots. The sequences hold no device pages.
        The new tokens count once `host_advance` is called, after every layer has written its KV back."""
        if not len(seq_ids) == len(new_tokens) == len(start_positions):
            raise ValueError(f"prepare_host got {len(seq_ids)} sequence ids, {len(new_tokens)} token counts and "
                             f"{len(start_positions)} start positions")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"prepare_host got a sequence twice: {seq_ids}")
        seqs = [self._get(sid) for sid in seq_ids]
        for sid, s, n, p in zip(seq_ids, seqs, new_tokens, start_positions):
            if s.on_device:
                raise ValueError(f"sequence {sid} holds device pages: yield it to host before running it "
                                 "host-resident")
            if s.pending:
                raise ValueError(f"sequence {sid} is already in a host-resident step")
            if n < 1:
                raise ValueError(f"sequence {sid}: a step must add at least one token, got {n}")
            if p != s.synced:
                raise ValueError(f"sequence {sid}: new tokens start at position {p} but its host KV holds "
                                 f"{s.synced} tokens (new tokens must follow the existing KV)")
        self._host_cover({s: s.synced + int(n) for s, n in zip(seqs, new_tokens)})
        for s, n in zip(seqs, new_tokens):
            s.pending = int(n)
        return self._metadata([s.host_pages for s in seqs], new_tokens, start_positions)

    def host_advance(self, seq_ids) -> None:
        """The host-resident step is done: its new tokens' KV is in the host copy."""
        for sid in seq_ids:
            s = self._get(sid)
            if not s.pending:
                raise ValueError(f"sequence {sid} is not in a host-resident step")
            s.synced += s.pending
            s.pending = 0

    def gather_host_pages(self, layer: int, pages: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One layer's host pages into `out` [planes, len(pages), page_size, kv_heads, head_dim]: one gather."""
        return torch.index_select(self._host[layer], 1, pages, out=out)

    def write_host_tokens(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [num_layers, planes, T, kv_heads, head_dim] into host slots [T]: one index_copy (the
        append of host-resident steps' new tokens)."""
        self._host_flat().index_copy_(2, slots, values)

    # ---- moving KV between device and host --------------------------------------------------------
    def _host_to_device(self, host_pages: list[int], device_pages: list[int]) -> None:
        src = torch.empty(self.num_layers, self.planes, len(host_pages), self.page_size, self.num_kv_heads,
                          self.head_dim, dtype=self.dtype, pin_memory=self.host_pinned)
        torch.index_select(self._host, 2, _index(host_pages), out=src)
        self._kv.index_copy_(2, _index(device_pages, self.device), src.to(self.device, non_blocking=self.host_pinned))

    def _device_to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        picked = self._kv.index_select(2, _index(device_pages, self.device)).cpu()
        self._host.index_copy_(2, _index(host_pages), picked)

    def sync_to_host(self, seq_ids) -> int:
        """Checkpoint the tokens written since the last sync (called at page boundaries): the pages they are
        on go down in one gather and one index_copy. Returns tokens copied."""
        todo = [self._get(sid) for sid in seq_ids]
        todo = [s for s in todo if s.device_len > s.synced]
        if not todo:
            return 0
        self._host_cover({s: s.device_len for s in todo})
        first = [s.synced // self.page_size for s in todo]
        last = [_cdiv(s.device_len, self.page_size) for s in todo]
        self._device_to_host(self._pages_of(todo, "pages", first, last), self._pages_of(todo, "host_pages", first,
                                                                                       last))
        copied = 0
        for s in todo:
            copied += s.device_len - s.synced
            s.synced = s.device_len
        return copied

    def _free_device(self, s: _Seq) -> None:
        self._free.extend(reversed(s.pages))
        s.pages, s.device_len = [], 0

    def yield_to_host(self, seq_ids) -> int:
        """YIELD: checkpoint, then give the pages back; the host copy carries the sequence. Returns tokens copied."""
        self._require_on_device(seq_ids, "yield")
        copied = self.sync_to_host(seq_ids)
        for sid in seq_ids:
            self._free_device(self._seqs[sid])
        return copied

    def restore(self, seq_ids) -> int:
        """COMBINE/resume: pages for the whole host copy, then one gather, one H2D and one index_copy for all."""
        for sid in seq_ids:
            if self._get(sid).on_device:
                raise ValueError(f"sequence {sid} is already on device: only yielded sequences can be restored")
            if self._seqs[sid].pending:
                raise ValueError(f"sequence {sid} is in a host-resident step: finish it before restoring")
        if not seq_ids:
            return 0
        tokens = {sid: self._seqs[sid].synced for sid in seq_ids}
        self._grow_to(tokens, f"restoring {len(seq_ids)} sequences ({sum(tokens.values())} tokens)")
        seqs = [self._seqs[sid] for sid in seq_ids]
        first = [0] * len(seqs)
        last = [_cdiv(s.synced, self.page_size) for s in seqs]
        self._host_to_device(self._pages_of(seqs, "host_pages", first, last),
                             self._pages_of(seqs, "pages", first, last))
        for s in seqs:
            s.device_len = s.synced
        return sum(tokens.values())

    def _require_on_device(self, seq_ids, action: str) -> None:
        for sid in seq_ids:
            if not self._get(sid).on_device:
                raise ValueError(f"cannot {action} sequence {sid}: its KV is not on device")

    # ---- MIGRATE --------------------------------------------------------------------------------------
    def export(self, seq_id: int) -> HostKV:
        """The whole KV as token-major host rows, for another cache to import; syncs first so nothing is left
        behind. A copy: the caller releases the sequence here once the target has imported it."""
        s = self._get(seq_id)
        if s.pending:
            raise ValueError(f"sequence {seq_id} is in a host-resident step: finish it before exporting")
        self.sync_to_host([seq_id])
        n = _cdiv(s.synced, self.page_size)
        pages = self._host.index_select(2, _index(s.host_pages[:n]))   # [L, planes, n, page, H, D]
        rows = pages.permute(2, 3, 0, 1, 4, 5).reshape(n * self.page_size, *pages.shape[:2], *pages.shape[4:])
        return HostKV(rows[:s.synced], s.synced)

    def import_(self, seq_id: int, host_kv: HostKV, to_device: bool = False) -> int:
        """MIGRATE in: adopt a host copy (and optionally load it). All or nothing; returns tokens loaded."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has KV in this cache: release it before importing")
        self._check_host_kv(seq_id, host_kv)
        if to_device and not self.can_fit({seq_id: host_kv.length}):
            raise CacheFullError(f"importing sequence {seq_id} ({host_kv.length} tokens)",
                                 _cdiv(host_kv.length, self.page_size), len(self._free), self.num_pages,
                                 self.page_size)
        s = _Seq()
        self._host_cover({s: host_kv.length})
        n = len(s.host_pages)
        rows = host_kv.kv.new_zeros(n * self.page_size, *host_kv.kv.shape[1:])
        rows[:host_kv.length] = host_kv.tokens()
        pages = rows.view(n, self.page_size, *rows.shape[1:]).permute(2, 3, 0, 1, 4, 5)
        self._host.index_copy_(2, _index(s.host_pages), pages)
        s.synced = host_kv.length
        self._seqs[seq_id] = s
        return self.restore([seq_id]) if to_device else 0

    def _check_host_kv(self, seq_id: int, host_kv: HostKV) -> None:
        want = (self.num_layers, self.planes, self.num_kv_heads, self.head_dim)
        if tuple(host_kv.kv.shape[1:]) != want:
            raise ValueError(f"sequence {seq_id}: host KV rows are {tuple(host_kv.kv.shape[1:])}, this cache "
                             f"stores (layers, K/V, kv_heads, head_dim) = {want}")
        if host_kv.kv.dtype != self.dtype:
            raise ValueError(f"sequence {seq_id}: host KV is {host_kv.kv.dtype}, this cache is {self.dtype}; "
                             "converting would change the sequence's result")
        if host_kv.kv.device.type != "cpu":
            raise ValueError(f"sequence {seq_id}: host KV must be on CPU, got {host_kv.kv.device}")
        if not 1 <= host_kv.length <= host_kv.capacity:
            raise ValueError(f"sequence {seq_id}: host KV length {host_kv.length} outside 1..{host_kv.capacity}")

    # ---- dropping sequences -----------------------------------------------------------------------------
    def evict(self, seq_ids) -> None:
        """Forget the KV everywhere: cheaper to recompute than to keep; it comes back through prepare at 0."""
        self.release(seq_ids)

    def release(self, seq_ids) -> None:
        """A finished (or migrated-away) sequence: its pages go back to the pools and its host copy is dropped."""
        for sid in seq_ids:
            self._get(sid)
        for sid in seq_ids:
            s = self._seqs.pop(sid)
            self._free_device(s)
            self._host_free.extend(reversed(s.host_pages))
            s.host_pages = []

    # ---- invariants ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Recount pages and lengths; raises InvariantError on the first broken rule."""
        for name, owned, free, total in (
                ("pages", [p for s in self._seqs.values() for p in s.pages]
                 + (self.shards.owned_pages() if self.shards is not None else []), self._free, self.num_pages),
                ("host pages", [p for s in self._seqs.values() for p in s.host_pages], self._host_free,
                 self._host.shape[2])):
            every = owned + free
            if len(every) != total or set(every) != set(range(total)):
                raise InvariantError(f"{name}: {len(owned)} owned + {len(free)} free != {total}, "
                                     "or a page is owned twice or lost")
        for sid, s in self._seqs.items():
            self._check_seq(sid, s)

    def _check_seq(self, sid: int, s: _Seq) -> None:
        if len(s.host_pages) != _cdiv(s.synced + s.pending, self.page_size):
            raise InvariantError(f"sequence {sid}: {len(s.host_pages)} host pages for {s.synced} synced and "
                                 f"{s.pending} pending tokens")
        if s.on_device:
            if s.pending or not s.synced <= s.device_len <= len(s.pages) * self.page_size:
                raise InvariantError(f"sequence {sid}: synced {s.synced}, device {s.device_len}, pending "
                                     f"{s.pending}, {len(s.pages)} pages of {self.page_size}")
        elif s.device_len or s.synced < 1:
            raise InvariantError(f"sequence {sid}: off device with device_len {s.device_len} and "
                                 f"{s.synced} host tokens")


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
