"""PARTITION across processes (backend=dist): stragglers' KV split by heads over the processes of their group with
real send/recv (device to device, the parts batchgen.core.reshard lists), head-sharded attention with its per-layer
exchange, host copies brought up to date from the shards, shards joined back; greedy outputs equal the
single-process executor's and transformers' (the loop expert kernel, as in test_dist_backend.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.dist import Comm
from batchgen.dist.run import DistSettings, execute_dist
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.run import ExecSettings, execute
from batchgen.exec.shards import shards_of
from conftest import make_job
from tests.distributed.conftest import run_procs
from tests.exec.test_exec_parity import hf_greedy, kv_mb_for
from tests.exec.test_deepseek import tiny_hf as tiny_deepseek
from tests.exec.test_models import tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


_SAVED: dict = {}


def saved(arch: str, tmp_path_factory):
    """A tiny Mixtral with 4 KV heads (partitions of degree 2 and 4: head shards), or a tiny DeepSeek-V3 (MLA:
    the latent replicated on every rank of the group), saved once per session."""
    if arch not in _SAVED:
        model = tiny_deepseek() if arch == "deepseek_v3" else tiny_hf("mixtral", num_key_value_heads=4)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        _SAVED[arch] = model, path
    return _SAVED[arch]


def straggler_job(procs: int, stragglers: int, degree: int):
    """`stragglers` sequences outlive the rest: coroutine PARTITIONs them once they are the tail (any context)."""
    inputs, outputs = np.full(2 * procs, 12), np.full(2 * procs, 6)
    outputs[:stragglers] = 30
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": procs},
                   policy_overrides={"b_moe": 4, "b_attn": 4, "kv_residency": "device", "partition_min_context": 1,
                                     "partition_below": 1.0, "max_partition_degree": degree})
    return job, outputs


@pytest.mark.parametrize("arch,procs,stragglers,degree", [
    ("mixtral", 2, 1, 2), ("mixtral", 4, 1, 2),
    # the slow ones: 7-9 s each on the shared 2-core machine at load ~6
    pytest.param("mixtral", 4, 1, 4, marks=pytest.mark.slow),
    pytest.param("mixtral", 4, 2, 2, marks=pytest.mark.slow),  # two groups in one exchange
    pytest.param("deepseek_v3", 2, 1, 2, marks=pytest.mark.slow)])
def test_partitioned_stragglers_match_exec_and_hf(tmp_path_factory, loop_kernel, arch, procs, stragglers, degree):
    """(4, 1, 2): the policy's degree capped at 2 (max_partition_degree), so two of the four processes hold no
    shard and still join every layer's exchange."""
    model, path = saved(arch, tmp_path_factory)
    job, outputs = straggler_job(procs, stragglers, degree)
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000),
                                         procs=procs, timeout_s=30.0))
    ref = execute(straggler_job(procs, stragglers, degree)[0],
                  ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000), threads=1))
    t = out.prepared.state.table
    assert t.partitions[:stragglers].min() >= 1
    assert out.capabilities.partition_degrees[-1] == procs
    for sid in range(len(outputs)):
        got = out.tokens.generated[sid]
        assert got == ref.tokens.generated[sid], sid
        assert got == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    moved = out.kv_moves
    assert moved.get("partition", 0) >= stragglers, moved
    assert sum(m.get("partition", 0) for m in out.rank_moves) == moved["partition"]
    # each partition of `degree` sent a shard to degree - 1 other processes, and (one straggler) exactly `degree`
    # processes held one
    assert sum(m.get("partition_shard", 0) for m in out.rank_moves) == moved["partition"] * (degree - 1)
    holders = sum(m.get("partition", 0) + m.get("partition_shard", 0) > 0 for m in out.rank_moves)
    assert holders == degree if stragglers == 1 else holders >= degree
    # the same KV moves as the single-process executor, and the same parts resharded and gathered, per rank and
    # tier (each rank counted those it received; rank 0 adds them up)
    assert {k: v for k, v in moved.items() if v} == {k: v for k, v in ref.kv_moves.items() if v}
    assert out.kv_traffic["reshard_bytes"] == ref.kv_traffic["reshard_bytes"] > 0
    for kind in ("reshard", "join", "sync", "reshard_host_copy"):
        assert out.kv_account.as_dict().get(kind) == ref.kv_account.as_dict().get(kind), kind
    # every process entered the per-layer exchange of every partitioned forward, and rows crossed processes
    layers = out.kv_traffic["partition_exchange_layers"]
    assert layers > 0 and layers % (procs * 3) == 0, layers  # 3 layers, every process
    assert out.kv_traffic["partition_exchange_bytes"] > 0
    assert all(c > 0 for c in out.rank_comm_s)


