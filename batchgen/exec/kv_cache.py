"""One device's paged KV cache, with the host copy that is each sequence's source of truth.

The tensor-side counterpart of `batchgen.core.state.ClusterState`: the scheduler decides who runs, yields,
migrates or is evicted; this object moves the tensors and refuses anything that would break the device-memory
budget, so an over-eager policy fails at the step that caused it instead of running out of memory later.

Layout decisions (the paper is silent on them):

- All layers' K and V live in one device tensor [num_layers, planes, num_pages, page_size, kv_heads, head_dim],
  planes = 2 (K, V) or 1 (K only, see MLA below). `layer(l)` hands attention contiguous per-layer views, while
  sync/restore/migrate move every layer of every sequence in a call with one gather / one index_copy over the
  pool, of exactly the tokens that move (their slots, not whole pages).
- MLA (DeepSeek-V3) caches the compressed latent, not per-head K/V: per token and layer one "head" of width
  kv_lora_rank + qk_rope_head_dim holding [c_kv (after kv_a_layernorm) | k_pe (after RoPE)], in the K pool,
  and no V pool at all (`v_head_dim=0`; `layer(l)` then returns a zero-width V tensor), so every byte of the
  budget holds latent and `bytes_per_token` is layers x (kv_lora_rank + qk_rope_head_dim) x dtype size.
  Attention re-derives per-head k_nope and v from c_kv with kv_b_proj. Build any model's cache from its
  geometry: `PagedKVCache.from_budget(**model.kv_cache_geometry()._asdict(), page_size=..., budget_bytes=...)`.
  A V pool must be as wide as K (v_head_dim == head_dim) or absent: no architecture here needs another width.
- A sequence holds exactly the pages its context needs, extended lazily by `prepare` (or ahead of time by
  `reserve`, which lets a scheduler claim memory at a boundary and never fail mid-step).
- Host copies live in a host page pool laid out like the device pool (`batchgen.exec.host_pool.HostPool`:
  one per node, shared by the caches of its GPUs, or one of the cache's own), pinned when the device is CUDA
  (unless host_pinned=False) so that copies are asynchronous DMA. A sequence's host copy is a list of host
  pages, token t at host page t // page_size, slot t % page_size, exactly as on device: moving KV either way
  is one gather and one index_copy for any number of sequences, and one layer of a batch of sequences (what
  host-resident decode restores) is one gather of whole pages. The pool grows when full, within its budget
  (`HostMemoryFullError` past it).
- MIGRATE: batchgen.exec.kv_migration. Shared prompt prefixes (pages held by reference): batchgen.exec.kv_prefixes.
- A sequence is in one of two places: on device (pages held; its first `synced` tokens also on host) or on
  host only (no pages; the host copy holds all of it). Evicted and released sequences are forgotten: a
  recomputed sequence comes back through `prepare` with start position 0, like a new one.
- Host-resident decode: batchgen.exec.kv_host_steps.
"""

from __future__ import annotations

from collections import Counter

import torch

from batchgen.core.sequences import InvariantError
from batchgen.exec.host_pool import HostPool
from batchgen.exec.kv_host_steps import HostResidentSteps
from batchgen.exec.kv_migration import HostKV, Migrated, Migration, migrate  # noqa: F401 (re-exported)
from batchgen.exec.kv_pages import CacheFullError, _block_table, _cdiv, _index, _Seq, _v_width  # noqa: F401
from batchgen.exec.kv_prefixes import SharedPrefixes
from batchgen.exec.metadata import AttentionMetadata


