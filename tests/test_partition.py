"""PARTITION as a real split: each rank of the group holds its head shard of the KV (or, for MLA, a replica
of the latent), resharding is charged as bytes over the GPUs' links, and going back gathers the shards.

Resharding is priced as the executors perform it (batchgen.core.reshard): device to device, each part charged to
the GPU that receives it (the convention of migrations), peer within a node and network across; a GPU that already
holds part of its new shard keeps it (nothing moves for it)."""

import numpy as np
import pytest

from batchgen.job import prepare
from batchgen.sim.run import simulate
from conftest import make_job, priced


def running_state(model, n=2, context=1000):
    job = make_job("coroutine", model=model, n=n, inputs=np.full(n, context), outputs=np.full(n, 100))
    state = prepare(job).state
    ids = np.arange(n)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, np.arange(n), lookahead_tokens=1)
    return state, ids


def test_gqa_partition_splits_pages_over_the_group_and_charges_the_shards():
    state, ids = running_state("qwen3_30b_a3b")
    P = state.page_tokens
    full = -(-1001 // P)
    assert state.table.pages[0] == full and state.pages_used[0] == full
    state.partition(0, ids[:1], np.array([4]))
    moves = priced(state)
    state.check()
    shard = -(-1000 // (4 * P))  # a head shard packs four times the tokens into a page
    assert state.table.pages[0] == shard
    assert np.array_equal(state.pages_used[:5], [shard, shard + full, shard, shard, 0])  # rank 1 also runs seq 1
    kv = 1000 * state.kv_bytes_per_token  # the KV of every token but the newest (the next forward writes it)
    # the lead keeps shard 0; GPUs 1-3 each receive theirs from the lead's pages (peer: one node)
    assert moves.peer.tolist()[:5] == [0, kv / 4, kv / 4, kv / 4, 0] and not moves.network.any()
    state.partition(0, ids[:1], np.array([1]))
    back = priced(state)
    state.check()
    # joined: the lead receives the three other shards
    assert state.table.pages[0] == -(-1000 // P) and back.peer.tolist()[:5] == [kv * 3 / 4, 0, 0, 0, 0]
    assert state.table.partitions[0] == 2


def test_mla_partition_replicates_the_latent_on_every_rank():
    state, ids = running_state("deepseek_v3")
    assert not state.kv_split_by_heads  # prepare knows MLA's latent cannot be split by heads
    full = int(state.table.pages[0])
    state.partition(0, ids[:1], np.array([2]))
    moves = priced(state)
    state.check()
    assert state.table.pages[0] >= full - 1 and state.pages_used[0] == state.table.pages[0]
    kv = 1000 * state.kv_bytes_per_token
    assert moves.peer.tolist()[:3] == [0, kv, 0]  # one whole replica, received by GPU 1
    state.partition(0, ids[:1], np.array([4]))
    grow = priced(state)
    assert grow.peer.tolist()[:5] == [0, 0, kv, kv, 0]  # GPU 1 keeps its replica: only the new ranks receive one
    state.partition(0, ids[:1], np.array([1]))
    back = priced(state)
    state.check()
    assert not back.peer.any() and not back.network.any()  # the lead's replica is whole: a join moves nothing


def test_another_degree_moves_only_the_heads_that_change_gpu():
    """2 -> 4 over the same lead: GPU 1 had heads [H/2, H) and needs [H/4, H/2) (from the lead), GPUs 2 and 3
    get a quarter each (from GPU 1); 4 -> 2 back: the lead gets [H/4, H/2) from GPU 1, GPU 1 [H/2, H) from 2, 3."""
    state, ids = running_state("qwen3_30b_a3b", n=1)
    kv = 1000 * state.kv_bytes_per_token
    state.partition(0, ids, np.array([2]))
    priced(state)  # the split to 2
    state.partition(0, ids, np.array([4]))
    grow = priced(state)
    assert grow.peer.tolist()[:5] == [0, kv / 4, kv / 4, kv / 4, 0]
    state.partition(0, ids, np.array([2]))
    back = priced(state)
    state.check()
    assert back.peer.tolist()[:5] == [kv / 4, kv / 2, 0, 0, 0]


def test_a_group_across_nodes_pays_the_network_and_a_moved_group_reshards_to_its_new_lead():
    """GPUs 0, 1 on node 0 and 2, 3 on node 1: a group led by GPU 1 over 2 GPUs sends its second shard across
    nodes; MIGRATE of the partitioned sequence to GPU 2 moves the group (GPU 2 holds shard 1 and needs shard 0:
    it comes from GPU 1, across nodes; GPU 3 needs shard 1 from GPU 2, within node 1); its host copy follows the
    lead to node 1 over the network."""
    job = make_job("coroutine", model="qwen3_30b_a3b", n=1, inputs=np.full(1, 1000), outputs=np.full(1, 100),
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4})
    state = prepare(job).state
    ids = np.arange(1)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, np.array([1]), lookahead_tokens=1)
    kv = 1000 * state.kv_bytes_per_token
    state.partition(0, ids, np.array([2]))
    split = priced(state)
    assert split.network.tolist() == [0, 0, kv / 2, 0] and not split.peer.any()
    state._host_add(np.array([0]), state.table.context(ids))  # give it a host copy on node 0
    state.table.host_node[ids] = 0
    state.move_running(0, ids, np.array([2]))
    move = priced(state)
    state.check()
    assert move.network.tolist() == [0, 0, kv / 2 + kv, 0] and move.peer.tolist() == [0, 0, 0, kv / 2]
    assert not move.d2h.any() and state.table.host_node[0] == 1


def test_yielding_a_partitioned_sequence_gathers_its_shards_only_without_a_host_copy():
    """Without a host copy its lead gathers the other shards (peer) and writes the whole KV down (d2h); with one
    (kept up to date by host_sync) nothing moves."""
    for host_copy in (False, True):
        state, ids = running_state("qwen3_30b_a3b", n=1)
        if host_copy:
            state._host_add(np.array([0]), state.table.context(ids))
            state.table.host_node[ids] = 0
        state.partition(0, ids, np.array([4]))
        priced(state)  # the split
        state.yield_(0, ids)
        moves = priced(state)
        state.check()
        kv = 1000 * state.kv_bytes_per_token
        assert moves.peer.tolist()[:2] == ([0, 0] if host_copy else [kv * 3 / 4, 0])
        assert moves.d2h.tolist()[:2] == ([0, 0] if host_copy else [kv, 0])


def test_finishing_a_partitioned_sequence_frees_every_shard():
    state, ids = running_state("qwen3_30b_a3b", n=1)
    state.partition(0, ids, np.array([8]))
    assert np.all(state.pages_used > 0)
    state.table.decoded[ids] = state.table.output_len[ids]
    state.finish(0, ids, np.array([1.0]))
    state.check()
    assert np.all(state.pages_used == 0)


def long_stragglers(partition: bool, **knobs):
    """Two sequences past the partition threshold outlive thirty short ones on 8 GPUs."""
    inputs, outputs = np.full(32, 2000), np.full(32, 100)
    inputs[:2], outputs[:2] = 30000, 6000
    return simulate(make_job("coroutine", model="qwen3_30b_a3b", cluster="h100_8", n=32, inputs=inputs,
                             outputs=outputs, policy_overrides={"partition": partition, **knobs}))


def test_partitioning_long_stragglers_pays_its_collectives_and_still_wins():
    on, off = long_stragglers(True), long_stragglers(False)
    t_on, t_off = on.prepared.state.table, off.prepared.state.table
    assert t_on.partitions[:2].min() >= 1 and t_off.partitions.sum() == 0
    assert t_on.finish_time.max() < t_off.finish_time.max()
    # the join of the head shards is priced: the partitioned tail spends more of its time communicating
    comm_on = sum(r.rank_comm.sum() for r in on.records)
    comm_off = sum(r.rank_comm.sum() for r in off.records)
    assert comm_on > comm_off


def test_tp_attention_groups_do_not_partition_their_stragglers():
    """Under TP attention a rank is a group that already splits every sequence's heads: the same stragglers
    that partition above are only rebalanced, and every sequence still finishes."""
    out = long_stragglers(True, attention_tp=2)
    assert out.prepared.state.all_finished() and out.prepared.state.topo.num_gpus == 4
    assert out.prepared.state.table.partitions.sum() == 0


def test_partition_join_is_an_all_reduce_per_layer_over_the_group():
    from batchgen.pricing.costs import partition_join
    lat = prepare(make_job("coroutine", model="qwen3_30b_a3b")).latency
    rank, alive = np.array([0, 5]), np.array([3, 1])
    assert partition_join(lat, rank, alive, np.array([1, 1]), 8, 3) == 0.0
    join = partition_join(lat, rank, alive, np.array([4, 1]), 8, 3)
    one_row = lat.all_reduce(lat.model.hidden_size * lat.model.act_bytes, 4)
    assert np.allclose(join[:4], one_row) and np.all(join[4:] == 0)  # ranks 0-3 hold seq 0's shards


def test_partition_degree_divides_the_heads():
    from batchgen.specs import load_model
    assert load_model("qwen3_30b_a3b").partition_degrees(8) == (1, 2, 4)  # 4 KV heads
    assert 8 in load_model("deepseek_r1").partition_degrees(8)  # MLA: 128 query heads, latent replicated


def test_a_partitioned_sequence_attends_with_a_head_shard_of_the_weights_on_each_rank():
    """A shard projects and attends for 1/degree of the heads (exec.models.tensor_parallel), so each rank of
    the group reads that share of the head-indexed weights: at one query the shard's attention is cheaper than
    the whole sequence's on one rank, and it is what the shard's shapes price, on every rank of the group."""
    from batchgen.pricing.costs import decode_load
    from batchgen.pricing.price import price

    for model in ("qwen3_30b_a3b", "deepseek_r1"):
        lat = prepare(make_job("coroutine", model=model)).latency
        shard = lat.head_shard(2)
        assert shard.model.num_heads == lat.model.num_heads // 2
        assert lat.head_shard(2) is shard  # built once per degree
        m = lat.model
        whole_params = sum(k * n for k, n in lat._attention_shapes)
        shard_params = sum(k * n for k, n in shard._attention_shapes)
        shared = ((m.hidden_size * m.q_lora_rank + m.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim))
                  if m.attention == "mla" else 0)  # MLA's low-rank down-projections serve every head
        assert shard_params == pytest.approx(shared + (whole_params - shared) / 2)
        ctx, K, R = 40000, 4, 8
        args = (np.array([0]), np.array([ctx]), np.array([K]))
        rest = (R, K, 0, np.zeros(R), np.zeros(R))
        split = decode_load(*args, np.array([2]), *rest)
        whole = decode_load(*args, np.array([1]), *rest)
        assert split.attn_tokens.sum() == 0 and len(split.shards) == 1
        s = split.shards[0]
        assert s.degree == 2 and np.array_equal(s.tokens[:, 0], [1, 1, 0, 0, 0, 0, 0, 0])
        assert np.array_equal(s.context[0], ctx + np.arange(K)) and np.array_equal(s.launches, s.tokens)
        n_layers = sum(lat.layer_counts())
        expect = shard.attention_decode(1.0, ctx + np.arange(K), 1.0, ctx + np.arange(K))
        assert price(lat, split).modules["attention"] == pytest.approx(n_layers * float(np.sum(expect)))
        assert price(lat, split).modules["attention"] < price(lat, whole).modules["attention"]


