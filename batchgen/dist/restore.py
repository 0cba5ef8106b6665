"""Step 7 of recovery (batchgen.dist.recovery): restore or recompute the lost ranks' sequences, whichever the
job's latency model prices cheaper, reading their host copies from the dead ranks' shared files."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.dist.shared_host import PublishedIndex, SharedHostFiles, index_path, remove_rank
from batchgen.pricing.costs import prefill_load
from batchgen.pricing.price import price


@dataclass(frozen=True)
class RestoreChoice:
    """What the latency model says one lost sequence costs each way (seconds)."""

    tokens: int          # KV tokens of its host copy (prompt + generated - 1)
    restore_s: float     # its KV over the host link: kv_restore of those tokens, every layer
    recompute_s: float   # a prefill of prompt + generated tokens (one more than the copy), one forward on one rank

    @property
    def restore(self) -> bool:
        return self.restore_s < self.recompute_s


def choose(latency, tokens: int) -> RestoreChoice:
    """Restore (host link) or recompute (prefill) a sequence whose host copy holds `tokens` tokens, priced by
    the job's latency model as the simulator prices a host restore and a one-sequence prefill forward."""
    n_dense, n_moe = latency.layer_counts()
    restore_s = float(latency.kv_restore(tokens)) * (n_dense + n_moe)
    none = np.empty(0, np.int64)
    load = prefill_load(np.zeros(1, np.int64), np.array([tokens + 1], np.int64), none, none, 1, 1)
    recompute_s = float(price(latency, load).iteration_s.sum())
    return RestoreChoice(int(tokens), restore_s, recompute_s)


def restore_lost(cache, keep: list[dict], indexes: list, table, generated: list[list[int]], done: np.ndarray,
                 latency, host_room: int, split: np.ndarray | None = None) -> tuple[int, int]:
    """Rank 0 after `settle_caches`: adopt into its own `cache` the lost sequences whose published host copy
    (`indexes`: the lost ranks' `shared_host.PublishedIndex`, readable here) holds exactly prompt + generated - 1
    tokens and is cheaper to restore than to recompute (`choose`), while the node's host room (`host_room` KV
    tokens: a restored copy counts prompt + generated, as the state does) lasts. Each goes into `keep[0]` as a
    host copy (suspended on rank 0). The same filters as `keep_plan`. Returns (restored, restorable)."""
    kept = set().union(*(k.keys() for k in keep))
    restored = restorable = 0
    for index in indexes:
        for sid, (synced, _) in sorted(index.seqs.items()):
            if (sid in kept or done[sid] or not generated[sid] or table.prefilled[sid] or table.tp[sid] > 1
                    or (split is not None and split[sid])):
                continue
            need = int(table.input_len[sid]) + len(generated[sid]) - 1
            if synced != need:
                continue
            restorable += 1
            if need + 1 > host_room or not choose(latency, need).restore:
                continue
            cache.import_(sid, index.read(sid))
            keep[0][sid] = (False, need, 0, True)
            kept.add(sid)
            host_room -= need + 1
            restored += 1
    return restored, restorable


def restore_from_files(files: SharedHostFiles, lost: list[int], readable: list[int], cache, keep: list[dict],
                       prepared, table, generated, done, split) -> tuple[int, int]:
    """Rank 0: the published host copies of the lost (launch) ranks in `readable` (known dead, or released
    alive and done writing), restored into its `cache` where cheaper than a recompute (`restore_lost`),
    within its node's host room left by the kept copies; then every lost rank's files go. Returns (restored,
    restorable)."""
    indexes = [i for i in (PublishedIndex.load(index_path(files.run_id, r, files.root)) for r in lost
                           if r in readable) if i is not None and i.readable()]
    state = prepared.state
    node = state.topo.gpu_node
    kept_copies = sum(int(table.input_len[s]) + len(generated[s]) for r, mine in enumerate(keep)
                      for s, v in mine.items() if v[3] and node[r] == node[0])
    room = int(state.host_kv_tokens[node[0]]) - kept_copies
    try:
        return restore_lost(cache, keep, indexes, table, generated, done, prepared.latency, room, split)
    finally:
        for r in lost:
            remove_rank(files.run_id, r, files.root)
