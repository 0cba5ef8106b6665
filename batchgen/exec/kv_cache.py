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
- The host copy of a sequence is one CPU tensor [capacity, num_layers, planes, kv_heads, head_dim], token-major so
  that a sequence's prefix is contiguous (one memcpy per sequence to stage, export or restore it), grown
  geometrically (capacity doubles, in whole pages) so that syncing one page at a time costs amortised O(1)
  copies and few pinned allocations, which are slow. Pinned when the device is CUDA (unless host_pinned=False)
  so that restores are asynchronous DMA.
- A sequence is in one of two places: on device (pages held; its first `synced` tokens also on host) or on
  host only (no pages; the host copy holds all of it). Evicted and released sequences are forgotten: a
  recomputed sequence comes back through `prepare` with start position 0, like a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """A sequence's KV in host memory: what YIELD checkpoints and MIGRATE carries between caches."""

    kv: torch.Tensor  # [capacity, num_layers, planes, kv_heads, head_dim] on CPU; rows [:length] are valid
    length: int

    @property
    def capacity(self) -> int:
        return self.kv.shape[0]

    def tokens(self) -> torch.Tensor:
        return self.kv[:self.length]


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    device_len: int = 0           # tokens whose KV is (or, after prepare, is being) written on device
    host: HostKV | None = None    # None until the first sync
    synced: int = 0               # tokens of the host copy; a prefix of the sequence

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


