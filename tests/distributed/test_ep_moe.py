"""Expert parallelism over 1, 2 and 4 processes gives the single-process MoE layer's output.

Each rank routes its own tokens, ships them to the experts' owners and combines the returned rows; the
reference is `SparseMoE.forward` (DeepseekMoE's, with shared experts) over all ranks' tokens concatenated in
rank order, in the test process with one thread, like the workers (the thread count can change a GEMM's bits).

Every expert sees the same rows in the same order and every token adds its k contributions in the same order
(ep_moe.py), so with the per-expert GEMM loop the result is bit for bit the reference's. With the grouped
GEMM (`torch._grouped_mm`, what runs by default where available) it is equal to rounding only: the kernel's
result for a row depends on where its expert's group sits in the intermediate buffer (its byte offset; a shard
starts its groups at other offsets than the whole layer), measured here as 1 row of 53 off by 3e-8 (qwen3_moe,
4 processes); hence rtol=atol=1e-6 there, and a summation order that differed would still fail the exact test.
The router and the shared experts run on a rank's rows only, which changes no bit as long as each rank's part
holds a few rows (one row alone runs the BLAS's matrix-vector kernel) and the router's sigmoid is row-stable
(`deepseek.row_stable_sigmoid`: without it, on AVX-512, one of deepseek_v3's two instances came out 1 ulp off).
"""

import pytest
import torch

from batchgen.dist import Comm, ExpertParallelMoE, ExpertPlacement
from batchgen.exec.models.config import ExecModelConfig
from batchgen.exec.models import moe as moe_module
from batchgen.exec.models.loading import init_random

from .conftest import run_procs

pytestmark = pytest.mark.usefixtures("one_thread")

T = 53
SPLITS = {1: [53], 2: [40, 13], 4: [20, 0, 19, 14]}  # uneven, and a rank with no tokens at all

CONFIGS = {
    "mixtral": dict(architecture="mixtral", vocab_size=32, hidden_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, num_experts=8, top_k=2, moe_intermediate_size=48),
    "qwen3_moe": dict(architecture="qwen3_moe", vocab_size=32, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, num_experts=6, top_k=3, moe_intermediate_size=40,
                      norm_topk_prob=False),
    "deepseek_v3": dict(architecture="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                        num_kv_heads=4, head_dim=8, num_experts=8, top_k=3, moe_intermediate_size=16,
                        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        rope_interleave=True, max_position_embeddings=64),
}


@pytest.fixture(params=["loop", "grouped"])
def kernel(request, monkeypatch):
    """The expert kernel of references and (forked) workers alike."""
    if request.param == "loop":
        monkeypatch.setitem(moe_module._GROUPED, ("cpu", torch.float32), False)
    elif not moe_module.grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("no usable torch._grouped_mm here")
    return request.param


def check_equal(out, ref, kernel):
    if kernel == "loop":
        assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item()}"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module", params=list(CONFIGS))
def layer(request, one_thread):
    cfg = ExecModelConfig(**CONFIGS[request.param])
    moe = init_random(cfg, seed=3, std=0.3).moe(0)
    if cfg.architecture == "deepseek_v3":
        assert moe.shared_experts is not None
        with torch.no_grad():  # a nonzero correction bias, so the biased choice differs from the weights
            moe.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(5))
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    return moe, x


def reference(moe, x):
    with torch.no_grad():
        ref = moe(x)
    return ref, moe.last_tokens_per_expert


def _ep_forward(ctx, moe, x, splits, owner, pipeline=None):
    torch.set_grad_enabled(False)
    comm = Comm()
    placement = None if owner is None else ExpertPlacement(owner, comm.size)
    ep = ExpertParallelMoE(moe, comm, placement, pipeline=pipeline)
    mine = torch.split(x, splits)[comm.rank]
    out = ep(mine)
    held = sum(getattr(ep.shard, n).numel() for n in ("w_gate", "w_up", "w_down"))
    return out, ep.local_experts, ep.last_tokens_per_expert, held