# ---- reshards and gathers between processes, on caches alone --------------------------------------------------

SPLITS = {7: (2, 0), 8: (0, 1, 2), 9: (1, 2)}  # sequence: its group (lead first), wrapping over 3 processes
GEOMETRY = {"gqa": dict(num_layers=2, num_kv_heads=6, head_dim=3), "mla": dict(num_layers=2, num_kv_heads=1,
                                                                                 head_dim=5, v_head_dim=0)}


def _lead_cache(geometry: str, lead: int) -> PagedKVCache:
    """Every process builds the same caches; the leads' sequences hold 10 tokens in their device pages, and 8 a host
    copy of them too."""
    cache = PagedKVCache(**GEOMETRY[geometry], page_size=4, num_pages=24)
    gen = torch.Generator().manual_seed(5)
    for sid, group in SPLITS.items():
        if group[0] != lead:
            continue
        meta = cache.prepare([sid], [10], [0])
        for l in range(cache.num_layers):
            for pool in cache.layer(l)[:cache.planes]:
                flat = pool.view(-1, cache.num_kv_heads, pool.shape[-1])
                flat[meta.slot_mapping] = torch.randn(10, *flat.shape[1:], generator=gen)
        if sid == 8:
            cache.sync_to_host([8])
    return cache


def _new_row(geometry: str, sid: int) -> torch.Tensor:
    """The KV of the token decoded while partitioned: [layers, planes, heads, dim]."""
    g = GEOMETRY[geometry]
    planes = 1 if g.get("v_head_dim") == 0 else 2
    return torch.randn(g["num_layers"], planes, g["num_kv_heads"], g["head_dim"],
                       generator=torch.Generator().manual_seed(sid))


def _split_decode_join(ctx, geometry):
    from batchgen.dist.partition import gather_to_host_kv, reshard_kv

    comm = Comm()
    me = comm.rank
    cache = _lead_cache(geometry, me)
    received = [0]

    def count(part, nbytes):
        assert part.dst == me and part.src != me
        received[0] += nbytes

    whole = {sid: cache.migration_rows(sid)[0].clone() for sid, g in SPLITS.items() if g[0] == me}
    for sid, group in SPLITS.items():  # split from the lead's pages, device to device
        if me in group:
            reshard_kv(comm, cache, sid, (group[0],), group, count)
    store = shards_of(cache)
    cache.check()
    held, split = sorted(store.seq_ids()), received[0]
    for sid, group in SPLITS.items():  # one decode token: each shard writes its heads (MLA: the whole latent)
        if me not in group:
            continue
        j, degree = group.index(me), len(group)
        m = store.prepare([sid], [1], [10])
        heads = store.heads(degree)
        row = _new_row(geometry, sid)
        part = row[..., j * heads:(j + 1) * heads, :] if store.split else row
        for l in range(cache.num_layers):
            for plane, pool in enumerate(store.layer(l, degree)[:cache.planes]):
                pool.flatten(0, 1)[m.slot_mapping] = part[l, plane][None]
    received[0] = 0
    wrote = gather_to_host_kv(comm, cache, 8, SPLITS[8], count) if me in SPLITS[8] else 0  # 8's host copy
    gathered = received[0]
    received[0] = 0
    if me in SPLITS[7]:  # 7 joins back into its lead's pages
        reshard_kv(comm, cache, 7, SPLITS[7], (SPLITS[7][0],), count)
    for sid in (8, 9):  # 8 yielded (its host copy is up to date), 9 finished: every rank drops its shard
        if me in SPLITS[sid]:
            store.release([sid])
    if me == SPLITS[9][0]:
        assert 9 not in cache
    after = {7: cache.migration_rows(7)[0] if me == 2 else None,
             8: cache.export(8).tokens() if me == 0 else None}
    return held, split, gathered, wrote, received[0], whole, after, cache.used_pages(), cache.seq_ids()


