"""A shared prefix copied from a sibling GPU instead of recomputed (`fetch`; coroutine's, where a backend performs it).

Why. A group whose members run on several GPUs of an instance would compute its prefix once per GPU (a system
prompt before every request runs on all of them). Its KV on one GPU is the same on another: a prompt that starts on
a GPU without its group's prefix, while another GPU of its instance holds it, has it copied there (NVLink within a
node, the network across nodes) and then takes it as a prefix written there. The copy is the prefix's whole pages
and its tail, kept as a prefix no one holds yet (`GroupPrefix`, holders 0); the source stays pinned until the
instance's next run has ended. Its bytes ride on a `share` op with a source GPU, priced by tier and performed by
the executor; one the prefix does not fit (its pages, on the GPU) is not copied and the prompt writes it again.
A host copy resumed onto a GPU without its prefix has it copied there the same way, and restores only the rest.
"""

from __future__ import annotations

import numpy as np

from batchgen.core.prefix_pages import GroupPrefix, PrefixPages
from batchgen.core.sequences import PENDING


class PrefixFetch(PrefixPages):
    """`PrefixPages` with copies between GPUs (mixed into `ClusterState`)."""

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
        """Prompts about to start on `gpus` (or, `resuming`, host copies about to be restored there): where a GPU
        lacks a sequence's group's prefix and another GPU of the instance holds one it can take, it is copied there
        first (once per GPU and group)."""
        if not self.fetch or not self.prefixes:
            return
        mine = self._instance_gpus[instance]
        shared = self.share_tokens(ids).tolist()
        pending = [True] * ids.size if resuming else (self.table.where[ids] == PENDING).tolist()
        for sid, g, n, waits in zip(ids.tolist(), gpus.tolist(), shared, pending):
            group = int(self.prefix_group[sid])
            if not waits or n <= 0 or (g, group) in self.prefixes:
                continue
            source = self.fetch_source(mine, group)
            if source is None or n < source[1].tokens:
                continue
            src, entry = source
            if self.pages_used[g] + entry.pages > self.gpu_pages[g]:
                continue  # no room for it there: the prompt writes it
            self._keep(g, group, GroupPrefix(entry.tokens, entry.pages, 0, tail=entry.tail))
            self._gpu_holds(g, int(self.pages_used[g]) + entry.pages)
            self.unheld_pages[g] += entry.pages
            entry.pins += 1  # the copy's source stays until the run has ended (`sweep_prefixes` unpins it)
            self._read_in_forward[instance].append([entry])
            one = np.array([sid], np.int64)
            self._log_share(instance, one, np.array([g], np.int64), np.array([entry.tokens], np.int64),
                            np.ones(1, bool), np.array([entry.tail], np.int64), src=src)
            self.prefix_fetched += entry.tokens + entry.tail