@pytest.mark.parametrize("procs, pipeline", [(1, None), (2, None), (4, None), (4, 2)])
def test_ep_forward_equals_single_process_moe(layer, procs, pipeline, kernel):
    """The default exchange over 1, 2 and 4 processes, and the pipelined one over 4 (4 sources per expert, a rank
    without tokens; 2 processes: test_pipelined_exchange_...)."""
    moe, x = layer
    ref, ref_counts = reference(moe, x)
    got = run_procs(_ep_forward, procs, moe, x, SPLITS[procs], None, pipeline)
    out = torch.cat([g[0] for g in got])
    assert out.shape == ref.shape
    check_equal(out, ref, kernel)
    # every expert ran on its owner, once, with the batch the single-process layer gave it
    assert [e for g in got for e in g[1]] == list(range(moe.num_experts))
    assert [n for g in got for n in g[2]] == ref_counts
    full = sum(getattr(moe, n).numel() for n in ("w_gate", "w_up", "w_down"))
    assert sum(g[3] for g in got) == full and max(g[3] for g in got) < full or procs == 1


def test_ep_forward_with_interleaved_placement(layer, kernel):
    """Any placement map gives the same result: experts dealt round-robin over 2 ranks."""
    moe, x = layer
    ref, ref_counts = reference(moe, x)
    owner = tuple(e % 2 for e in range(moe.num_experts))
    got = run_procs(_ep_forward, 2, moe, x, SPLITS[2], owner)
    check_equal(torch.cat([g[0] for g in got]), ref, kernel)
    assert got[1][1] == tuple(range(1, moe.num_experts, 2))
    assert got[1][2] == ref_counts[1::2]


def _two_instances(ctx, moe, x):
    """4 processes as 2 instances of 2: each instance's ranks form a group and run their own EP layer on
    their own tokens, at the same time."""
    from batchgen.dist import instance_groups
    torch.set_grad_enabled(False)
    inst = instance_groups([2, 2])
    ep = ExpertParallelMoE(moe, Comm(inst.group))
    tokens = torch.split(x, [30, 23])[inst.index]  # instance 0 runs the first 30 tokens, instance 1 the rest
    mine = torch.tensor_split(tokens, 2)[inst.local_rank(ctx.rank)]
    return inst.index, inst.ranks, ep(mine)


def test_two_instances_run_ep_side_by_side_in_their_own_groups(layer, kernel):
    moe, x = layer
    got = run_procs(_two_instances, 4, moe, x)
    assert [g[:2] for g in got] == [(0, (0, 1)), (0, (0, 1)), (1, (2, 3)), (1, (2, 3))]
    for index, (lo, hi) in enumerate([(0, 30), (30, 53)]):
        ref, _ = reference(moe, x[lo:hi])
        check_equal(torch.cat([g[2] for g in got if g[0] == index]), ref, kernel)


# ---- the pipelined exchange (overlap of the all-to-alls with the local experts) ------------------------------

def test_slot_groups_split_the_local_slots_into_contiguous_blocks_and_refuse_a_bad_pipeline():
    from batchgen.dist.ep_moe import slot_groups
    from batchgen.dist.errors import DistConfigError
    assert slot_groups(4, 1) == ((0, 4),)
    assert slot_groups(4, 2) == ((0, 2), (2, 4))
    assert slot_groups(5, 2) == ((0, 2), (2, 5))
    assert slot_groups(3, 8) == ((0, 1), (1, 2), (2, 3))  # at most one group per slot: an expert is never split
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(DistConfigError, match="pipeline="):
            slot_groups(4, bad)


# (placement, pipelines): contiguous, and an uneven one (rank 1 holds the last 3 experts, rank 0 the rest: with 8
# experts rank 1 has slots past its shard) with every grouping from synchronous (1) to one group per slot
def _uneven(num_experts):
    return tuple(0 if e < num_experts - 3 else 1 for e in range(num_experts))


def _ep_pipelines(ctx, moe, x, splits, variants):
    torch.set_grad_enabled(False)
    comm = Comm()
    mine = torch.split(x, splits)[comm.rank]
    outs = []
    for owner, pipeline in variants:
        placement = None if owner is None else ExpertPlacement(owner, comm.size)
        ep = ExpertParallelMoE(moe, comm, placement, pipeline=pipeline)
        calls = comm.calls
        out = ep(mine)
        outs.append((owner, pipeline, len(ep.groups), comm.calls - calls, out, ep.last_tokens_per_expert))
    return outs


