"""The KV ops the state's primitives emit as they change the state, collected per instance until its next boundary.

Why. A move is described once: where the primitive that makes it knows its source, destination, tiers and bytes.
The simulator prices the ops (`KVOps.moves`), the executors perform them (`KVOps.for_gpu`, `move_kv`), and no one
derives them again by comparing a state before and after. An instance's log takes the ops of its decisions'
primitives and of its runs' finishes (freed at its next boundary) and is emptied into one `KVOps` per boundary
(`take`), in the execution order `KVOps` defines: kind by kind, each kind's ops in the order the primitives emitted
them. That is the order the executors need: the state's MIGRATEs in the order it carried them out (each arrival
fits its destination then), before resumes on another GPU (which only arrive); a partitioned sequence's group
moved to its new lead before its degree changes there.
"""

from __future__ import annotations

import numpy as np

from batchgen.core.ops import KVOps

# the columns of each kind's rows, as KVOps names them (`<kind>_<column>`); "bytes": the KV bytes the op moves
COLUMNS = {
    "unshare": ("group", "gpu"),
    "join": ("ids", "lead", "degree", "to_host", "bytes"),
    "free": ("ids", "gpu"),
    "evict": ("ids", "gpu"),
    "yield": ("ids", "gpu", "bytes"),
    "offload": ("ids", "gpu", "bytes"),
    "migrate": ("ids", "src", "dst", "cross", "from_device", "to_device", "host_copy", "bytes"),
    "restore": ("ids", "gpu", "bytes"),
    "reshard": ("ids", "lead", "degree", "to_lead", "to_degree", "host_copy", "bytes"),
    "share": ("ids", "gpu", "group", "tokens", "creates", "tail", "bytes", "src", "parent"),
    "untail": ("group", "gpu"),
}
_UNPRICED = ("free", "evict", "unshare", "untail")  # kinds that never move a byte (every other kind, "resume" too, may)


class OpLog:
    """One instance's emitted ops since its last boundary: per kind, a list of row blocks (one per primitive call)."""

    __slots__ = ("rows", "resumes", "_added", "_priced")

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple]] = {kind: [] for kind in COLUMNS}
        self.resumes: list[tuple] = []  # migrations of suspended sequences resumed on another GPU (after MIGRATEs)
        self._added = self._priced = False  # anything logged since the last clear; anything that may move a byte

    def add(self, kind: str, *columns) -> None:
        if columns[0].size:
            (self.resumes if kind == "resume" else self.rows[kind]).append(columns)
            self._added = True
            self._priced = self._priced or kind not in _UNPRICED

    def moves_anything(self) -> bool:
        """Whether an op that may move a byte was emitted (frees and evictions move none; a share may copy a tail)."""
        return self._priced

    def empty(self) -> bool:
        return not self._added

    def take(self, gpus: np.ndarray, gpu_node: np.ndarray, by_heads: bool) -> KVOps:
        """The ops so far as one `KVOps` of the instance's GPUs (the log is emptied)."""
        fields = {}
        for kind, names in COLUMNS.items():
            blocks = self.rows[kind] + self.resumes if kind == "migrate" else self.rows[kind]
            if not blocks:
                continue
            for name, col in zip(names, _joined(blocks, len(names))):
                fields[f"{kind}_{name}"] = col
        self.clear()
        return KVOps(gpus, gpu_node=gpu_node, by_heads=by_heads, **fields)

    def clear(self) -> None:
        if self._added:
            for blocks in self.rows.values():
                blocks.clear()
            self.resumes.clear()
            self._added = self._priced = False


def _joined(blocks: list[tuple], n: int) -> list[np.ndarray]:
    if len(blocks) == 1:
        return [np.asarray(c) for c in blocks[0]]
    return [np.concatenate([b[i] for b in blocks]) for i in range(n)]
