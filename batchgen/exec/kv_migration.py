"""MIGRATE on real tensors: a sequence's KV from one cache into another, device pages to device pages where it
has them, in one process (`migrate`) or in two halves across processes (`migration_rows` on the source, `adopt`
on the destination: batchgen.dist.kv_transfer); and a host copy exported and imported whole (recovery).

MIGRATE (`migrate`) copies a sequence from where its KV is (device pages, or its host copy when it has none on
device) straight into where it is to run (the destination's device pages, or its host copy), and leaves a host copy
at the destination only when asked (the scheduler counts one there): within one host pool the copy changes hands
(no byte moves); into another pool it is made again from the arrival (a second copy, device -> host). Across
processes the same happens in two halves (`migration_rows` on the source, `adopt` on the destination:
batchgen.dist.kv_transfer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.core.sequences import InvariantError
from batchgen.exec.kv_pages import CacheFullError, _cdiv, _index, _Seq

if TYPE_CHECKING:  # pragma: no cover
    from batchgen.exec.kv_cache import PagedKVCache


@dataclass
class HostKV:
    """A sequence's KV in host memory as token-major rows: what `export` gives and `import_` adopts (a host copy
    read from another process's pool file, batchgen.dist.recovery)."""

    kv: torch.Tensor  # [capacity, num_layers, planes, kv_heads, head_dim] on CPU; rows [:length] are valid
    length: int

    @property
    def capacity(self) -> int:
        return self.kv.shape[0]

    def tokens(self) -> torch.Tensor:
        return self.kv[:self.length]


@dataclass(frozen=True)
class Migrated:
    """What one MIGRATE copied (`migrate`, `PagedKVCache.adopt`), measured from the tensors copied."""

    source: str               # where the KV was read: "device" (the source's device pages) or "host" (its host copy)
    target: str               # where it landed: "device" (the destination's device pages) or "host" (its host copy)
    transfer_bytes: int       # copied from the source cache into the destination (0: handed over within a pool)
    local_bytes: int = 0      # a second copy at the destination, device -> host: the host copy it keeps, made again
    #                           from the arrival because the source's was in another pool
    handed_over: int = 0      # tokens of a host copy that changed hands within one host pool (no byte moved)


