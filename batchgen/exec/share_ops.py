"""A boundary's `share` ops on the executor's caches, each performed when the ops that need it run.

Why. The state emits a boundary's ops in the order its primitives ran; the executor performs them grouped by kind
(`ExecBackend.move_kv`). A prefix a sequence takes by a restore, or by a resume from another GPU's host copy, must
be on its GPU before that copy runs, so that the copy writes only the rest of its KV; a prefix copied from another
GPU (batchgen.core.prefix_fetch) must be there before the first sequence takes it. Everything else (prefixes
created or taken by prefills, and the tails they copy below a page) runs after every other op.
"""

from __future__ import annotations

from batchgen.core.ops import KVOps


class ShareOps:
    """One boundary's shares: `before(ids)` performs those of sequences about to be restored or resumed, `rest()`
    the others; a copy from another GPU runs just before the first share on its GPU that takes it, or last."""

    def __init__(self, ops: KVOps, caches: list, account, gpu_node) -> None:
        self.caches, self.account, self.node = caches, account, gpu_node
        self._ops = ops.shares()
        self._copies = {(g, group): (tokens, tail, src, parent)  # prefixes copied from another GPU, not yet performed
                        for _, g, group, tokens, _, tail, src, parent in self._ops if src >= 0}
        self._done: set[int] = set()  # sequences whose shares ran

    def before(self, ids: set[int], resuming: bool = False) -> None:
        """The shares of sequences about to be restored (`resuming`: resumed from another GPU's host copy): each
        takes its group's prefix on its GPU, its copy then writes only the rest."""
        for sid, g, group, tokens, creates, _, src, _ in self._ops:
            if src < 0 and sid in ids:
                self._copy_in(g, group)
                self.caches[g].share_prefix(sid, group, tokens, creates, resuming=resuming)
                self._done.add(sid)

    def rest(self) -> None:
        """Every other share, in plan order (tails below a page copied on the GPU)."""
        for sid, g, group, tokens, creates, tail, src, _ in self._ops:
            self._copy_in(g, group)
            if src < 0 and sid not in self._done:
                self.account.add("share", "local", g, self.caches[g].share_prefix(sid, group, tokens, creates, tail))

    def _copy_in(self, g: int, group: int) -> None:
        copy = self._copies.pop((g, group), None)
        if copy is not None:
            tokens, tail, src, parent = copy
            if parent >= 0:  # a nested level is copied past its outer one, which must be there first
                self._copy_in(g, parent)
            tier = "peer" if self.node[src] == self.node[g] else "network"
            self.account.add("share", tier, g, self.caches[g].fetch_prefix(group, tokens, tail, self.caches[src],
                                                                            parent))
