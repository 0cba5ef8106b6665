"""Step 5 of a recovery (batchgen.dist.recovery): the survivors' caches are the truth. The loss was caught
mid-step, so a planned yield, restore or migration may or may not have happened; each survivor reports what its
cache holds, rank 0 decides which KV each keeps, and every survivor drops the rest."""

from __future__ import annotations

import numpy as np

from batchgen.dist.worker import Command


def inventory(cache) -> dict[int, tuple[bool, int, int, int, int]]:
    """What a survivor's cache holds: sequence id -> (on device, device tokens, host-copy tokens, tokens of a
    host-resident step under way, device pages held)."""
    return {sid: (cache.on_device(sid), cache.device_tokens(sid), cache.synced_tokens(sid),
                  cache.pending_tokens(sid), len(cache.pages(sid))) for sid in cache.seq_ids()}


def keep_plan(table, generated: list[list[int]], done: np.ndarray, inventories: list[dict],
              split: np.ndarray | None = None) -> list[dict]:
    """Rank 0: which KV each survivor keeps, per rank {sequence id: (on device, tokens kept, pages held, has a
    host copy)}.

    The caches, not the state, are the truth here: the loss was caught mid-step, so a planned yield, restore or
    migration may or may not have happened. A sequence is kept where one survivor holds exactly the KV its tokens
    imply: prompt + generated - 1 tokens (the last generated token is fed by the next forward), on device or as
    a host copy. The interrupted forward's token was never recorded: its slot (one token more on device, or a
    host-resident step's pending token) is dropped and written again, with the same token, by the next forward.
    Everything else (no tokens yet, part-written prompts, a copy in a lost process, a PARTITIONed sequence:
    `split` > 0 in the ledger, its head shards spread over processes) is recomputed."""
    plan: list[dict] = [{} for _ in inventories]
    seen: set[int] = set()
    for rank, inv in enumerate(inventories):
        for sid, (on_device, device_len, synced, pending, pages) in inv.items():
            if (sid in seen or done[sid] or not generated[sid] or table.prefilled[sid] or table.tp[sid] > 1
                    or (split is not None and split[sid])):
                continue
            need = int(table.input_len[sid]) + len(generated[sid]) - 1
            if on_device and device_len in (need, need + 1) and synced <= need:
                plan[rank][sid] = (True, need, pages, synced > 0)
            elif not on_device and synced == need:
                plan[rank][sid] = (False, need, 0, True)
            else:
                continue
            seen.add(sid)
    return plan


def apply_keep(cache, keep: dict) -> None:
    """A survivor: drop every sequence not kept; a kept one forgets the interrupted forward's slot (device
    tokens past the kept ones, or a host-resident step's pending tokens: an extra page held is harmless, the
    pools only ever grow a sequence's pages). Shared prefixes go: the next generation's state starts with none,
    and counts a kept holder's pages, the prefix's included, as its own (`inventory`)."""
    cache.release([sid for sid in cache.seq_ids() if sid not in keep])
    cache.drop_prefixes()
    shards = getattr(cache, "shards", None)  # PARTITION's head shards (exec/shards.py): never kept
    if shards is not None:
        shards.release(shards.seq_ids())
    for sid, (_, tokens, _, _) in keep.items():
        cache.truncate(sid, tokens)


def settle_caches(worker, decide=None) -> list[dict]:
    """Every survivor, right after regrouping with its old cache: report it, rank 0 decides (`decide(inventories)
    -> keep_plan`) and broadcasts, each applies its part. Over every process of the new group (`worker.world`:
    with several instances each instance's control channel reaches only its own)."""
    got = worker.reply(inventory(worker.cache), worker.world)
    plan = worker.receive(Command("keep", decide(got)) if worker.rank == 0 else None, worker.world).parts
    apply_keep(worker.cache, plan[worker.rank])
    return plan
