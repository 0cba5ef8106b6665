"""backend=dist: greedy outputs over 1, 2 and 4 processes (gloo, one thread each) equal the single-process executor's
and transformers' on a tiny Mixtral, with a KV budget small enough to force yields, restores and migrations
between ranks (here between processes: real send/recv of KV).

Both runs use the per-expert loop kernel: with it an expert's GEMM sees the same rows in the same order in the
expert-parallel layer as in the single-process one (ep_moe.py), so logits agree bit for bit and greedy tokens
cannot flip on a near tie. The grouped GEMM differs at ~1e-8 depending on where an expert's rows sit
(test_ep_moe.py), which could flip a near tie; that is why the loop kernel is the one compared here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from batchgen import job as job_module
from batchgen.dist.errors import DistConfigError
from batchgen.dist.run import DistSettings, execute_dist
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models.loading import read_config
from batchgen.exec.run import ExecSettings, execute
from batchgen.workload.spec import Workload
from conftest import make_job
from tests.exec.test_exec_parity import hf_greedy, kv_mb_for
from tests.exec.test_shared_prefix_exec import always_pays

pytestmark = pytest.mark.usefixtures("one_thread")

N = 10


def job_for(procs: int, policy: str = "coroutine", n: int = N):
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 40, n), rng.integers(8, 40, n)
    return make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                    cluster_overrides={"num_gpus": procs},
                    policy_overrides={"b_moe": 4} if policy == "coroutine" else None), outputs


def dist_settings(path, procs, kv_tokens=80, **kw):
    kw.setdefault("timeout_s", 30.0)
    return DistSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, kv_tokens), procs=procs,
                        **kw)


def coroutine_job(procs: int, **knobs):
    """`job_for`'s coroutine job with more of its knobs set (yields and migrations still forced by the small KV
    budget)."""
    job, outputs = job_for(procs)
    return make_job("coroutine", model="tiny_moe", inputs=job.workload.input_lens, outputs=outputs, page_tokens=8,
                    cluster_overrides={"num_gpus": procs}, policy_overrides={"b_moe": 4, **knobs}), outputs


def same_as_exec(saved, job, outputs, procs: int):
    """`job` over `procs` processes, each sequence's greedy tokens checked against the executor's on `job_for`'s
    job and against transformers'; returns the run."""
    model, path = saved
    out = execute_dist(job, dist_settings(path, procs))
    ref = execute(job_for(procs)[0], ExecSettings(device="cpu", model_path=str(path),
                                                  kv_budget_mb=kv_mb_for(path, 80), threads=1))
    for sid in range(N):
        got = out.tokens.generated[sid]
        assert got == ref.tokens.generated[sid], sid
        assert got == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    return out


@pytest.mark.parametrize("procs", [1, 2, 4])
def test_greedy_matches_exec_and_hf_with_yields_and_migrations(saved, loop_kernel, procs):
    out = same_as_exec(saved, *job_for(procs), procs)
    moved = out.kv_moves
    assert moved.get("yield", 0) > 0 and moved.get("restore", 0) + moved.get("migrate", 0) > 0, moved
    # the ranks carried out the moves themselves: their own counts add up to rank 0's plan
    for kind in ("yield", "restore", "migrate", "evict"):
        assert sum(m.get(kind, 0) for m in out.rank_moves) == moved.get(kind, 0), kind
    if procs > 1:
        assert moved.get("migrate", 0) > 0, moved  # KV crossed processes
    # honest metrics: one entry per process that exists, each measured by that process
    assert out.backend == "dist" and out.procs == procs
    assert len(out.rank_busy_s) == len(out.rank_comm_s) == len(out.rank_idle_s) == procs
    assert all(b > 0 for b in out.rank_busy_s)
    if procs > 1:
        assert all(c > 0 for c in out.rank_comm_s)  # every rank joined the all-to-alls
    for w, b, c, i in zip(out.rank_wall_s, out.rank_busy_s, out.rank_comm_s, out.rank_idle_s):
        assert b + c + i == pytest.approx(w, rel=1e-6, abs=1e-6)
    busy = np.sum([r.rank_busy for r in out.records], axis=0)
    assert busy.shape == (procs,) and busy.sum() <= sum(out.rank_busy_s) + 1e-9


def test_refused_before_any_process_starts(saved):
    _, path = saved
    job, _ = job_for(2)
    with pytest.raises(DistConfigError, match="cluster.num_gpus=3"):
        execute_dist(job, dist_settings(path, 3))
    with pytest.raises(DistConfigError, match="at most 8 processes"):
        execute_dist(job_for(16)[0], dist_settings(path, 16))
    for policy, schedule in (("flexgen", "micro_batch"), ("moe_lightning", "pipelined")):  # an FFN per micro-batch
        with pytest.raises(DistConfigError, match=f"ffn_schedule={schedule}.*use backend=exec"):
            execute_dist(job_for(2, policy)[0], dist_settings(path, 2))


