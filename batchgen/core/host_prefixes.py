"""Host copies that share their group's prompt prefix on a node: the host side of the prefix cache.

Why. A node's host memory holds a copy of the KV of every suspended and every host-resident sequence of its GPUs.
Members of one group (thousands of requests after one system prompt, a subject's few-shot block) would each
hold the same prefix there: a 4,096-token prompt is most of each copy, and the host watermark, not the GPUs,
then bounds how many sequences a policy that runs from host memory keeps in flight.

The model, kept exact by the state's primitives:
- A node's host prefix of a group is the whole pages of its members' shared tokens (`share_tokens`, at the time
  its first copy is made), counted once in the node's `host_used`.
- A host copy made on a node (a prompt prefilled to host, a YIELD or OFFLOAD that writes a sequence down) takes its
  group's prefix there when it shares at least as many tokens: it holds them by reference (`host_held`) and only
  the rest of its KV is written (the bytes its op carries). Where the node has none, the copy creates it from its
  own first tokens, writing everything. Its own tokens are counted beside the prefix.
- A copy that goes (its sequence finishes or is evicted, a device-resident resume drops it, it moves to another
  node) lets go; the last holder's going drops the prefix.
- A copy that arrives from another node (MIGRATE, a resume over the network) arrives whole and holds none.
Only where the backend performs it (`share_prefixes(..., host=True)`: the simulator; the executors keep whole
copies).
"""

from __future__ import annotations

import numpy as np

from batchgen.core.sequences import InvariantError


class HostPrefixes:
    """Host prefixes of `ClusterState` (mixed in beside `PrefixPages`, whose `share_tokens` it uses)."""

    host_sharing = False  # set by `share_prefixes(..., host=True)`; off, none of this runs

    def _host_prefixes_init(self) -> None:
        self.host_sharing = True
        self.host_held = np.zeros(len(self.table), np.int64)  # tokens of each host copy held in its node's prefix
        self.host_prefixes: dict[tuple[int, int], list[int]] = {}  # (node, group) -> [tokens, holders]
        self.host_prefix_taken = 0  # tokens host copies took from their node's prefix instead of writing them

    def host_skips(self, ids: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """The tokens each of these new host copies (made in this order, on `nodes`) would take from its node's
        prefix instead of writing them (0: none; a creator writes all of its own)."""
        held, creates = self._host_rule(ids, nodes)
        return np.where(creates, 0, held)

    def host_plan(self, ids: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens each of these new host copies, made in this order on `nodes`, would hold in its node's prefix (0:
        none), whether it creates it): what a backend decides for the prompts it writes to host after a forward
        (`prefilled_to_host` is then given the first)."""
        return self._host_rule(ids, nodes)

    def _host_rule(self, ids: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens held by reference, creates the prefix) of each new host copy, made in this order on `nodes`."""
        held, creates = np.zeros(ids.size, np.int64), np.zeros(ids.size, bool)
        if not self.host_sharing or not ids.size:
            return held, creates
        tokens, group = self.share_tokens(ids), self.prefix_group[ids]
        made: dict[tuple[int, int], int] = {}
        for i in np.flatnonzero(tokens > 0).tolist():
            key = (int(nodes[i]), int(group[i]))
            entry = self.host_prefixes.get(key)
            there = entry[0] if entry is not None else made.get(key)
            if there is None:
                made[key] = held[i] = int(tokens[i])
                creates[i] = True
            elif tokens[i] >= there:
                held[i] = there
        return held, creates

    def _host_copies(self, ids: np.ndarray, nodes: np.ndarray, ctx: np.ndarray,
                     held: np.ndarray | None = None) -> np.ndarray:
        """New host copies of `ids` (contexts `ctx`) on `nodes`: each takes or creates its node's prefix of its
        group, and host memory grows by what it writes. `held`: what each holds as a backend decided it
        (`host_plan`): a prefix it was to take that its last holder has let go of since is created again by it.
        Returns the tokens each took instead of writing them."""
        if held is None or not self.host_sharing:
            held, creates = self._host_rule(ids, nodes)
        else:
            group, creates = self.prefix_group[ids], np.zeros(ids.size, bool)
            made: set[tuple[int, int]] = set()
            for i in np.flatnonzero(held).tolist():
                key = (int(nodes[i]), int(group[i]))
                creates[i] = key not in self.host_prefixes and key not in made
                made.add(key)
        skipped = np.where(creates, 0, held)
        self._host_add(nodes, ctx - skipped)
        if held.any():
            group = self.prefix_group[ids]
            for i in np.flatnonzero(held).tolist():
                key = (int(nodes[i]), int(group[i]))
                if creates[i]:
                    self.host_prefixes[key] = [int(held[i]), 1]
                else:
                    self.host_prefixes[key][1] += 1
            self.host_held[ids] = held
            self.host_prefix_taken += int(skipped.sum())
        return skipped

    def _host_release(self, ids: np.ndarray) -> np.ndarray:
        """The host copies of `ids` (still on their nodes) let go of their prefixes; a prefix whose last holder
        goes is dropped. Returns the tokens each copy held by reference (out of its own)."""
        if not self.host_sharing:
            return np.zeros(ids.size, np.int64)
        held = self.host_held[ids]
        holders = np.flatnonzero(held)
        if holders.size:
            node, group = self.table.host_node[ids], self.prefix_group[ids]
            for i in holders.tolist():
                key = (int(node[i]), int(group[i]))
                entry = self.host_prefixes[key]
                entry[1] -= 1
                if not entry[1]:
                    del self.host_prefixes[key]
                    self.host_used[key[0]] -= entry[0]
            self.host_held[ids] = 0
        return held

    def check_host_prefixes(self) -> np.ndarray:
        """Recount the host prefixes from their holders; returns the tokens they hold per node."""
        tokens = np.zeros(self.topo.num_nodes, np.int64)
        if not self.host_sharing:
            return tokens
        t = self.table
        holders = np.flatnonzero(self.host_held)
        if np.any(t.host_node[holders] < 0):
            raise InvariantError("a sequence holds a host prefix without a host copy")
        count: dict[tuple[int, int], int] = {}
        for sid in holders.tolist():
            key = (int(t.host_node[sid]), int(self.prefix_group[sid]))
            count[key] = count.get(key, 0) + 1
            entry = self.host_prefixes.get(key)
            if entry is None or entry[0] != self.host_held[sid]:
                raise InvariantError(f"sequence {sid} holds {self.host_held[sid]} tokens of a host prefix its node "
                                     "does not hold")
        if count != {key: entry[1] for key, entry in self.host_prefixes.items()}:
            raise InvariantError("a host prefix's holder count drifted from its holders")
        for (node, _), (n, _) in self.host_prefixes.items():
            tokens[node] += n
        return tokens