def test_a_measured_latency_model_scales_its_attention_by_the_rooflines_shard_share():
    from batchgen.latency.tp_attention import partition_attention_decode

    roof = prepare(make_job("coroutine", model="qwen3_30b_a3b")).latency

    class Measured:  # what a TablePredictor looks like to the shard pricing: its own prices, a roofline behind
        fallback = roof

        def attention_decode(self, tokens, context_sum, micro_batches=1, max_context=None):
            return 3.0 * np.asarray(roof.attention_decode(tokens, context_sum, micro_batches, max_context))

    got = partition_attention_decode(Measured(), 4, 2.0, 9000.0, 1.0, 5000.0)
    assert got == pytest.approx(3.0 * roof.head_shard(4).attention_decode(2.0, 9000.0, 1.0, 5000.0))
    assert partition_attention_decode(roof, 4, 0.0, 0.0, 0.0) == 0.0


def test_a_host_resident_sequence_cannot_be_priced_partitioned():
    from batchgen.pricing.costs import decode_grid

    with pytest.raises(ValueError, match="host-resident"):
        decode_grid(np.array([0, 1]), np.array([100, 100]), np.array([2, 2]), np.array([2, 1]),
                    np.array([True, False]), 4, 2, 0, np.zeros(4), np.zeros(4))


def test_the_state_refuses_to_partition_a_host_resident_sequence():
    """A host-resident sequence has no device KV to shard: the state refuses it (it used to accept it and charge
    0 bytes, while an executor built the shards from the host copy)."""
    from batchgen.core.sequences import InvariantError

    state, ids = running_state("qwen3_30b_a3b")
    state.offload(0, ids[:1])
    with pytest.raises(InvariantError, match="host-resident sequence cannot be PARTITIONed"):
        state.partition(0, ids[:1], np.array([2]))


def test_the_state_refuses_to_offload_a_partitioned_sequence():
    from batchgen.core.sequences import InvariantError

    state, ids = running_state("qwen3_30b_a3b")
    state.partition(0, ids[:1], np.array([2]))
    with pytest.raises(InvariantError, match="unpartitioned"):
        state.offload(0, ids[:1])
