"""A FIFO of sequence ids stored as numpy chunks.

Pools hold up to millions of ids and move them in bulk (a refill takes thousands at once), so a deque of
Python ints would put a Python operation per sequence on the hot path; chunks keep it per batch.
"""

from __future__ import annotations

from collections import deque

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class IdQueue:
    """First in, first out; push and pop whole arrays."""

    __slots__ = ("_chunks", "_head", "_len")

    def __init__(self, ids: np.ndarray | None = None):
        self._chunks: deque[np.ndarray] = deque()
        self._head = 0  # offset into the first chunk
        self._len = 0
        if ids is not None:
            self.push(ids)

    def __len__(self) -> int:
        return self._len

    def push(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size:
            self._chunks.append(ids.copy())
            self._len += ids.size

    def push_front(self, ids: np.ndarray) -> None:
        """Put ids back at the head (a preempted sequence keeps its turn)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not ids.size:
            return
        if self._head:
            self._chunks[0] = self._chunks[0][self._head:]
            self._head = 0
        self._chunks.appendleft(ids.copy())
        self._len += ids.size

    def peek(self, n: int) -> np.ndarray:
        """The first n ids (fewer if the queue is shorter), without removing them.

        Pools grow by many small chunks (a prefill's per-node share, a yield's), and a refill looks at the
        same head several times per boundary: the head run that spans chunks is stored back as one chunk, so
        later peeks slice it instead of joining the pieces again (the queue's contents do not change)."""
        n = min(max(int(n), 0), self._len)
        if n == 0:
            return _EMPTY
        first = self._chunks[0]
        if first.size - self._head >= n:
            return first[self._head:self._head + n]
        parts, need = [first[self._head:]], n - (first.size - self._head)
        self._chunks.popleft()
        while need:
            chunk = self._chunks.popleft()
            if chunk.size > need:
                parts.append(chunk[:need])
                self._chunks.appendleft(chunk[need:])
                need = 0
            else:
                parts.append(chunk)
                need -= chunk.size
        head = np.concatenate(parts)
        self._chunks.appendleft(head)
        self._head = 0
        return head

    def pop(self, n: int) -> np.ndarray:
        """Remove and return the first n ids."""
        out = self.peek(n).copy()
        self._advance(out.size)
        return out

    def _advance(self, need: int) -> None:
        """Drop the first `need` ids (at most the queue's length)."""
        self._len -= need
        while need:
            chunk = self._chunks[0]
            avail = chunk.size - self._head
            if avail <= need:
                self._chunks.popleft()
                self._head = 0
                need -= avail
            else:
                self._head += need
                need = 0

    def take_head_ids(self, ids: np.ndarray) -> None:
        """Pop exactly these ids, which must be the queue's head in order (what peek returned)."""
        ids = np.asarray(ids, dtype=np.int64)
        popped = self.pop(ids.size)
        if not (popped.tolist() == ids.tolist() if ids.size <= 64 else np.array_equal(popped, ids)):
            raise ValueError("ids taken from a queue must be its head, in FIFO order")

    def take_from_head(self, ids: np.ndarray) -> None:
        """Pop these ids, in FIFO order from the queue's head; those of the head between them that are not taken
        stay at its front, in order (a policy that lets some wait a forward)."""
        ids = np.asarray(ids, dtype=np.int64)
        n = ids.size
        if n <= self._len and np.array_equal(self.peek(n), ids):  # the usual case: the head itself
            self._advance(n)
            return
        window = self.peek(2 * n)
        while not (window == ids[-1]).any() and window.size < self._len:
            window = self.peek(2 * window.size)
        at = np.flatnonzero(window == ids[-1])
        head = window[: at[0] + 1] if at.size else window
        keep = ~np.isin(head, ids)
        if not at.size or not np.array_equal(head[~keep], ids):
            raise ValueError("ids taken from a queue must be in its head, in FIFO order")
        stay = head[keep].copy()
        self._advance(head.size)
        self.push_front(stay)

    def remove(self, ids: np.ndarray) -> None:
        """Take these ids out wherever they are (rare: evicting suspended sequences); keeps the order."""
        ids = np.asarray(ids, dtype=np.int64)
        everything = self.to_array()
        keep = ~np.isin(everything, ids)
        if everything.size - keep.sum() != ids.size:
            raise ValueError("ids to remove must all be in the queue")
        self._chunks.clear()
        self._head = self._len = 0
        self.push(everything[keep])

    def to_array(self) -> np.ndarray:
        return self.peek(self._len)