@pytest.mark.slow  # about 10 s idle, 27 s on the loaded 2-core machine
def test_chunked_prefill_and_recompute_over_two_processes(saved, loop_kernel):
    """continuous with chunked prefill and a small KV pool: prompt chunks beside decodes in one forward (each
    chunk over the KV its earlier chunks left in its process's cache), part-prefilled prompts preempted and
    recomputed; greedy outputs equal transformers'."""
    model, path = saved
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(4, 40, N), rng.integers(8, 40, N)
    job = make_job("continuous", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"chunked_prefill": True, "token_budget": 12})
    out = execute_dist(job, dist_settings(path, 2))
    for sid in range(N):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    assert "mixed" in {r.phase for r in out.records}
    assert out.prepared.state.table.recomputes.sum() > 0 and sum(m.get("evict", 0) for m in out.rank_moves) > 0


@pytest.mark.parametrize("attention", ["gpu", "cpu"])
def test_host_resident_decode_over_two_processes(saved, loop_kernel, attention):
    """More running sequences than a process's device KV holds: the rest run host-resident on their own
    process (KV staged per layer into its staging buffers, or attended on its CPU); outputs equal transformers'."""
    model, path = saved
    n, page = 12, 8
    rng = np.random.default_rng(7)
    inputs, outputs = rng.integers(24, 40, n), rng.integers(8, 32, n)
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=page,
                   cluster_overrides={"num_gpus": 2},
                   policy_overrides={"b_moe": 8, "b_attn": 2, "kv_residency": "mixed", "attention": attention})
    longest = -(-int((inputs + outputs).max()) // page) * page
    budget = kv_mb_for(path, 80, staging_seqs=0 if attention == "cpu" else 2, max_context=longest)
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), kv_budget_mb=budget, procs=2,
                                         timeout_s=30.0))
    for sid in range(n):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
    traffic = out.kv_traffic
    assert 0 < traffic["host_resident_seq_steps"] < traffic["seq_steps"]
    assert (traffic.get("cpu_attention_seq_steps", 0) > 0) == (attention == "cpu")
    assert (traffic["restored_bytes"] > 0) == (attention == "gpu")


def test_a_killed_worker_stops_the_run_within_seconds(saved, loop_kernel, kill_at):
    """backend.recover=false: rank 1 is SIGKILLed at its 4th forward: rank 0 finds it lost (heartbeat, or the
    closed socket) and the run stops with an error naming it, well within 30 s, instead of hanging
    (test_recovery.py: the same loss with recovery)."""
    import signal
    import time

    from batchgen.dist.run import DistRunFailed

    kill_at(1, 4)
    _, path = saved
    job, _ = job_for(2)
    t0 = time.monotonic()
    with pytest.raises(DistRunFailed) as err:
        execute_dist(job, dist_settings(path, 2, timeout_s=120.0, recover=False))
    assert time.monotonic() - t0 < 30
    assert "rank 1" in err.value.headline and "WorkerLost" in err.value.headline, str(err.value)
    assert any(r.rank == 1 and r.exitcode == -signal.SIGKILL for r in err.value.results)


def test_sampled_outputs_equal_the_single_process_executor(saved, loop_kernel):
    """temperature 0.8, top-p 0.9: each process samples its own sequences with the per-(sequence, step) draws the
    single-process executor uses, so the sampled tokens are the same (and really sampled: not the greedy ones)."""
    _, path = saved
    job, _ = job_for(2)
    knobs = dict(temperature=0.8, top_p=0.9)
    out = execute_dist(job, dist_settings(path, 2, **knobs))
    ref = execute(job_for(2)[0], ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 80),
                                              threads=1, **knobs))
    greedy = execute(job_for(2)[0], ExecSettings(device="cpu", model_path=str(path),
                                                 kv_budget_mb=kv_mb_for(path, 80), threads=1))
    assert out.tokens.generated == ref.tokens.generated
    assert out.tokens.generated != greedy.tokens.generated


@pytest.mark.parametrize("policy", ["continuous", "coroutine", "coroutine-host", "continuous-nested", "coroutine-fetch",
                                    "coroutine-fetch-nested"])
