"""The explicit KV ops the state's primitives emit (batchgen.core.oplog): a scripted sequence of decisions gives
exactly the expected per-GPU lists, and an op the KV is not placed for fails with the sequence and the GPU."""

import numpy as np
import pytest

from batchgen.core.ops import KVLedger, KVOps
from batchgen.core.oplog import COLUMNS
from batchgen.core.sequences import InvariantError
from batchgen.core.state import ClusterState
from batchgen.engine import InstanceProgress, apply_decision
from batchgen.job import prepare
from batchgen.policy.base import Admit, Decision
from conftest import make_job

I = np.int64


def four_gpus_two_nodes():
    """One expert-parallel instance of 4 GPUs over 2 nodes (GPUs 0, 1 on node 0; 2, 3 on node 1), 8 prompts."""
    job = make_job("coroutine", n=8, inputs=np.full(8, 40), outputs=np.full(8, 100),
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4})
    state = prepare(job).state
    assert state.topo.gpu_node.tolist() == [0, 0, 1, 1] and state.topo.num_instances == 1
    return state, KVLedger(len(state.table), state.topo.gpu_node), InstanceProgress(4)


def step(state, ledger, progress, **fields):
    plan = apply_decision(state, 0, Decision(**{k: np.asarray(v, I) if k != "admits" else v
                                                for k, v in fields.items()}), progress, ledger=ledger)
    if plan.decode_ids.size:  # the run made a token for every decode
        state.advance(plan.decode_ids, np.ones(plan.decode_ids.size, I), host_sync=False)
    if plan.prefill_ids.size:
        state.advance(plan.prefill_ids, np.ones(plan.prefill_ids.size, I), host_sync=False)
    return plan


def kv(plan, rank):
    """Rank `rank`'s share of the plan without its empty lists."""
    mine = vars(plan.for_rank(rank)).copy()
    mine.pop("gpu")
    return {k: v for k, v in mine.items() if v}


def test_scripted_decisions_give_exactly_the_expected_per_rank_ops():
    state, ledger, progress = four_gpus_two_nodes()
    # prefill four prompts: no KV moves, the prefills on their ranks
    plan = step(state, ledger, progress, prefill_ids=[0, 1, 2, 3], prefill_ranks=[0, 0, 1, 2], steps=1)
    assert plan.ops.empty()
    assert [kv(plan, r) for r in range(4)] == [{"prefill": [0, 1]}, {"prefill": [2]}, {"prefill": [3]}, {}]

    # YIELD 0; MIGRATE 1 from GPU 0 to GPU 3 (another node); PARTITION 2 over GPUs 1 and 2; the rest decode
    plan = step(state, ledger, progress, yield_ids=[0], move_ids=[1], move_ranks=[3], partition_ids=[2],
                partition_degree=[2], steps=4)
    assert kv(plan, 0) == {"yield_": [0], "send": [(1, 3, True)]}
    nodes = {0: 0, 1: 0, 2: 1, 3: 1}  # what a rank with partition ops is told of the instance, for their tiers
    # a split: from GPU 1's pages (a group of one) to the group of GPUs 1 and 2, device to device
    assert kv(plan, 1) == {"reshard": [(2, (1,), (1, 2), False)], "nodes": nodes, "decode": [2]}
    assert kv(plan, 2) == {"reshard": [(2, (1,), (1, 2), False)], "nodes": nodes, "decode": [3]}
    assert kv(plan, 3) == {"receive": [(1, 0, True, True, False)], "decode": [1]}  # no host copy: none kept

    # COMBINE 0 where it was yielded (a restore); un-PARTITION 2 (the shards joined into GPU 1's pages);
    # evict 3 (recompute)
    plan = step(state, ledger, progress, admits=[Admit(0, np.array([0], I), np.array([0], I))],
                partition_ids=[2], partition_degree=[1], evict_ids=[3], steps=4)
    assert kv(plan, 0) == {"restore": [0], "decode": [0]}
    assert kv(plan, 1) == {"reshard": [(2, (1, 2), (1,), False)], "nodes": nodes, "decode": [2]}
    assert kv(plan, 2) == {"reshard": [(2, (1, 2), (1,), False)], "nodes": nodes, "evict": [3]}
    assert kv(plan, 3) == {"decode": [1]}

    # YIELD 1 on node 1, then COMBINE it on GPU 0: its host copy migrates across nodes, loaded to device;
    # 3 is prefilled again from scratch
    step(state, ledger, progress, yield_ids=[1], steps=1)
    plan = step(state, ledger, progress, admits=[Admit(1, np.array([1], I), np.array([0], I))],
                prefill_ids=[3], prefill_ranks=[1], steps=1)
    assert kv(plan, 3) == {"send": [(1, 0, True)]}
    # a prefill forward decodes too; 1 keeps a host copy (on node 0 now)
    assert kv(plan, 0) == {"receive": [(1, 3, True, True, True)], "decode": [0, 1]}
    assert kv(plan, 1) == {"prefill": [3], "decode": [2]}

    # a sequence that finished is freed at the instance's next boundary, where its KV is
    t = state.table
    t.output_len[0] = t.decoded[0]
    state.finish(0, np.array([0], I), np.array([1.0]))
    plan = step(state, ledger, progress, steps=1)
    assert kv(plan, 0) == {"free": [0], "decode": [1]}
    assert ledger.holder[[0, 1, 2, 3]].tolist() == [-1, 0, 1, 1]


