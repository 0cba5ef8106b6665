"""MIGRATE between ranks: one sequence's KV sent from one process's paged cache straight into another's.

The source reads the sequence where its KV is: its device pages when it holds any, else its host copy
(`PagedKVCache.migration_rows`: [layers, planes, tokens, kv_heads, head_dim], exactly the tokens it holds). The
rows travel as one tensor after a fixed-size header (sequence id, dtype, shape, where they were read, how many
tokens the source's host copy held), so the receiver allocates exactly the right buffer and refuses KV meant for
another sequence (a plan mismatch) instead of adopting it. They go through the communication device (CPU for
gloo, the GPU for NCCL) and land where the destination runs the sequence (`PagedKVCache.adopt`): in its device
pages, or as its host copy; a host copy the destination keeps beside device pages holds what the source's held.

The sender releases the sequence once its send has completed (`RankWorker._kv`): the plan has given it to the
receiver.
"""

from __future__ import annotations

import torch

from batchgen.dist.comm import Comm
from batchgen.exec.kv_cache import Migrated, PagedKVCache

_MAGIC = 0x4B56_5345_51  # "KVSEQ": a header, not stray data from a mismatched send
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8)
_MAX_DIMS = 6
_HEADER = 6 + _MAX_DIMS  # magic, seq id, dtype code, ndim, read from device (0/1), host copy tokens, shape (padded)


def _header(seq_id: int, rows: torch.Tensor, from_device: bool = False, host_tokens: int = 0) -> torch.Tensor:
    if rows.dtype not in _DTYPES:
        raise ValueError(f"KV dtype {rows.dtype} cannot be sent; supported: {_DTYPES}")
    if rows.dim() > _MAX_DIMS:
        raise ValueError(f"KV rows of {rows.dim()} dimensions; at most {_MAX_DIMS}")
    shape = list(rows.shape) + [0] * (_MAX_DIMS - rows.dim())
    return torch.tensor([_MAGIC, seq_id, _DTYPES.index(rows.dtype), rows.dim(), int(from_device), host_tokens,
                         *shape], dtype=torch.int64)


def send_rows(comm: Comm, seq_id: int, rows: torch.Tensor, dst: int, device: torch.device | str = "cpu",
              from_device: bool = False, host_tokens: int = 0) -> int:
    """Send rows to group rank dst: header, then payload. Returns bytes of payload."""
    device = torch.device(device)
    comm.send(_header(seq_id, rows, from_device, host_tokens).to(device), dst, what=f"KV header of sequence {seq_id}")
    comm.send(rows.to(device).contiguous(), dst, what=f"KV of sequence {seq_id}")
    return rows.numel() * rows.element_size()


def _recv(comm: Comm, seq_id: int, src: int, device: torch.device | str) -> tuple[torch.Tensor, bool, int]:
    device = torch.device(device)
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    comm.recv(header, src, what=f"KV header of sequence {seq_id}")
    magic, got_id, code, ndim, from_device, host_tokens, *shape = header.tolist()
    if magic != _MAGIC:
        raise RuntimeError(f"rank {comm.ranks[src]} sent something that is not a KV header while sequence "
                           f"{seq_id} was expected: the ranks' plans disagree")
    if got_id != seq_id:
        raise RuntimeError(f"expected the KV of sequence {seq_id} from rank {comm.ranks[src]}, got sequence "
                           f"{got_id}: the ranks' plans disagree")
    rows = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    comm.recv(rows, src, what=f"KV of sequence {seq_id}")
    return rows, bool(from_device), host_tokens


def recv_rows(comm: Comm, seq_id: int, src: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Receive the rows of sequence seq_id from group rank src (on `device`)."""
    return _recv(comm, seq_id, src, device)[0]


def send_sequence(comm: Comm, cache: PagedKVCache, seq_id: int, dst: int,
                  device: torch.device | str = "cpu", skip: int = 0) -> int:
    """MIGRATE out: the sequence's tokens from where they are here, sent (the sequence stays here until
    released), past the first `skip` (a prefix the destination holds, which the sequence takes there). Returns
    bytes sent."""
    rows, source = cache.migration_rows(seq_id)
    return send_rows(comm, seq_id, rows[:, :, skip:], dst, device, from_device=source == "device",
                     host_tokens=cache.synced_tokens(seq_id))


def recv_sequence(comm: Comm, cache: PagedKVCache, seq_id: int, src: int, to_device: bool, host_copy: bool,
                  device: torch.device | str = "cpu", past: int = 0) -> Migrated:
    """MIGRATE in: receive and land where the sequence runs here (device pages when to_device, else a host copy;
    a host copy beside them when host_copy), past the prefix of `past` tokens it took here. Returns what was
    copied."""
    rows, from_device, host_tokens = _recv(comm, seq_id, src, device)
    return cache.adopt(seq_id, rows, "device" if from_device else "host", to_device=to_device, host_copy=host_copy,
                       host_tokens=host_tokens, past=past)