@pytest.mark.parametrize("geometry", ["gqa", "mla"])
def test_reshards_and_gathers_send_the_shards_between_processes(geometry):
    """Three processes: shards go from each lead's pages straight to its group (real send/recv, groups wrapping),
    a decode token is written into every shard; 8's lead brings its host copy up to date from the group's shards,
    7 joins back into its lead's pages (the old KV plus the new token), 8 and 9 drop their shards; the shard pages
    go back to each pool. Only the parts that cross processes are counted, on the rank that receives them: for GQA
    a shard per other rank, for MLA a replica."""
    results = run_procs(_split_decode_join, 3, geometry)
    split = geometry == "gqa"
    g = GEOMETRY[geometry]
    whole = g["num_layers"] * (2 if split else 1) * g["num_kv_heads"] * g["head_dim"] * 4  # bytes per token
    for rank, (held, moved, gathered, wrote, joined, before, after, used, seqs) in enumerate(results):
        assert held == sorted(sid for sid, grp in SPLITS.items() if rank in grp)
        # each rank receives its shard of every group it joins but leads (MLA: a whole replica)
        assert moved == sum(10 * whole // (len(grp) if split else 1) for grp in SPLITS.values()
                            if rank in grp[1:])
        if rank == 0:  # 8's lead: the other two thirds of the new token (MLA: none, its replica is whole)
            assert gathered == (whole * 2 // 3 if split else 0) and wrote == whole
            rows = before[8].permute(2, 0, 1, 3, 4)  # [tokens, layers, planes, heads, dim], as export gives
            assert torch.equal(after[8], torch.cat([rows, _new_row(geometry, 8)[None]]))
        if rank == 2:  # 7's lead: the other shard of 11 tokens (MLA: none)
            assert joined == (11 * whole // 2 if split else 0)
            assert torch.equal(after[7], torch.cat([before[7], _new_row(geometry, 7)[:, :, None]], dim=2))
        assert used == (3 if rank == 2 else 0)  # only 7's pages (11 tokens), on its lead
        assert sorted(seqs) == sorted([7] * (rank == 2) + [8] * (rank == 0))


def test_degrees_declared_and_a_plan_beyond_them_refused_before_any_command(tmp_path_factory):
    """DistBackend declares the degrees the model's heads allow up to its process count (the policy plans
    within them); a plan that splits over more is refused on rank 0 before any command is broadcast."""
    from types import SimpleNamespace

    from batchgen.core.ops import KVOps
    from batchgen.dist.backend import DistBackend
    from batchgen.exec.models.loading import load_model
    from batchgen.exec.runner import InstanceRunner
    from batchgen.job import prepare

    _, path = saved("mixtral", tmp_path_factory)

    class Silent:  # a worker whose control channel must stay unused
        runner = InstanceRunner(load_model(path))

    class Refusing:  # rank 0's command channel (dist/control.py), which must stay unused
        def post(self, cmd, instances):
            raise AssertionError(f"a {cmd.kind} command was posted")

    def backend(procs):
        state = prepare(straggler_job(procs, 1, procs)[0]).state
        return DistBackend(state, Silent(), SimpleNamespace(), procs, is_moe=True, channel=Refusing())

    assert backend(2).capabilities.partition_degrees == (1, 2)
    assert backend(4).capabilities.partition_degrees == (1, 2, 4)
    two = backend(2)
    ops = KVOps(np.arange(2), reshard_ids=np.array([0]), reshard_lead=np.array([0]), reshard_degree=np.array([1]),
                reshard_to_lead=np.array([0]), reshard_to_degree=np.array([4]), reshard_host_copy=np.array([False]))
    with pytest.raises(ValueError, match="partitions sequences over 4 ranks; backend=dist declares degrees"):
        two.move_kv(ops)


@pytest.mark.slow  # about 5 s each on the loaded 2-core machine (4 processes, then the single-process run)
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_every_partition_move_of_a_scripted_job_is_the_single_process_executors(attention):
    """The scripted splits, group moves, degree changes, joins, yields and evictions of tests/exec/
    test_partition_account.py (GQA shards, MLA replicas) on 4 processes over 2 nodes: every part resharded or gathered is sent between
    processes and counted where it lands, exactly as the single-process executor copies it (which the state
    prices), and the tokens are the same."""
    import dataclasses

    from tests.exec.test_kv_account import scripted
    from tests.exec.test_partition_account import SCRIPT, tiny_model

    job = make_job("continuous", n=8, inputs=np.arange(8) % 5 + 11, outputs=np.full(8, 28), page_tokens=8,
                   cluster_overrides={"num_gpus": 4, "gpus_per_node": 2, "gpus_per_instance": 4})
    job = dataclasses.replace(job, model=tiny_model(attention))
    out = execute_dist(dataclasses.replace(job, policy=scripted(SCRIPT)),
                       DistSettings(device="cpu", dtype="float32", kv_budget_mb=4, procs=4, timeout_s=60.0))
    ref = execute(dataclasses.replace(job, policy=scripted(SCRIPT)),
                  ExecSettings(device="cpu", dtype="float32", threads=1, kv_budget_mb=4))
    assert out.kv_account.as_dict() == ref.kv_account.as_dict()
    assert {"reshard", "sync"} <= set(out.kv_account.kinds())
    assert {k: v for k, v in out.kv_moves.items() if v} == {k: v for k, v in ref.kv_moves.items() if v}
    assert [list(g) for g in out.tokens.generated] == [list(g) for g in ref.tokens.generated]