def test_an_op_the_kv_is_not_placed_for_names_the_sequence_and_the_gpu():
    state, ledger, progress = four_gpus_two_nodes()
    step(state, ledger, progress, prefill_ids=[0, 1], prefill_ranks=[0, 1], steps=1)
    gpus = state.instance_gpus(0)
    one = lambda sid: np.array([sid], I)  # noqa: E731
    with pytest.raises(InvariantError, match=r"restore .*sequence 0 on GPU 0: its KV is on GPU 0's device"):
        ledger.apply(KVOps(gpus, restore_ids=one(0), restore_gpu=one(0)))  # on device, not on host
    with pytest.raises(InvariantError, match=r"restore .*sequence 5 on GPU 2: its KV is held nowhere"):
        ledger.apply(KVOps(gpus, restore_ids=one(5), restore_gpu=one(2)))  # never prefilled
    with pytest.raises(InvariantError, match=r"migrate from of sequence 1 on GPU 0: its KV is on GPU 1's"):
        ledger.apply(KVOps(gpus, migrate_ids=one(1), migrate_src=one(0), migrate_dst=one(2),
                           migrate_cross=np.array([True]), migrate_to_device=np.array([True])))
    with pytest.raises(InvariantError, match=r"sequence 1 is in yield and migrate"):
        ledger.apply(KVOps(gpus, yield_ids=one(1), yield_gpu=one(1), migrate_ids=one(1), migrate_src=one(1),
                           migrate_dst=one(2), migrate_cross=np.array([True]), migrate_to_device=np.array([True])))
    assert ledger.holder[[0, 1]].tolist() == [0, 1] and ledger.on_device[[0, 1]].all()  # nothing recorded


def test_simulated_policies_keep_the_ledger_in_step_with_the_state():
    """With check_invariants the engine builds and checks every boundary's ops in the simulator too: yields
    happened on the way, and the ledger ends with every sequence's KV freed (each instance's last, idle
    boundary frees what its last run finished)."""
    from batchgen.sim.run import simulate

    job = make_job("coroutine", n=40, inputs=np.full(40, 200), outputs=np.full(40, 300),
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4},
                   policy_overrides={"kv_residency": "device"})
    out = simulate(job, kv_pages_per_gpu=40, progress=False)
    ledger = KVLedger.of(out.prepared.state)
    assert (out.prepared.state.table.yields > 0).any()
    assert (ledger.holder == -1).all() and not ledger.on_device.any() and not ledger.split.any()


def test_a_partitioned_sequence_moves_reshards_and_leaves_its_group_as_the_state_says():
    """MIGRATE of a partitioned sequence moves its group to the new lead at its degree, then PARTITION changes the
    degree there (two reshards, in that order, no migration); a yield gathers it into its lead's host copy (a join
    to host, no yield op), and a finished one's shards are dropped (a join, no free)."""
    state, ledger, progress = four_gpus_two_nodes()
    step(state, ledger, progress, prefill_ids=[0, 1], prefill_ranks=[0, 1], steps=1)
    step(state, ledger, progress, partition_ids=[0, 1], partition_degree=[2, 2], steps=1)
    plan = step(state, ledger, progress, move_ids=[0], move_ranks=[2], partition_ids=[0], partition_degree=[4],
                steps=1)
    assert plan.ops.reshards() == [(0, (0, 1), (2, 3), False), (0, (2, 3), (2, 3, 0, 1), False)]
    assert not plan.ops.migrate_ids.size and ledger.split[0] == 4 and ledger.holder[0] == 2
    plan = step(state, ledger, progress, yield_ids=[0], steps=1)
    assert kv(plan, 3) == {"join": [(0, (2, 3, 0, 1), True)], "nodes": {0: 0, 1: 0, 2: 1, 3: 1}}
    assert not plan.ops.yield_ids.size and ledger.holder[0] == 2 and not ledger.on_device[0]
    t = state.table
    t.output_len[1] = t.decoded[1]
    state.finish(0, np.array([1], I), np.array([1.0]))
    plan = step(state, ledger, progress, steps=1)
    assert kv(plan, 2) == {"join": [(1, (1, 2), False)], "nodes": {0: 0, 1: 0, 2: 1, 3: 1}}
    assert not plan.ops.free_ids.size and ledger.holder[1] == -1
    gpus = state.instance_gpus(0)
    one = lambda sid: np.array([sid], I)  # noqa: E731
    with pytest.raises(InvariantError, match=r"reshard .*sequence 0 on GPU 0: its KV is on GPU 2's host copy"):
        ledger.apply(KVOps(gpus, reshard_ids=one(0), reshard_lead=one(0), reshard_degree=one(1),
                           reshard_to_lead=one(0), reshard_to_degree=one(2)))


