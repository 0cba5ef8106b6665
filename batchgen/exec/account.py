"""The KV bytes an executor copied, per kind of op, per GPU and tier: what a test compares with what the state priced.

Tiers are those of `KVOps.moves` (batchgen.core.ops): host -> device (h2d), device -> host (d2h), device -> device
within a node (peer) and across nodes (network), within one device (local: a shared prefix's tail copied below a
page, kind `share`); and one it has no price for: `host`, a host copy copied from
one host pool to another of the same node (backend=dist, whose processes each keep their own pool). Bytes are
counted from the tensors copied (element count x element size), charged as the state charges them: a migration
to the GPU that receives it (every copy it causes there included), a checkpoint or a restore to the GPU whose
device it leaves or reaches, each part of PARTITION's resharding to the GPU that receives it (batchgen.core.reshard).

Kinds: the KV ops (yield, offload, migrate, restore); `reshard`, the parts of a partitioned sequence's KV sent
device to device when its group changes, and `reshard_host_copy`, its host copy following a new lead; `join`,
the shards a yielded partitioned sequence's lead gathers before it writes them down (as `yield`);
`migrate_host_copy`, the host copy a migration's destination keeps, made again from the arrival when the source's
was in another host pool (another node; under backend=dist, another process): a copy the state prices only
across nodes; and two that runs cause: `sync` (host_sync's checkpoints of new tokens, with the shards a
partitioned sequence's lead gathers for them) and `to_host` (prefills bound for host, written down after their
forward).

Beside the bytes, how many sequences' KV each copied (`copies_of`).
"""

from __future__ import annotations

import numpy as np

TIERS = ("h2d", "d2h", "peer", "network", "local", "host")


class KVAccount:
    def __init__(self, num_gpus: int):
        self.num_gpus = num_gpus
        self._bytes: dict[str, np.ndarray] = {}  # kind -> [bytes, copies] x [tier, GPU]

    def add(self, kind: str, tier: str, gpu: int, nbytes: int, copies: int = 1) -> None:
        """`copies` sequences' KV, `nbytes` in all, copied for an op of `kind` over `tier`, charged to `gpu`."""
        if nbytes:
            rows = self._bytes.get(kind)
            if rows is None:
                rows = self._bytes[kind] = np.zeros((2, len(TIERS), self.num_gpus), np.int64)
            rows[:, TIERS.index(tier), gpu] += (int(nbytes), int(copies))

    def kinds(self) -> list[str]:
        return list(self._bytes)

    def of(self, kind: str) -> dict[str, np.ndarray]:
        """{tier: bytes per GPU} of one kind of op (zeros for a kind that moved nothing)."""
        return dict(zip(TIERS, self._rows(kind)[0]))

    def copies_of(self, kind: str) -> dict[str, np.ndarray]:
        """{tier: sequences copied per GPU} of one kind of op."""
        return dict(zip(TIERS, self._rows(kind)[1]))

    def _rows(self, kind: str) -> np.ndarray:
        return self._bytes.get(kind, np.zeros((2, len(TIERS), self.num_gpus), np.int64))

    def merge(self, kind: str, tier: str, nbytes: np.ndarray, copies: np.ndarray) -> None:
        """Add per-GPU bytes and copies (another process's account, folded into this one)."""
        for g, (b, c) in enumerate(zip(np.asarray(nbytes).tolist(), np.asarray(copies).tolist())):
            self.add(kind, tier, g, b, c)

    def copy(self) -> "KVAccount":
        out = KVAccount(self.num_gpus)
        out._bytes = {k: v.copy() for k, v in self._bytes.items()}
        return out

    def minus(self, earlier: "KVAccount") -> "KVAccount":
        """What was added since `earlier` (a copy of this account)."""
        out = KVAccount(self.num_gpus)
        for kind, rows in self._bytes.items():
            diff = rows - earlier._bytes.get(kind, 0)
            if diff.any():
                out._bytes[kind] = diff
        return out

    def as_dict(self) -> dict[str, dict[str, list[int]]]:
        """{kind: {tier: bytes per GPU}} of the tiers each kind used (plain lists, for an output file)."""
        return {kind: {t: row.tolist() for t, row in zip(TIERS, rows[0]) if row.any()}
                for kind, rows in self._bytes.items()}
