"""A small DAG of compute and transfer nodes, and its critical path by dynamic programming.

Nodes are added in topological order (a node may only depend on nodes added before it), so the longest path
is computed as they are added: dp[v] = max over predecessors u of dp[u] + cost(v), with dp[v] the time v
finishes when everything starts as early as its dependencies allow. A node may name a *resource* (a PCIe
direction, the GPU's compute stream, the host CPU): nodes on one resource run one after another in the order
they were added, which is an implicit edge from the previous node on that resource. A *sync* node starts only
when its predecessors have finished on every rank (the max over axis 0 of a (ranks x ...) grid): a collective
such as the all-to-all before the experts, where lockstep ranks wait for the slowest.

Costs are seconds: Python floats, or numpy arrays that broadcast over a grid (ranks x iterations in the
simulator), so one DAG prices a whole run at once. With floats the critical path can also be named
(`path`), which the tests and the planner's description use.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


def _max(a: Any, b: Any) -> Any:
    if isinstance(a, float) and isinstance(b, float):
        return a if a >= b else b
    return np.maximum(a, b)


class Dag:
    """Compute and transfer nodes with dependencies and resources; see the module docstring. It keeps what is
    read back: each node's name and finish, and the predecessor that decided a scalar node's start (`path`)."""

    __slots__ = ("names", "finish", "_via", "_last", "_scalar")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.finish: list[Any] = []  # dp: when each node ends on the critical path into it
        self._via: list[int | None] = []  # the predecessor that decided a scalar node's start
        self._last: dict[str, int] = {}
        self._scalar = True  # every cost a float so far: starts are plain comparisons

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, cost: Any, after: Iterable[int | None] = (), resource: str | None = None,
            sync: bool = False) -> int:
        """Add a node that starts once every node in `after` (None entries are ignored) and the previous node
        on `resource` have finished (and, if `sync`, once they have on every rank); returns its index."""
        finish = self.finish
        index = len(finish)
        scalar = self._scalar  # every finish so far a float
        if cost.__class__ is not float:
            if isinstance(cost, (int, np.integer)) and not isinstance(cost, bool):
                cost = float(cost)
            elif not isinstance(cost, float):
                scalar = False  # this node's finish is an array: starts by np.maximum from here on
        start: Any = 0.0
        via = None
        previous = self._last.get(resource) if resource is not None else None
        if previous is not None:
            after = (*after, previous)
        for p in after:
            if p is None:
                continue
            if p >= index or p < 0:
                raise ValueError(f"node {name!r} depends on node {p}, which does not exist yet: add nodes in "
                                 "topological order")
            f = finish[p]
            if scalar:
                if f >= start:
                    start, via = f, p
            else:
                start = _max(start, f)
        if sync and not scalar and isinstance(start, np.ndarray) and start.ndim:
            start = start.max(axis=0, keepdims=True)
        self._scalar = scalar
        self.names.append(name)
        finish.append(start + cost)
        self._via.append(via)
        if resource is not None:
            self._last[resource] = index
        return index

    def length(self) -> Any:
        """The critical path: the latest finish over all nodes (0 for an empty DAG)."""
        out: Any = 0.0
        for f in self.finish:
            out = _max(out, f)
        return out

    def path(self, end: int | None = None) -> list[str]:
        """Names of the nodes on the critical path into `end` (default: the node that finishes last), first
        to last. Scalar costs only."""
        if not self.names:
            return []
        if end is None:
            if not all(isinstance(f, float) for f in self.finish):
                raise ValueError("Dag.path needs scalar (float) costs")
            end = max(range(len(self.finish)), key=lambda i: self.finish[i])
        names = []
        node: int | None = end
        while node is not None:
            names.append(self.names[node])
            node = self._via[node]
        return names[::-1]
