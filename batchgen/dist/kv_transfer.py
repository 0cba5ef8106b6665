"""MIGRATE between ranks: one sequence's KV sent from one process's paged cache to another's.

The paged cache already packs a sequence as token-major rows, [tokens, layers, planes, kv_heads, head_dim]
(`PagedKVCache.export`, which syncs to the host copy first) and adopts such rows into its own pages
(`PagedKVCache.import_`). Across processes the rows travel as one tensor after a fixed-size header (sequence id,
dtype, shape), so the receiver allocates exactly the right buffer and refuses KV meant for another sequence
(a plan mismatch) instead of importing it. The rows go through the communication device (CPU for gloo, the
GPU for NCCL).

The sender does not release the sequence: its host copy stays the source of truth until the plan says the
receiver has it (rank 0 releases it on the source in the next step), so a receiver lost mid-transfer loses
nothing.
"""

from __future__ import annotations

import torch

from batchgen.dist.comm import Comm
from batchgen.exec.kv_cache import HostKV, PagedKVCache

_MAGIC = 0x4B56_5345_51  # "KVSEQ": a header, not stray data from a mismatched send
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8)
_MAX_DIMS = 6
_HEADER = 4 + _MAX_DIMS  # magic, seq id, dtype code, ndim, shape (padded)


def pack(cache: PagedKVCache, seq_id: int) -> torch.Tensor:
    """The sequence's whole KV as one contiguous CPU tensor [tokens, layers, planes, kv_heads, head_dim]."""
    return cache.export(seq_id).tokens().contiguous()


def unpack(cache: PagedKVCache, seq_id: int, rows: torch.Tensor, to_device: bool = False) -> int:
    """Adopt rows from `pack` as sequence seq_id (host copy; on device too if asked); tokens loaded to device."""
    rows = rows.cpu()
    return cache.import_(seq_id, HostKV(rows, rows.shape[0]), to_device=to_device)


def _header(seq_id: int, rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype not in _DTYPES:
        raise ValueError(f"KV dtype {rows.dtype} cannot be sent; supported: {_DTYPES}")
    if rows.dim() > _MAX_DIMS:
        raise ValueError(f"KV rows of {rows.dim()} dimensions; at most {_MAX_DIMS}")
    shape = list(rows.shape) + [0] * (_MAX_DIMS - rows.dim())
    return torch.tensor([_MAGIC, seq_id, _DTYPES.index(rows.dtype), rows.dim(), *shape], dtype=torch.int64)


def send_rows(comm: Comm, seq_id: int, rows: torch.Tensor, dst: int, device: torch.device | str = "cpu") -> int:
    """Send packed rows to group rank dst: header, then payload. Returns bytes of payload."""
    device = torch.device(device)
    comm.send(_header(seq_id, rows).to(device), dst, what=f"KV header of sequence {seq_id}")
    comm.send(rows.to(device).contiguous(), dst, what=f"KV of sequence {seq_id}")
    return rows.numel() * rows.element_size()


def recv_rows(comm: Comm, seq_id: int, src: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Receive the rows of sequence seq_id from group rank src (on `device`)."""
    device = torch.device(device)
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    comm.recv(header, src, what=f"KV header of sequence {seq_id}")
    magic, got_id, code, ndim, *shape = header.tolist()
    if magic != _MAGIC:
        raise RuntimeError(f"rank {comm.ranks[src]} sent something that is not a KV header while sequence "
                           f"{seq_id} was expected: the ranks' plans disagree")
    if got_id != seq_id:
        raise RuntimeError(f"expected the KV of sequence {seq_id} from rank {comm.ranks[src]}, got sequence "
                           f"{got_id}: the ranks' plans disagree")
    rows = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    comm.recv(rows, src, what=f"KV of sequence {seq_id}")
    return rows


def send_sequence(comm: Comm, cache: PagedKVCache, seq_id: int, dst: int,
                  device: torch.device | str = "cpu") -> int:
    """MIGRATE out: pack and send (the sequence stays here until released). Returns bytes sent."""
    return send_rows(comm, seq_id, pack(cache, seq_id), dst, device)


def recv_sequence(comm: Comm, cache: PagedKVCache, seq_id: int, src: int, to_device: bool = False,
                  device: torch.device | str = "cpu") -> int:
    """MIGRATE in: receive and adopt. Returns tokens received."""
    rows = recv_rows(comm, seq_id, src, device)
    unpack(cache, seq_id, rows, to_device)
    return rows.shape[0]