def test_shared_prefixes_over_two_processes(saved, loop_kernel, policy, monkeypatch):
    """Groups of prompts that share a prefix (ending inside a page), over two processes: each process's cache
    holds the prefixes its rank's members share (the state's `share`/`unshare` ops performed there, creators'
    attention first), so each rank computes a group's prefix once, and members decoding together read it once
    per cascaded call, as the engine counted (every cascade taken to pay: a tiny model's never do); greedy outputs
    equal transformers'. coroutine-host: every member decodes host-resident, each cascaded call restoring its
    prefix once into the process's staging buffers. continuous-nested: the groups' prefixes begin with one of two
    system prompts of 13 tokens (nested levels), each held once beneath its groups'. coroutine-fetch: the groups
    interleaved over the queue and a few prompts per forward, so that a process lacking a prefix another holds
    receives it (`prefix_fetch`), its bytes those the state priced."""
    from batchgen.workload.prefix_tree import PrefixTree

    nested = policy.endswith("-nested")
    policy = policy.removesuffix("-nested")
    fetch = policy.endswith("-fetch")
    policy = policy.removesuffix("-fetch")
    monkeypatch.setattr(job_module, "cascade_pays", always_pays)
    model, path = saved
    n, group, prefix = 16, 4, 29
    rng = np.random.default_rng(5)
    inputs, outputs = prefix + rng.integers(3, 12, n), rng.integers(4, 24, n)
    knobs = ({"token_budget": 64, "cascade_attention": "groups"} if policy == "continuous"
             else {"b_moe": 4, "prefill_tokens_per_rank": 48 if fetch else 128, "prefix_fetch": fetch})
    staging = {}
    if policy == "coroutine-host":
        policy, knobs = "coroutine", {**knobs, "b_moe": 8, "b_attn": 4, "kv_residency": "host"}
        staging = {"staging_seqs": 4, "max_context": 64}
    job = make_job(policy, model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides=knobs)
    tree = PrefixTree([-1, -1, 0, 1, 0, 1], [13, 13, *[prefix] * 4]) if nested else None
    members = np.arange(n) % (n // group) if fetch else np.arange(n) // group
    job = dataclasses.replace(job, workload=Workload("grouped", inputs, outputs, prefix_group=members + 2 * nested,
                                                     prefix_len=np.full(n, prefix), prefix_tree=tree))
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), procs=2, timeout_s=30.0,
                                         kv_budget_mb=kv_mb_for(path, 2000, **staging)))
    if staging:
        assert out.kv_traffic["host_resident_seq_steps"] > 0 and out.kv_traffic["restored_bytes"] > 0
    state = out.prepared.state
    assert state.sharing and not state.table.recomputes.any()
    assert state.prefill_computed < int(inputs.sum()) - n * group  # 3 of a group's 4 members took 24 tokens or more
    assert out.kv_traffic["cascade_prefix_reads"] == state.cascade_prefix_read > 0
    if nested:  # groups 2 and 4 begin with system prompt 0, 3 and 5 with 1
        first = [int(np.flatnonzero(members == k)[0]) for k in range(n // group)]
        assert state.nested and list(out.tokens.prompts[first[0]][:13]) == list(out.tokens.prompts[first[2]][:13])
    if fetch:  # copied between the processes: the bytes the state priced (one node: peer)
        per_token = PagedKVCache.page_bytes(**read_config(path).kv_cache_geometry()._asdict(), page_size=1,
                                            dtype=torch.float32)
        assert state.prefix_fetched > 0
        assert out.kv_account.of("share")["peer"].sum() == state.prefix_fetched * per_token
    for sid in range(n):
        leader = int(np.flatnonzero(members == members[sid])[0])
        assert list(out.tokens.prompts[sid][:prefix]) == list(out.tokens.prompts[leader][:prefix]), sid
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid


def test_a_host_copy_resumed_onto_the_other_process_takes_the_prefix_there(saved, loop_kernel, monkeypatch):
    """A pool of 300 tokens per process on 2 processes: yielded members resume onto the process other than the one
    that holds their host copy; where that process holds their group's prefix they take it there and receive only
    the rest of their KV (`resume_prefix`), the tokens the state priced; outputs are transformers'."""
    from batchgen.dist import backend as dist_backend
    from batchgen.exec.account import KVAccount

    execute_plan = dist_backend.DistBackend.execute

    def pricing(self, plan):  # rank 0 (forked with this patch) adds up the host-to-device bytes the state priced
        result = yield from execute_plan(self, plan)
        self.traffic["priced h2d"] += int(np.asarray(plan.moves.h2d).sum())
        return result

    monkeypatch.setattr(dist_backend.DistBackend, "execute", pricing)
    model, path = saved
    rng = np.random.default_rng(5)
    n, prefix = 16, 29
    inputs, outputs = prefix + rng.integers(4, 30, n), rng.integers(4, 30, n)
    outputs[:2] = 60
    job = make_job("coroutine", model="tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"b_moe": 4, "b_attn": 4,
                                                                         "kv_residency": "device"})
    job = dataclasses.replace(job, workload=Workload("grouped", inputs, outputs, prefix_group=np.arange(n) // 4,
                                                     prefix_len=np.full(n, prefix)))
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), procs=2, timeout_s=30.0,
                                         kv_budget_mb=kv_mb_for(path, 300)))
    state = out.prepared.state
    assert state.prefix_resumed > 0
    acc: KVAccount = out.kv_account
    assert acc.of("migrate")["h2d"].sum() > 0  # resumes across processes, each of the rest of a sequence's KV
    # restores and resumes copied the tokens the state priced (it prices the job's spec, the processes run the
    # checkpoint: compared in tokens)
    per_token = PagedKVCache.page_bytes(**read_config(path).kv_cache_geometry()._asdict(), page_size=1,
                                        dtype=torch.float32)
    performed = int(acc.of("restore")["h2d"].sum() + acc.of("migrate")["h2d"].sum())
    assert performed / per_token == out.kv_traffic["priced h2d"] / state.kv_bytes_per_token
    for sid in range(n):
        assert out.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
