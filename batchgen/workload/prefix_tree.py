"""Prefix groups nested in prefix groups: the levels of a radix tree over the prompts' token ids.

Why. Real batches share at more than one depth: a system prompt before every request, then each request's n samples
sharing the whole request; a subject's few-shot block, then each question's k samples. One level of groups shares
one depth and computes the other again per group. A `PrefixTree` says, per group, which group's prefix begins its
own (`parent`) and how long its own prefix is (`length`, longer than its parent's); a sequence's `prefix_group` is
its deepest group, and its prefix is the chain of segments from the outermost group down to that one. A GPU then
holds each segment once, whatever the number of groups below it (batchgen.core.prefix_pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_PARENT = -1


@dataclass(frozen=True, eq=False)
class PrefixTree:
    """`parent[g]`: the group whose prefix begins g's (-1: none; a smaller id, so parents come first); `length[g]`:
    g's prefix in tokens, its members' `prefix_len` (a group may have no members of its own, only groups below)."""

    parent: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        parent = np.array(self.parent, dtype=np.int64, ndmin=1)
        length = np.array(self.length, dtype=np.int64, ndmin=1)
        if parent.shape != length.shape:
            raise ValueError(f"a prefix tree needs one parent and one length per group, got {parent.size} and "
                             f"{length.size}")
        ids = np.arange(parent.size)
        bad = (parent < NO_PARENT) | (parent >= ids)
        if bad.any():
            g = int(np.argmax(bad))
            raise ValueError(f"prefix tree: group {g}'s parent must be -1 or a smaller group id, got {int(parent[g])}")
        if (length < 1).any():
            g = int(np.argmax(length < 1))
            raise ValueError(f"prefix tree: group {g}'s prefix must be at least one token, got {int(length[g])}")
        nested = parent >= 0
        short = nested & (length <= np.where(nested, length[np.maximum(parent, 0)], 0))
        if short.any():
            g = int(np.argmax(short))
            raise ValueError(f"prefix tree: group {g}'s prefix ({int(length[g])} tokens) must be longer than its "
                             f"parent {int(parent[g])}'s ({int(length[parent[g]])})")
        for col in (parent, length):
            col.setflags(write=False)
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "length", length)

    @classmethod
    def flat(cls, group: np.ndarray, prefix_len: np.ndarray) -> PrefixTree:
        """The one-level tree of a workload's columns: every group on its own."""
        grouped = group >= 0
        size = int(group[grouped].max()) + 1 if grouped.any() else 0
        length = np.ones(size, np.int64)
        length[group[grouped]] = prefix_len[grouped]
        return cls(np.full(size, NO_PARENT, np.int64), length)

    def __len__(self) -> int:
        return int(self.parent.size)

    def chains(self) -> list[tuple[int, ...]]:
        """Each group's chain of groups, outermost first, ending with the group itself."""
        out: list[tuple[int, ...]] = []
        for g, p in enumerate(self.parent.tolist()):
            out.append((*out[p], g) if p >= 0 else (g,))
        return out

    def check_members(self, group: np.ndarray, prefix_len: np.ndarray) -> None:
        """Every grouped sequence's `prefix_len` is its group's length, and its group is in the tree."""
        grouped = group >= 0
        if not grouped.any():
            return
        if int(group[grouped].max()) >= len(self):
            raise ValueError(f"prefix_group {int(group[grouped].max())} is not in the prefix tree of {len(self)} "
                             "groups")
        wrong = grouped & (prefix_len != self.length[np.maximum(group, 0)])
        if wrong.any():
            i = int(np.argmax(wrong))
            raise ValueError(f"sequence {i}'s prefix_len {int(prefix_len[i])} is not its group {int(group[i])}'s "
                             f"length in the prefix tree ({int(self.length[group[i]])})")

    def used(self, group: np.ndarray) -> np.ndarray:
        """Whether each group has a member at or below it."""
        used = np.zeros(len(self), bool)
        used[group[group >= 0]] = True
        for g in range(len(self) - 1, -1, -1):  # children have larger ids: each passes its mark to its parent
            p = int(self.parent[g])
            if used[g] and p >= 0:
                used[p] = True
        return used

    def segment_tokens(self, group: np.ndarray, page_tokens: int = 1) -> int:
        """The tokens of every used group's own segment (past its parent's prefix), in whole pages of
        `page_tokens`, each once: what a cache that holds every segment once holds."""
        whole = self.length // page_tokens * page_tokens
        own = whole - np.where(self.parent >= 0, whole[np.maximum(self.parent, 0)], 0)
        return int(own[self.used(group)].sum())
