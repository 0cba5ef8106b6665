"""PARTITION on real tensors: a straggler's attention split by heads over the ranks of its group."""

from __future__ import annotations

import numpy as np

from batchgen.exec.run import ExecSettings, execute
from conftest import make_job

from .test_exec_parity import hf_greedy, kv_mb_for, saved  # noqa: F401  (saved: the models, as a fixture)


def test_partitioned_stragglers_split_their_heads_and_keep_greedy_outputs(saved):  # noqa: F811 (the fixture)
    """Two stragglers outlive the rest on 4 ranks: coroutine PARTITIONs them (partition_min_context=1), each
    rank of a group attends over its own head shard (GQA) or latent replica (MLA), the partial outputs are
    summed, and the tokens stay those of transformers."""
    model, path = saved
    inputs, outputs = np.full(6, 12), np.full(6, 6)
    outputs[:2] = 40
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 4},
                   policy_overrides={"b_moe": 4, "b_attn": 4, "kv_residency": "device", "partition_min_context": 1,
                                     "partition_below": 1.0})
    out = execute(job, ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000)))
    t = out.prepared.state.table
    assert t.partitions[:2].min() >= 1  # the stragglers ran split over several ranks
    assert out.kv_moves.get("partition", 0) >= 2
    for sid in range(6):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid


def test_split_then_join_keeps_the_kv_and_the_pools_count_shard_pages():
    """A split sends the second shard from the lead's pages straight to the other GPU's pool (its device pages
    given up, its host copy kept); shards take 1/degree of the pages on each GPU (GQA) and the caches' page counts
    include them; the lead brings its host copy up to date from the shards after a new token; joining gives back
    the old KV plus the new rows in the lead's pages. Only the parts that cross GPUs are counted, where they land."""
    import torch
    from batchgen.exec.kv_cache import PagedKVCache
    from batchgen.exec.shards import gather_to_host, reshard, shards_of

    caches = [PagedKVCache(2, 4, 8, page_size=4, num_pages=16) for _ in range(2)]
    lead = caches[0]
    meta = lead.prepare([7], [10], [0])
    for l in range(2):
        k, v = lead.layer(l)
        k.view(-1, 4, 8)[meta.slot_mapping] = torch.randn(10, 4, 8)
        v.view(-1, 4, 8)[meta.slot_mapping] = torch.randn(10, 4, 8)
    lead.sync_to_host([7])  # a host copy of the 10 tokens
    before = lead.migration_rows(7)[0].clone()  # [layers, planes, tokens, heads, dim]
    half = 2 * 2 * 4 * 8 * 4 // 2  # bytes per token of two of the four heads
    moved = []
    reshard(caches, 7, (0,), (0, 1), lambda part, nbytes: moved.append((part.src, part.dst, nbytes)))
    assert moved == [(0, 1, 10 * half)]
    assert [c.used_pages() for c in caches] == [2, 2]  # 10 tokens, 8 per shard page: 2 pages each
    assert not lead.on_device(7) and lead.synced_tokens(7) == 10
    for c in caches:
        c.check()
    stores = [shards_of(c) for c in caches]
    new = [s.prepare([7], [1], [10]) for s in stores]  # one decode token: each shard writes its heads
    row = torch.randn(2, 2, 4, 8)  # [layers, planes, heads, dim]
    for j, (s, m) in enumerate(zip(stores, new)):
        for l in range(2):
            k, v = s.layer(l, 2)
            k.view(-1, 2, 8)[m.slot_mapping] = row[l, 0, j * 2:(j + 1) * 2][None]
            v.view(-1, 2, 8)[m.slot_mapping] = row[l, 1, j * 2:(j + 1) * 2][None]
    moved.clear()
    assert gather_to_host(caches, 7, (0, 1), lambda part, nbytes: moved.append((part.src, part.dst, nbytes))) \
        == 2 * half
    assert moved == [(1, 0, half)] and lead.synced_tokens(7) == 11
    moved.clear()
    reshard(caches, 7, (0, 1), (0,), lambda part, nbytes: moved.append((part.src, part.dst, nbytes)))
    assert moved == [(1, 0, 11 * half)]
    after = lead.migration_rows(7)[0]
    assert torch.equal(after[:, :, :10], before) and torch.equal(after[:, :, 10], row)
    assert torch.equal(lead.export(7).tokens().permute(1, 2, 0, 3, 4), after)  # the host copy holds the same
    assert [c.used_pages() for c in caches] == [3, 0]
    for c in caches:
        c.check()
