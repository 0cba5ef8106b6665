"""A forward's layers with the expert all-to-all overlapped across attention micro-batches (a policy's
`comm_overlap`, under expert parallelism: batchgen.dist.ep_overlap). Per MoE layer, each micro-batch's rows are
dispatched right after its attention, the experts run once on all of them, and each micro-batch's combine is
waited for only when its next attention comes, so one micro-batch's exchange runs beside another's attention.

Every rank runs the same sequence of collectives per layer: the PARTITION exchange (its head-sharded attention),
the partitioned rows' dispatch (when any rank has some), then as many micro-batch dispatches as the rank with
the most micro-batches (`ExpertParallelMoE.agree`). The partitioned rows come first in a rank's rows, as in the
runner's one-exchange layer, so every expert sees its rows in the same order."""

from __future__ import annotations

import torch


def overlapped_layers(runner, pieces: list, hidden: torch.Tensor, timer, stats) -> torch.Tensor:
    """`runner`'s layer loop (exec.runner.InstanceRunner) over device and PARTITION pieces; returns the hidden
    states after the last layer."""
    model, partition = runner.model, runner.partition
    device = [p for p in pieces if p.kind == "device"]
    if len(device) + sum(p.kind == "shard" for p in pieces) != len(pieces):
        raise ValueError("the all-to-all overlapped across micro-batches runs device-resident attention only "
                         "(policy.kv_residency=device)")
    shards = [p for p in pieces if p.kind == "shard"]
    shard_rows = slice(0, device[0].rows.start if device else hidden.shape[0])
    experts = [getattr(layer.mlp, "overlapped", None) for layer in model.layers]
    first = next((layer.mlp for layer, o in zip(model.layers, experts) if o is not None), None)
    if first is None:
        raise ValueError("the all-to-all overlapped across micro-batches needs expert-parallel MoE layers")
    m, any_shard = first.agree([len(device), int(shard_rows.stop > 0)])
    before = None  # the previous MoE layer's exchange, its combines still arriving
    empty = hidden.new_empty(0, hidden.shape[-1])
    for layer, block in enumerate(model.layers):
        start = timer.start()
        if before is not None and any_shard:
            hidden[shard_rows] = hidden[shard_rows] + before.take(0)
        timer.stop(start, "ffn")
        if partition is not None:
            partition.layer(model, layer, hidden, shards, timer)
        exchange = block.mlp.overlapped(any_shard + m) if experts[layer] is not None else None
        start = timer.start()
        if exchange is not None and any_shard:
            exchange.send(block.post_attention_layernorm(hidden[shard_rows]))
        timer.stop(start, "ffn")
        for j in range(m):
            p = device[j] if j < len(device) else None
            start = timer.start()
            if before is not None and p is not None:
                hidden[p.rows] = hidden[p.rows] + before.take(any_shard + j)
            timer.stop(start, "ffn")
            if p is not None:
                start = timer.start()
                hidden[p.rows] = model.attention_block(layer, hidden[p.rows], p.meta, p.cache.layer(layer))
                timer.stop(start, p.rank)
            if exchange is not None:
                start = timer.start()
                exchange.send(block.post_attention_layernorm(hidden[p.rows]) if p is not None else empty)
                timer.stop(start, "ffn")
        start = timer.start()
        if before is not None:
            before.finish()
        if exchange is not None:
            exchange.run()
        else:  # a dense layer: its FFN on every row at once (the previous layer's outputs are all in)
            hidden = model.ffn_block(layer, hidden)
        timer.stop(start, "ffn")
        before = exchange
        stats.gate_tokens = hidden.shape[0]
    if before is not None:
        start = timer.start()
        if any_shard:
            hidden[shard_rows] = hidden[shard_rows] + before.take(0)
        for j, p in enumerate(device):
            hidden[p.rows] = hidden[p.rows] + before.take(any_shard + j)
        before.finish()
        timer.stop(start, "ffn")
    return hidden
