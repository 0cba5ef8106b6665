"""A shared prefix copied from a sibling GPU instead of recomputed (`fetch`; coroutine's, where a backend performs it).

Why. A group whose members run on several GPUs of an instance would compute its prefix once per GPU (a system prompt
before every request runs on all of them). Its KV on one GPU is the same on another: a prompt that starts on a GPU
without its group's prefix, while another GPU of its instance holds it, has it copied there (NVLink within a node,
the network across nodes) and then takes it as a prefix written there. The copy is the prefix's whole pages and its
tail, kept as a prefix no one holds yet (`GroupPrefix`, holders 0); the source stays pinned until the instance's
next run has ended. Its bytes ride on a `share` op with a source GPU, priced by tier and performed by the executor;
one the prefix does not fit (its pages, on the GPU) is not copied and the prompt writes it again. A host copy resumed
onto a GPU without its prefix has it copied there the same way, and restores only the rest. Nested levels
(batchgen.workload.prefix_tree) are copied outermost first, each past the level it extends where that one is there.
"""

from __future__ import annotations

import numpy as np

from batchgen.core.prefix_pages import GroupPrefix
from batchgen.core.prefix_prefill import PrefixPrefill
from batchgen.core.sequences import PENDING


class PrefixFetch(PrefixPrefill):
    """`PrefixPrefill` with copies between GPUs (mixed into `ClusterState`)."""

    fetch = False  # set by `share_prefixes(..., fetch=True)`

    def fetch_source(self, gpus: np.ndarray, group: int) -> tuple[int, GroupPrefix] | None:
        """The prefix of `group` a GPU among `gpus` would copy: the longest there (the first GPU on a tie)."""
        best = None
        for g in gpus.tolist():
            entry = self.prefixes.get((g, group))
            if entry is not None and (best is None or entry.tokens > best[1].tokens):
                best = (g, entry)
        return best

    def fetch_prefixes(self, instance: int, ids: np.ndarray, gpus: np.ndarray, resuming: bool = False) -> None:
        """Prompts about to start on `gpus` (or, `resuming`, host copies about to be restored there): each level of
        a sequence's prefix its GPU lacks, outermost first, that another GPU of the instance holds and it shares
        whole, is copied there first (once per GPU and level): only its own segment where the level it extends is
        there already, else all of its tokens."""
        if not self.fetch or not self.prefixes:
            return
        mine = self._instance_gpus[instance]
        ctx = self.table.context(ids).tolist()
        pending = [True] * ids.size if resuming else (self.table.where[ids] == PENDING).tolist()
        for i, (sid, g, waits) in enumerate(zip(ids.tolist(), gpus.tolist(), pending)):
            for group, _, pages, (src, entry), parent in self._fetch_plan(sid, g, ctx[i], mine) if waits else ():
                if self.pages_used[g] + pages > self.gpu_pages[g]:
                    break  # no room for it there: the prompt writes it (and every deeper level)
                self._copy_level(instance, sid, g, group, src, entry, parent, pages)

    def _fetch_plan(self, sid: int, gpu: int, ctx: int, gpus: np.ndarray) -> list[tuple]:
        """(group, tokens, pages, (source GPU, its entry), parent) of each level of the sequence's chain `gpu`
        lacks that a GPU among `gpus` would copy there, outermost first, up to the first it cannot: each over the
        level it extends there (only its own pages), or, where the source's extends another, whole."""
        below, out = -1, []  # the deepest level of its chain on this GPU so far
        for a, tokens in self.prefix_levels(sid, ctx):
            if (gpu, a) in self.prefixes:
                below = a
                continue
            source = self.fetch_source(gpus, a)
            if source is None or tokens < source[1].tokens:
                break
            entry = source[1]
            parent = below if below >= 0 and entry.parent == below else -1
            if parent < 0 and entry.parent >= 0 and below >= 0:
                break  # its parent is another level than the one here: it would hold that one's tokens twice
            pages = entry.pages if parent >= 0 else entry.tokens // self.page_tokens + (entry.tail > 0)
            out.append((a, entry.tokens, pages, source, parent))
            below = a
        return out

    def restore_shares(self, ids: np.ndarray, gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`PrefixPages.restore_shares` where a home GPU lacking levels of a sequence's chain has them copied from
        another first (`fetch_prefixes`): the tokens each then takes there, less the pages (in tokens) the copies
        add."""
        home, tokens = super().restore_shares(ids, gpus)
        if not self.fetch or not self.prefixes:
            return home, tokens
        ctx = self.table.context(ids).tolist()
        for i in np.flatnonzero(home >= 0).tolist():
            plan = self._fetch_plan(int(ids[i]), int(gpus[home[i]]), ctx[i], gpus)
            if plan:
                tokens[i] = max(int(tokens[i]), plan[-1][1]) - self.page_tokens * sum(p[2] for p in plan)
        return home, tokens

    def _copy_level(self, instance: int, sid: int, gpu: int, group: int, src: int, entry: GroupPrefix, parent: int,
                    pages: int) -> None:
        """Copy `group`'s level from the source GPU's entry onto `gpu` (`pages` there), over the level `parent`."""
        self._keep_unheld(gpu, group, GroupPrefix(entry.tokens, pages, 0, tail=entry.tail, parent=parent))
        entry.pins += 1  # the copy's source stays until the run has ended (`sweep_prefixes` unpins it)
        self._read_in_forward[instance].append([entry])
        self._log_share(instance, np.array([sid], np.int64), np.array([gpu], np.int64), np.array([group]),
                        np.array([entry.tokens], np.int64), np.ones(1, bool), np.array([entry.tail], np.int64),
                        src=src, parents=np.array([parent]))
        self.prefix_fetched += entry.tokens + entry.tail - (self.prefixes[(gpu, parent)].tokens if parent >= 0 else 0)