def test_pipelined_exchange_gives_the_synchronous_bits_and_the_single_process_layer(layer, kernel):
    """2 processes, each grouping of the local slots: the pipelined layer's output equals the synchronous one's
    bit for bit (loop kernel) and the single-process SparseMoE over the concatenated tokens; each group costs one
    dispatch and one combine, and the experts' batches do not change (no expert is split)."""
    moe, x = layer
    ref, ref_counts = reference(moe, x)
    uneven = _uneven(moe.num_experts)
    variants = [(None, p) for p in (1, 2, 8)] + [(uneven, p) for p in (1, 2, 3, 8)]
    got = run_procs(_ep_pipelines, 2, moe, x, SPLITS[2], variants)
    width = {None: (moe.num_experts + 1) // 2, uneven: moe.num_experts - 3}
    for i, (owner, pipeline) in enumerate(variants):
        out = torch.cat([g[i][4] for g in got])
        groups = got[0][i][2]
        assert groups == min(pipeline, width[owner])
        assert [g[i][3] for g in got] == [1 + 2 * groups] * 2  # count exchange, then a dispatch and a combine each
        assert [n for g in got for n in g[i][5]] == ref_counts
        check_equal(out, ref, kernel)
        sync = torch.cat([g[variants.index((owner, 1))][4] for g in got])
        if kernel == "loop":
            assert torch.equal(out, sync)


def _async_accounting(ctx):
    import time
    comm = Comm()
    x = torch.full((4,), float(comm.rank))
    y = torch.empty(4)
    before, calls = comm.comm_s, comm.calls
    pending = comm.start_all_to_all_single(y, x, what="probe")
    time.sleep(0.5)  # computing meanwhile: not communication
    comm.wait(pending)
    waited_twice = None
    try:
        comm.wait(pending)
    except RuntimeError as e:
        waited_twice = str(e)
    return comm.comm_s - before, comm.calls - calls, y.tolist(), waited_twice


def test_an_overlapped_operation_counts_its_issue_and_wait_not_the_work_in_between():
    got = run_procs(_async_accounting, 2)
    for comm_s, calls, y, waited_twice in got:
        assert calls == 1 and comm_s < 0.4, comm_s
        assert y == [0.0, 0.0, 1.0, 1.0]
        assert waited_twice == "probe: waited twice"


def test_a_bad_ep_pipeline_setting_is_refused_before_any_process_starts(saved):
    from batchgen.dist.errors import DistConfigError
    from batchgen.dist.run import check_dist
    from tests.distributed.test_dist_backend import dist_settings, job_for

    _, path = saved
    for bad in (0, "2", 1.5):
        with pytest.raises(DistConfigError, match=f"backend.ep_pipeline={bad!r}: give the number of local-expert"):
            check_dist(job_for(2)[0], dist_settings(path, 2, ep_pipeline=bad))
    check_dist(job_for(2)[0], dist_settings(path, 2, ep_pipeline=3))  # more groups than experts is fine (clamped)


def _killed_mid_pipeline(ctx, moe, x):
    """Rank 1 SIGKILLs itself in its second expert group's compute of the 3rd forward (its first group's combine
    and rank 0's second group's rows in flight); rank 0 must raise WorkerLost naming it, not hang."""
    import os
    import signal
    import time
    from batchgen.dist import Heartbeat, WorkerLost
    torch.set_grad_enabled(False)
    hb = Heartbeat.for_context(ctx).start()
    ep = ExpertParallelMoE(moe, Comm(heartbeat=hb), pipeline=2)
    run_rows, calls = ep.shard.sorted_expert_rows, [0]

    def dying(rows, counts):
        calls[0] += 1
        if ctx.rank == 1 and calls[0] == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        return run_rows(rows, counts)

    ep.shard.sorted_expert_rows = dying
    mine = torch.split(x, SPLITS[2])[ctx.rank]
    for _ in range(3):
        t0 = time.time()
        try:
            ep(mine)
        except WorkerLost as e:
            return e.rank, time.time() - t0, str(e)
    return None, None, "3 forwards without a peer"


def test_a_peer_killed_mid_pipeline_is_worker_lost_within_seconds(loop_kernel, one_thread):
    import signal
    cfg = ExecModelConfig(**CONFIGS["mixtral"])
    moe = init_random(cfg, seed=3, std=0.3).moe(0)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    results = run_procs(_killed_mid_pipeline, 2, moe, x, expect_ok=False, join_timeout_s=30)
    assert results[1].exitcode == -signal.SIGKILL
    assert results[0].ok, results[0].error
    lost, after_s, message = results[0].value
    assert lost == 1 and after_s < 10.0, message
