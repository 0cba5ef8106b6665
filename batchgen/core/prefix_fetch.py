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
            if not waits:
                continue
            below = -1  # the deepest level of its chain on this GPU so far
            for a, tokens in self._levels(sid, ctx[i]):
                if (g, a) in self.prefixes:
                    below = a
                    continue
                source = self.fetch_source(mine, a)
                if source is None or tokens < source[1].tokens or not self._copy_level(instance, sid, g, a, source,
                                                                                      below):
                    break  # not copied: the prompt writes it (and every deeper level)
                below = a

    def _copy_level(self, instance: int, sid: int, gpu: int, group: int, source: tuple[int, GroupPrefix],
                    below: int) -> bool:
        """Copy `group`'s level from the source GPU's entry onto `gpu`, over the level `below` there where the
        source's extends the same one; False, having done nothing, where its pages do not fit."""
        src, entry = source
        parent = below if below >= 0 and entry.parent == below else -1
        pages = entry.pages if parent >= 0 else entry.tokens // self.page_tokens + (entry.tail > 0)
        if parent < 0 and entry.parent >= 0 and below >= 0:
            return False  # its parent is another level than the one here: it would hold that one's tokens twice
        if self.pages_used[gpu] + pages > self.gpu_pages[gpu]:
            return False  # no room for it there: the prompt writes it
        if parent >= 0:
            self._hold(gpu, parent)
        self._keep(gpu, group, GroupPrefix(entry.tokens, pages, 0, tail=entry.tail, parent=parent))
        self._gpu_holds(gpu, int(self.pages_used[gpu]) + pages)
        self.unheld_pages[gpu] += pages
        entry.pins += 1  # the copy's source stays until the run has ended (`sweep_prefixes` unpins it)
        self._read_in_forward[instance].append([entry])
        self._log_share(instance, np.array([sid], np.int64), np.array([gpu], np.int64), np.array([group]),
                        np.array([entry.tokens], np.int64), np.ones(1, bool), np.array([entry.tail], np.int64),
                        src=src, parents=np.array([parent]))
        self.prefix_fetched += entry.tokens + entry.tail - (self.prefixes[(gpu, parent)].tokens if parent >= 0 else 0)
        return True