class PagedKVCache(SharedPrefixes, HostResidentSteps, Migration):
    """One device's paged KV pool for all layers, plus the host copy that is each sequence's source of truth."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int, num_pages: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 host_pinned: bool | None = None, v_head_dim: int | None = None, host_pages: int | None = None,
                 max_context: int | None = None, staging_pages: int | None = None, host_alloc=None,
                 host_pool: HostPool | None = None, host_budget_pages: int | None = None):
        """v_head_dim: None or head_dim for a V pool like the K pool; 0 for no V pool (MLA's latent cache).
        host_pool: the node's host pool, shared with the caches of its other GPUs; without one the cache makes
        its own, of `host_pages` pages to start with (default num_pages; it doubles when full) and at most
        `host_budget_pages` (None: no limit), its storage from `host_alloc(shape, dtype) -> zero-filled CPU
        tensor` (default: torch.zeros, pinned per host_pinned; backend=dist passes a shared-memory file per
        pool, `batchgen.dist.shared_host`, so that host copies outlive the process).
        Host-resident decode's staging buffers (`batchgen.exec.staging`) hold `staging_pages` pages of one layer
        each (host micro-batches are cut to fit), or, without it, B_attn sequences of `max_context` tokens (the
        job's longest sequence)."""
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
        if host_pool is None:
            pinned = self.device.type == "cuda" if host_pinned is None else bool(host_pinned)
            if pinned and not torch.cuda.is_available():
                raise ValueError("host_pinned=True needs CUDA (pinned memory is allocated through the CUDA driver)")
            host_pool = HostPool(num_layers, self.planes, page_size, num_kv_heads, head_dim, dtype,
                                 pages=num_pages if host_pages is None else int(host_pages),
                                 budget_pages=host_budget_pages, pinned=pinned, alloc=host_alloc)
        elif not host_pool.fits(self):
            raise ValueError(f"a host pool of pages {host_pool.geometry} cannot hold this cache's pages "
                             f"{(num_layers, self.planes, page_size, num_kv_heads, head_dim, dtype)}")
        self.host_pool = host_pool
        self.host_pinned = host_pool.pinned
        host_pool.users.append(self)
        # zeros, not empty: attention may read padding slots with zero weight, and 0 * NaN garbage is NaN
        self._kv = torch.zeros(num_layers, self.planes, num_pages, page_size, num_kv_heads, head_dim,
                               dtype=dtype, device=self.device)
        self._no_v = None if self.v_head_dim else torch.zeros(num_pages, page_size, num_kv_heads, 0, dtype=dtype,
                                                             device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack; page 0 is handed out first
        self._seqs: dict[int, _Seq] = {}
        self._prefixes_init()  # shared prompt prefixes (batchgen.exec.kv_prefixes)
        # what this cache's own copies moved, measured from the tensors copied: bytes host -> device (h2d:
        # restores) and device -> host (d2h: checkpoints), and how many sequences' KV each (h2d_seqs, d2h_seqs)
        self.copied: Counter = Counter()
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
                    host_alloc=None, host_pool: HostPool | None = None,
                    host_budget_pages: int | None = None) -> "PagedKVCache":
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
                   staging_pages=staging_pages, host_alloc=host_alloc, host_pool=host_pool,
                   host_budget_pages=host_budget_pages)

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

    @property
    def _host(self) -> torch.Tensor:
        """The host pool's pages (a new tensor once the pool grows)."""
        return self.host_pool.kv

    def host_capacity_pages(self) -> int:
        """Pages of the host pool (shared with the node's other caches, if any)."""
        return self.host_pool.capacity_pages()

    def host_used_pages(self) -> int:
        """Host pages this cache's sequences hold."""
        return sum(len(s.host_pages) for s in self._seqs.values())

    def owned_host_pages(self) -> list[int]:
        return [p for s in self._seqs.values() for p in s.host_pages]

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
    def _host_cover(self, tokens_by_seq: dict[_Seq, int], what: str = "host copies") -> None:
        """Give each sequence the host pages that cover its first `tokens` tokens (it never shrinks here); all or
        nothing (HostMemoryFullError past the pool's budget)."""
        need = {s: _cdiv(n, self.page_size) - len(s.host_pages) for s, n in tokens_by_seq.items()}
        total = sum(n for n in need.values() if n > 0)
        if not total:
            return
        pages = self.host_pool.take(total, what)
        for s, n in need.items():
            if n > 0:
                s.host_pages.extend(pages[:n])
                del pages[:n]

    def _host_flat(self) -> torch.Tensor:
        return self.host_pool.flat()

    def _device_flat(self) -> torch.Tensor:
        return self._kv.view(self.num_layers, self.planes, -1, self.num_kv_heads, self.head_dim)

    def _token_slots(self, seqs: list[_Seq], which: str, first: list[int], last: list[int],
                     device: torch.device | None = None) -> torch.Tensor:
        """Flat slots of tokens [first[i], last[i]) of each sequence in its `which` pages (pages or host_pages),
        concatenated: what one gather or index_copy over a flat pool moves."""
        _, slots = self._slots(_block_table([getattr(s, which) for s in seqs]),
                               torch.tensor(first, dtype=torch.int64), torch.tensor(last, dtype=torch.int64))
        return slots if device is None else slots.to(device)

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
        meta = self._metadata([self._seqs[sid].pages for sid in seq_ids], new_tokens, start_positions)
        fanout = self.fanout(seq_ids, new_tokens, start_positions)  # a prefix's tail, written by its writer's rows
        if fanout is not None:
            meta.fanout_rows, meta.fanout_slots = fanout
        return meta.to(self.device)

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

    # ---- moving KV between device and host --------------------------------------------------------
    def _read_host(self, host_slots: torch.Tensor) -> torch.Tensor:
        """Tokens of the host pool, [num_layers, planes, T, kv_heads, head_dim] (pinned with a pinned pool)."""
        out = torch.empty(self.num_layers, self.planes, host_slots.numel(), self.num_kv_heads, self.head_dim,
                          dtype=self.dtype, pin_memory=self.host_pinned)
        return torch.index_select(self._host_flat(), 2, host_slots, out=out)

    def _write_device(self, device_slots: torch.Tensor, rows: torch.Tensor) -> int:
        """rows [num_layers, planes, T, kv_heads, head_dim] into device slots; returns the bytes copied."""
        self._device_flat().index_copy_(2, device_slots.to(self.device),
                                        rows.to(self.device, non_blocking=rows.is_pinned()))
        return rows.numel() * rows.element_size()

    def _write_host(self, host_slots: torch.Tensor, rows: torch.Tensor) -> int:
        self._host_flat().index_copy_(2, host_slots, rows.cpu())
        return rows.numel() * rows.element_size()

    def _host_to_device(self, seqs: list[_Seq], first: list[int], last: list[int]) -> None:
        rows = self._read_host(self._token_slots(seqs, "host_pages", first, last))
        self.copied["h2d"] += self._write_device(self._token_slots(seqs, "pages", first, last), rows)
        self.copied["h2d_seqs"] += sum(b > a for a, b in zip(first, last))

    def _device_to_host(self, seqs: list[_Seq], first: list[int], last: list[int]) -> None:
        rows = self._device_flat().index_select(2, self._token_slots(seqs, "pages", first, last, self.device))
        self.copied["d2h"] += self._write_host(self._token_slots(seqs, "host_pages", first, last), rows)
        self.copied["d2h_seqs"] += sum(b > a for a, b in zip(first, last))

    def sync_to_host(self, seq_ids) -> int:
        """Checkpoint the tokens written since the last sync (called at page boundaries): they go down in one
        gather and one index_copy. Returns tokens copied."""
        todo = [self._get(sid) for sid in seq_ids]
        todo = [s for s in todo if s.device_len > s.synced]
        if not todo:
            return 0
        self._host_cover({s: s.device_len for s in todo}, f"checkpointing {len(todo)} sequences")
        self._device_to_host(todo, [s.synced for s in todo], [s.device_len for s in todo])
        copied = 0
        for s in todo:
            copied += s.device_len - s.synced
            s.synced = s.device_len
        return copied

    def _checkpoint(self, s: _Seq, tokens: int) -> None:
        """A device-resident sequence's first `tokens` tokens into its (empty) host copy."""
        self._host_cover({s: tokens}, f"checkpointing {tokens} tokens")
        self._device_to_host([s], [0], [tokens])
        s.synced = tokens

    def yield_to_host(self, seq_ids) -> int:
        """YIELD: checkpoint, then give the pages back; the host copy carries the sequence. Returns tokens copied."""
        self._require_on_device(seq_ids, "yield")
        copied = self.sync_to_host(seq_ids)
        for sid in seq_ids:
            self._free_device(self._seqs[sid])
        return copied

    def restore(self, seq_ids) -> int:
        """COMBINE/resume: pages for the whole host copy, then one gather, one H2D and one index_copy for all (for a
        sequence that took a shared prefix just before, `share_prefix`, only what follows it). Returns tokens
        copied."""
        for sid in seq_ids:
            if self._get(sid).on_device and sid not in self._attached:
                raise ValueError(f"sequence {sid} is already on device: only yielded sequences can be restored")
            if self._seqs[sid].pending:
                raise ValueError(f"sequence {sid} is in a host-resident step: finish it before restoring")
        if not seq_ids:
            return 0
        tokens = {sid: self._seqs[sid].synced for sid in seq_ids}
        self._grow_to(tokens, f"restoring {len(seq_ids)} sequences ({sum(tokens.values())} tokens)")
        seqs = [self._seqs[sid] for sid in seq_ids]
        first = [s.device_len for s in seqs]  # past a shared prefix it took (kv_prefixes), else from its first token
        self._attached.difference_update(seq_ids)
        self._host_to_device(seqs, first, [s.synced for s in seqs])
        for s in seqs:
            s.device_len = s.synced
        return sum(tokens.values()) - sum(first)

    def _require_on_device(self, seq_ids, action: str) -> None:
        for sid in seq_ids:
            if not self._get(sid).on_device:
                raise ValueError(f"cannot {action} sequence {sid}: its KV is not on device")

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
            self._drop_host_copy(s)

    def _drop_host_copy(self, s: _Seq) -> None:
        own = s.host_pages
        if s.host_group >= 0:  # its first pages are its group's host prefix: it lets go of them
            own = own[len(self.host_pool.prefixes[s.host_group][0]):]
            self.host_pool.release_prefix(s.host_group)
            s.host_group = -1
        self.host_pool.give_back(own)
        s.host_pages, s.synced = [], 0

    # ---- invariants ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Recount pages (the host pool's over every cache that uses it) and lengths; raises InvariantError on
        the first broken rule."""
        owned = self._check_prefixes([p for s in self._seqs.values() for p in s.pages]) + (
            self.shards.owned_pages() if self.shards is not None else [])
        every = owned + self._free
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise InvariantError(f"pages: {len(owned)} owned + {len(self._free)} free != {self.num_pages}, "
                                 "or a page is owned twice or lost")
        self.host_pool.check()
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