class Migration:
    """The migration methods of `PagedKVCache` (which owns the pools and the sequences these read and write)."""

    def migration_rows(self, seq_id: int) -> tuple[torch.Tensor, str]:
        """What MIGRATE sends: the sequence's tokens, [num_layers, planes, tokens, kv_heads, head_dim], from its
        device pages when it holds any ("device": on the device), else from its host copy ("host"). The sequence
        stays here until released."""
        s = self._get(seq_id)
        if s.pending:
            raise ValueError(f"sequence {seq_id} is in a host-resident step: finish it before migrating it")
        if s.on_device:
            slots = self._token_slots([s], "pages", [0], [s.device_len], self.device)
            return self._device_flat().index_select(2, slots), "device"
        return self._read_host(self._token_slots([s], "host_pages", [0], [s.synced])), "host"

    def adopt(self, seq_id: int, rows: torch.Tensor, source: str, *, to_device: bool, host_copy: bool,
              host_tokens: int | None = None, past: int = 0) -> "Migrated":
        """MIGRATE in: `rows` from another cache's `migration_rows` land where the sequence is to run: in device
        pages (to_device) or a host copy. `host_copy`: keep a host copy here too (required without to_device): the
        first `host_tokens` tokens of the arrival (what the source's host copy held; default all) are checkpointed
        from its new pages, a second copy (device -> host) here. `past`: the sequence took its group's prefix of
        that many tokens here (`share_prefix(..., resuming=True)`) and the rows are the rest of its KV, landing past
        it on the device. All or nothing."""
        if past:
            return self._adopt_past(seq_id, rows, source, past, to_device, host_copy, host_tokens)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has KV in this cache: release it before it migrates here")
        n = int(rows.shape[2])
        want = (self.num_layers, self.planes, self.num_kv_heads, self.head_dim)
        if (rows.shape[:2] + rows.shape[3:]) != want or rows.dtype != self.dtype or n < 1:
            raise ValueError(f"sequence {seq_id}: migrated rows {tuple(rows.shape)} of {rows.dtype} do not fit this "
                             f"cache's (layers, planes, tokens, kv_heads, head_dim) = {want[:2] + ('>0',) + want[2:]} "
                             f"of {self.dtype}")
        if not (to_device or host_copy):
            raise ValueError(f"sequence {seq_id}: a migration must land on device pages or as a host copy")
        if to_device and not self.can_fit({seq_id: n}):
            raise CacheFullError(f"migrating sequence {seq_id} here ({n} tokens)", _cdiv(n, self.page_size),
                                 len(self._free), self.num_pages, self.page_size)
        s = self._seqs[seq_id] = _Seq()
        what = f"migrating sequence {seq_id} here ({n} tokens)"
        try:
            if to_device:
                self._grow_to({seq_id: n}, what)
                moved = self._write_device(self._token_slots([s], "pages", [0], [n]), rows)
                s.device_len = n
            else:
                self._host_cover({s: n}, what)
                moved = self._write_host(self._token_slots([s], "host_pages", [0], [n]), rows)
                s.synced = n
            local = 0
            if to_device and host_copy and (host_tokens is None or host_tokens > 0):  # the second copy
                before = self.copied["d2h"]
                self._checkpoint(s, n if host_tokens is None else min(int(host_tokens), n))
                local = self.copied["d2h"] - before
        except BaseException:  # the host pool's budget, say: nothing of it stays
            self.release([seq_id])
            raise
        return Migrated(source, "device" if to_device else "host", moved, local)

    def _adopt_past(self, seq_id: int, rows: torch.Tensor, source: str, past: int, to_device: bool,
                    host_copy: bool, host_tokens: int | None) -> "Migrated":
        """`adopt` of the rest of a sequence's KV, past the prefix it took here."""
        s = self._seqs.get(seq_id)
        if s is None or seq_id not in self._attached or s.device_len != past or not to_device:
            raise InvariantError(f"sequence {seq_id}: the rest of its KV lands on the device past the prefix of {past} "
                                 "tokens it took here, which it has not")
        n = past + int(rows.shape[2])
        if not self.can_fit({seq_id: n - past}):
            raise CacheFullError(f"migrating sequence {seq_id} here ({n} tokens)", _cdiv(n - past, self.page_size),
                                 len(self._free), self.num_pages, self.page_size)
        self._attached.discard(seq_id)
        try:
            self._grow_to({seq_id: n}, f"migrating sequence {seq_id} here ({n} tokens)")
            moved = self._write_device(self._token_slots([s], "pages", [past], [n]), rows)
            s.device_len = n
            local = 0
            if host_copy and (host_tokens is None or host_tokens > 0):  # its host copy, whole, from the pages here
                before = self.copied["d2h"]
                self._checkpoint(s, n if host_tokens is None else min(int(host_tokens), n))
                local = self.copied["d2h"] - before
        except BaseException:
            self.release([seq_id])
            raise
        return Migrated(source, "device", moved, local)

    def export(self, seq_id: int) -> HostKV:
        """The whole KV as token-major host rows, for another cache to import (a recovery's host copy from a
        lost rank's pool file, or a test's); syncs first so nothing is left behind. A copy: the caller releases
        the sequence here once the target has imported it."""
        s = self._get(seq_id)
        if s.pending:
            raise ValueError(f"sequence {seq_id} is in a host-resident step: finish it before exporting")
        self.sync_to_host([seq_id])
        n = _cdiv(s.synced, self.page_size)
        pages = self._host.index_select(2, _index(s.host_pages[:n]))   # [L, planes, n, page, H, D]
        rows = pages.permute(2, 3, 0, 1, 4, 5).reshape(n * self.page_size, *pages.shape[:2], *pages.shape[4:])
        return HostKV(rows[:s.synced], s.synced)

    def import_(self, seq_id: int, host_kv: HostKV, to_device: bool = False) -> int:
        """Adopt a host copy (and optionally load it). All or nothing; returns tokens loaded."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has KV in this cache: release it before importing")
        self._check_host_kv(seq_id, host_kv)
        if to_device and not self.can_fit({seq_id: host_kv.length}):
            raise CacheFullError(f"importing sequence {seq_id} ({host_kv.length} tokens)",
                                 _cdiv(host_kv.length, self.page_size), len(self._free), self.num_pages,
                                 self.page_size)
        s = _Seq()
        self._host_cover({s: host_kv.length}, f"importing sequence {seq_id} ({host_kv.length} tokens)")
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


def migrate(src: "PagedKVCache", dst: "PagedKVCache", seq_id: int, *, to_device: bool, host_copy: bool) -> Migrated:
    """MIGRATE a sequence from `src` to `dst` (one process): from its device pages when it holds any, else from its
    host copy, straight into `dst`'s device pages (to_device) or host copy; `dst` keeps a host copy exactly when
    `host_copy` (required without to_device), holding what the source's held. Within one host pool (two GPUs of a
    node) the host copy changes hands and no byte of it moves; into another pool it goes as `PagedKVCache.adopt`
    says. A host copy whose sequence took its group's prefix in `dst` just before (`share_prefix(...,
    resuming=True)`) is restored past it. The sequence leaves `src`. All or nothing: a destination that cannot take it
    raises before anything changes."""
    s = src._get(seq_id)
    attached = seq_id in dst._attached
    if attached and (s.on_device or not to_device or src.host_pool is not dst.host_pool):
        raise InvariantError(f"sequence {seq_id} took a prefix in the destination: only its host copy in the same "
                             "pool can be restored past it")
    if src.host_pool is not dst.host_pool or (s.on_device and not to_device):
        rows, source = src.migration_rows(seq_id)
        moved = dst.adopt(seq_id, rows, source, to_device=to_device, host_copy=host_copy, host_tokens=s.synced)
        src.release([seq_id])
        return moved
    if s.pending:
        raise ValueError(f"sequence {seq_id} is in a host-resident step: finish it before migrating it")
    if seq_id in dst and not attached:
        raise ValueError(f"sequence {seq_id} already has KV in the destination: release it there first")
    if not (to_device or host_copy):
        raise ValueError(f"sequence {seq_id}: a migration must land on device pages or as a host copy")
    n = s.device_len if s.on_device else s.synced
    if to_device and not dst.can_fit({seq_id: n - (dst._resident_tokens(seq_id) if attached else 0)}):
        raise CacheFullError(f"migrating sequence {seq_id} here ({n} tokens)", _cdiv(n, dst.page_size),
                             len(dst._free), dst.num_pages, dst.page_size)
    if not attached:
        dst._seqs[seq_id] = _Seq()
    d = dst._seqs[seq_id]
    if s.on_device:  # pages first (they fit): nothing below can fail
        dst._grow_to({seq_id: n}, f"migrating sequence {seq_id} here ({n} tokens)")
    handed = s.synced if host_copy or not s.on_device else 0
    if handed:  # the host copy changes hands in the node's pool
        d.host_pages, d.synced, d.host_group = s.host_pages, s.synced, s.host_group
        s.host_pages, s.synced, s.host_group = [], 0, -1
    if s.on_device:  # device pages to device pages
        slots = src._token_slots([s], "pages", [0], [n], src.device)
        moved = Migrated("device", "device", dst._write_device(dst._token_slots([d], "pages", [0], [n]),
                                                               src._device_flat().index_select(2, slots)),
                         handed_over=handed)
        d.device_len = n
    elif to_device:  # from the node's host copy onto the destination's device
        before = dst.copied["h2d"]
        dst.restore([seq_id])
        moved = Migrated("host", "device", dst.copied["h2d"] - before, handed_over=handed)
        if not host_copy:
            dst._drop_host_copy(d)
    else:
        moved = Migrated("host", "host", 0, handed_over=handed)
    src.release([seq_id])
    return moved