# jobs whose boundaries emit every kind of op: yields, offloads and host-resident resumes, migrations within and
# across nodes, splits and joins of partitions, evictions, prefills to host, two instances sharing a node
# (policy, its knobs, cluster overrides, the kinds of ops the job must emit)
EMITTING = {
    "coroutine-mixed-4-gpus": ("coroutine", {"kv_residency": "mixed", "b_attn": 4, "b_moe": 8},
                               {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4},
                               {"free", "migrate", "restore"}),
    "coroutine-offload": ("coroutine", {"kv_residency": "mixed", "b_attn": 16, "b_moe": 16},
                          {"num_gpus": 1, "gpus_per_node": 1, "gpus_per_instance": None}, {"free", "offload"}),
    "coroutine-partition": ("coroutine", {"b_moe": 4, "b_attn": 4, "kv_residency": "device",
                                          "partition_min_context": 1, "partition_below": 1.0},
                            {"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4},
                            {"free", "join", "yield", "migrate", "restore", "reshard"}),
    "coroutine-two-instances": ("coroutine", {"kv_residency": "device", "b_attn": 8, "b_moe": 8},
                                {"num_gpus": 4, "gpus_per_node": 4, "gpus_per_instance": 2},
                                {"free", "yield", "migrate", "restore"}),
    "flexgen": ("flexgen", {}, {"num_gpus": 1, "gpus_per_node": 1, "gpus_per_instance": None}, {"free", "evict"}),
    "continuous": ("continuous", {}, {"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": None},
                   {"free", "evict"}),
}


@pytest.mark.parametrize("name", sorted(EMITTING))
def test_the_emitted_ops_equal_a_diff_of_the_ledger_against_the_state(name, monkeypatch):
    """Every boundary's ops, as the primitives emitted them, equal those a comparison of where the ledger has each
    KV with where the state keeps it gives (tests/kv_diff.py), field for field and in order; and the jobs emit
    the kinds they should."""
    from batchgen.sim.run import simulate
    from kv_diff import diffed_ops

    policy, knobs, cluster, kinds = EMITTING[name]
    rng = np.random.default_rng(3)
    n = 24
    outputs = rng.integers(4, 60, n)
    outputs[:2] = 150
    job = make_job(policy, "tiny_moe", "h100_8", rng.integers(20, 120, n), outputs, page_tokens=8,
                   policy_overrides=knobs, cluster_overrides=cluster)
    apply, move_running, seen, moved = KVLedger.apply, ClusterState.move_running, {}, {}

    def moving(state, instance, ids, gpus):
        moved[instance] = move_running(state, instance, ids, gpus)  # in the order it carried them out
        return moved[instance]

    def checking(ledger, ops, fresh_ids=np.empty(0, I), fresh_gpu=np.empty(0, I), fresh_to_host=False):
        state = next(s for s, mine in KVLedger._by_state.items() if mine is ledger)
        instance = int(state.topo.gpu_instance[ops.gpus[0]])
        mine = np.flatnonzero(state.table.instance == instance)
        carried = moved.pop(instance, np.empty(0, I))
        expected = diffed_ops(state, ledger, instance, mine, fresh_ids, carried)
        assert np.array_equal(ops.gpus, expected.gpus) and np.array_equal(ops.gpu_node, expected.gpu_node)
        for kind, names in COLUMNS.items():  # each kind's ops alike, up to their order
            if kind in ("share", "unshare", "untail"):  # shared prefixes: no placement diff derives them (and
                continue                                 # these jobs share none: tests/test_prefix_pages.py)
            got, want = _by_id(ops, kind, names), _by_id(expected, kind, names)
            for name in names:
                if name not in ("bytes", "from_device"):  # bytes and source tier: what the diff cannot know
                    assert np.array_equal(got[name], want[name]), f"{kind}_{name}"
            seen[kind] = seen.get(kind, 0) + got["ids"].size
        # the state's MIGRATEs first, in the order it carried them out (each arrival fits then), then resumes
        assert np.array_equal(ops.migrate_ids[:carried.size], carried)
        assert not np.isin(ops.migrate_ids[carried.size:], carried).any()
        return apply(ledger, ops, fresh_ids, fresh_gpu, fresh_to_host)

    monkeypatch.setattr(KVLedger, "apply", checking)
    monkeypatch.setattr(ClusterState, "move_running", moving)
    simulate(job, kv_pages_per_gpu=40, progress=False)
    assert {kind for kind, n in seen.items() if n} >= kinds


def _by_id(ops, kind, names):
    """A kind's columns, its ops ordered by sequence id (a sequence's two reshards keep their order)."""
    order = np.argsort(getattr(ops, f"{kind}_ids"), kind="stable")
    return {name: getattr(ops, f"{kind}_{name}")[order] for name in names
            if getattr(ops, f"{kind}_{name}").size == order.size}