class PagedKVCache:
    """One device's paged KV pool for all layers, plus the host copy that is each sequence's source of truth."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int, num_pages: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 host_pinned: bool | None = None, v_head_dim: int | None = None):
        """v_head_dim: None or head_dim for a V pool like the K pool; 0 for no V pool (MLA's latent cache)."""
        if min(num_layers, num_kv_heads, head_dim, page_size, num_pages) < 1:
            raise ValueError(f"KV cache dimensions must be positive: num_layers={num_layers} "
                             f"num_kv_heads={num_kv_heads} head_dim={head_dim} page_size={page_size} "
                             f"num_pages={num_pages}")
        self.v_head_dim = _v_width(head_dim, v_head_dim)
        self.planes = 2 if self.v_head_dim else 1  # K and V, or K only
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.dtype, self.device = dtype, torch.device(device)
        self.host_pinned = self.device.type == "cuda" if host_pinned is None else bool(host_pinned)
        if self.host_pinned and not torch.cuda.is_available():
            raise ValueError("host_pinned=True needs CUDA (pinned memory is allocated through the CUDA driver)")
        # zeros, not empty: attention may read padding slots with zero weight, and 0 * NaN garbage is NaN
        self._kv = torch.zeros(num_layers, self.planes, num_pages, page_size, num_kv_heads, head_dim,
                               dtype=dtype, device=self.device)
        self._no_v = None if self.v_head_dim else torch.zeros(num_pages, page_size, num_kv_heads, 0, dtype=dtype,
                                                             device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack; page 0 is handed out first
        self._seqs: dict[int, _Seq] = {}

    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                   v_head_dim: int | None = None) -> int:
        width = head_dim + _v_width(head_dim, v_head_dim)
        return num_layers * page_size * num_kv_heads * width * torch.empty(0, dtype=dtype).element_size()

    @classmethod
    def from_budget(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int,
                    budget_bytes: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    host_pinned: bool | None = None, v_head_dim: int | None = None) -> "PagedKVCache":
        """As many pages as fit in the device-memory budget given to the KV cache (the budget is a hard cap)."""
        per_page = cls.page_bytes(num_layers, num_kv_heads, head_dim, page_size, dtype, v_head_dim)
        num_pages = int(budget_bytes) // per_page
        if num_pages < 1:
            pools = "K only" if v_head_dim == 0 else "K,V"
            raise ValueError(f"KV budget of {int(budget_bytes)} bytes holds no page: one page of {page_size} "
                             f"tokens x {num_layers} layers x {pools} x {num_kv_heads} heads x {head_dim} dims "
                             f"in {dtype} takes {per_page} bytes")
        return cls(num_layers, num_kv_heads, head_dim, page_size=page_size, num_pages=num_pages, dtype=dtype,
                   device=device, host_pinned=host_pinned, v_head_dim=v_head_dim)

    # ---- views and queries --------------------------------------------------------------------------
    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's K and V pools, [num_pages, page_size, kv_heads, head_dim], contiguous (attention writes).
        Without a V pool (v_head_dim=0) the V tensor is [num_pages, page_size, kv_heads, 0]: it holds nothing."""
        return self._kv[l, 0], (self._kv[l, 1] if self._no_v is None else self._no_v)

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, 1, self.dtype, self.v_head_dim)

    def free_pages(self) -> int:
        return len(self._free)

    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def on_device(self, seq_id: int) -> bool:
        return self._get(seq_id).on_device

    def pages(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).pages)

    def device_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).device_len

    def synced_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).synced

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

    # ---- the forward pass --------------------------------------------------------------------------
    def prepare(self, seq_ids: list[int], new_tokens: list[int], start_positions: list[int]) -> AttentionMetadata:
        """Give each sequence room for its new tokens and describe where they go.

        The new tokens of a sequence follow its existing KV, so start_positions must equal its device tokens
        (0 for a new or evicted sequence); a sequence whose KV is on host only must be restored first, since
        running it from scratch would silently drop its checkpoint. The returned tensors are on the device.
        The new tokens count as on device from here: sync only after the forward pass has written them.
        """
        self._check_prepare_args(seq_ids, new_tokens, start_positions)
        self._grow_to({sid: int(p) + int(n) for sid, n, p in zip(seq_ids, new_tokens, start_positions)},
                      f"a step of {sum(new_tokens)} new tokens over {len(seq_ids)} sequences")
        for sid, n in zip(seq_ids, new_tokens):
            self._seqs[sid].device_len += int(n)
        starts = torch.tensor(start_positions, dtype=torch.int64).reshape(-1)
        lens = torch.tensor(new_tokens, dtype=torch.int64).reshape(-1)
        table = self._block_table(seq_ids)
        positions, slots = self._slots(table, starts, starts + lens)
        query_starts = torch.zeros(len(seq_ids) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=query_starts[1:])
        return AttentionMetadata(positions, query_starts, starts + lens, table, slots,
                                 self.page_size).to(self.device)

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

    def _block_table(self, seq_ids) -> torch.Tensor:
        width = max((len(self._seqs[sid].pages) for sid in seq_ids), default=0)
        table = torch.full((len(seq_ids), width), -1, dtype=torch.int64)
        for row, sid in enumerate(seq_ids):
            pages = self._seqs[sid].pages
            table[row, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        return table

    def _slots(self, table: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
        """Positions [starts[b], ends[b]) of each row, and their flat slots in the pool, vectorised."""
        lens = ends - starts
        row = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        offsets = torch.cumsum(lens, 0) - lens
        positions = torch.arange(int(lens.sum())) - offsets[row] + starts[row]
        slots = table[row, positions // self.page_size] * self.page_size + positions % self.page_size
        return positions, slots

    # ---- moving KV between device and host --------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return self._kv.view(self.num_layers, self.planes, self.num_pages * self.page_size, self.num_kv_heads,
                             self.head_dim)

    def _gather(self, seq_ids, starts, ends) -> torch.Tensor:
        """Device KV of the spans, token-major [T, L, planes, H, D] on CPU: one gather and one D2H for all."""
        _, slots = self._slots(self._block_table(seq_ids), torch.tensor(starts), torch.tensor(ends))
        picked = self._flat().index_select(2, slots.to(self.device))
        return picked.permute(2, 0, 1, 3, 4).contiguous().cpu()

    def _scatter(self, seq_ids, staged: torch.Tensor) -> None:
        """Write token-major KV (all of each sequence, in order) into the sequences' pages: one index_copy."""
        lens = torch.tensor([self._seqs[sid].synced for sid in seq_ids])
        _, slots = self._slots(self._block_table(seq_ids), torch.zeros_like(lens), lens)
        self._flat().index_copy_(2, slots.to(self.device), staged.permute(1, 2, 0, 3, 4))

    def _new_host(self, capacity: int) -> torch.Tensor:
        capacity = _cdiv(capacity, self.page_size) * self.page_size
        return torch.empty(capacity, self.num_layers, self.planes, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                           pin_memory=self.host_pinned)

    def _host_append(self, s: _Seq, kv: torch.Tensor) -> None:
        end = s.synced + kv.shape[0]
        if s.host is None:
            s.host = HostKV(self._new_host(end), 0)
        elif end > s.host.capacity:
            grown = self._new_host(max(end, 2 * s.host.capacity))
            grown[:s.synced].copy_(s.host.kv[:s.synced])
            s.host = HostKV(grown, s.synced)
        s.host.kv[s.synced:end].copy_(kv)
        s.host.length = s.synced = end

    def sync_to_host(self, seq_ids) -> int:
        """Checkpoint the tokens written since the last sync (called at page boundaries); returns tokens copied."""
        todo = [sid for sid in seq_ids if self._get(sid).device_len > self._seqs[sid].synced]
        if not todo:
            return 0
        starts = [self._seqs[sid].synced for sid in todo]
        ends = [self._seqs[sid].device_len for sid in todo]
        staged = self._gather(todo, starts, ends)
        offset = 0
        for sid, a, b in zip(todo, starts, ends):
            self._host_append(self._seqs[sid], staged[offset:offset + b - a])
            offset += b - a
        return offset

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
        """COMBINE/resume: pages for the whole host copy, then one H2D per sequence and one index_copy for all."""
        for sid in seq_ids:
            if self._get(sid).on_device:
                raise ValueError(f"sequence {sid} is already on device: only yielded sequences can be restored")
        if not seq_ids:
            return 0
        tokens = {sid: self._seqs[sid].synced for sid in seq_ids}
        self._grow_to(tokens, f"restoring {len(seq_ids)} sequences ({sum(tokens.values())} tokens)")
        staged = torch.empty(sum(tokens.values()), self.num_layers, self.planes, self.num_kv_heads, self.head_dim,
                             dtype=self.dtype, device=self.device)
        offset = 0
        for sid in seq_ids:
            host = self._seqs[sid].host
            staged[offset:offset + host.length].copy_(host.tokens(), non_blocking=self.host_pinned)
            offset += host.length
        self._scatter(seq_ids, staged)
        for sid in seq_ids:
            self._seqs[sid].device_len = self._seqs[sid].synced
        return offset

    def _require_on_device(self, seq_ids, action: str) -> None:
        for sid in seq_ids:
            if not self._get(sid).on_device:
                raise ValueError(f"cannot {action} sequence {sid}: its KV is not on device")

    # ---- MIGRATE --------------------------------------------------------------------------------------
    def export(self, seq_id: int) -> HostKV:
        """The whole KV as a host copy, for another cache to import; syncs first so nothing is left behind.

        The result shares memory with this cache's host copy (no copy for a move within one host); the caller
        releases the sequence here once the target has imported it.
        """
        self.sync_to_host([seq_id])
        host = self._seqs[seq_id].host
        return HostKV(host.tokens(), host.length)

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
        if self.host_pinned and not host_kv.kv.is_pinned():
            self._host_append(s, host_kv.tokens())   # restores need pinned memory to be asynchronous
        else:
            s.host, s.synced = HostKV(host_kv.tokens(), host_kv.length), host_kv.length
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
        """A finished (or migrated-away) sequence: its pages go back to the pool and its host copy is dropped."""
        for sid in seq_ids:
            self._get(sid)
        for sid in seq_ids:
            self._free_device(self._seqs.pop(sid))

    # ---- invariants ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Recount pages and lengths; raises InvariantError on the first broken rule."""
        owned = [p for s in self._seqs.values() for p in s.pages]
        every = owned + self._free
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise InvariantError(f"pages: {len(owned)} owned + {len(self._free)} free != {self.num_pages}, "
                                 "or a page is owned twice or lost")
        for sid, s in self._seqs.items():
            self._check_seq(sid, s)

    def _check_seq(self, sid: int, s: _Seq) -> None:
        host_len = 0 if s.host is None else s.host.length
        if host_len != s.synced or (s.host is not None and s.host.capacity < s.host.length):
            raise InvariantError(f"sequence {sid}: host copy holds {host_len} tokens, synced says {s.synced}")
        if s.on_device:
            if not s.synced <= s.device_len <= len(s.pages) * self.page_size:
                raise InvariantError(f"sequence {sid}: synced {s.synced}, device {s.device_len}, "
                                     f"{len(s.pages)} pages of {self.page_size}")
        elif s.device_len or s.synced < 1:
            raise InvariantError(f"sequence {sid}: off device with device_len {s.device_len} and "
                                 f"{s.synced} host tokens")
