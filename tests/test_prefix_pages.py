"""Shared prompt prefixes in the simulator (batchgen.core.prefix_pages): over random grouped workloads, squeezed KV
pools, both chunked-prefill admissions and coroutine's prefill forwards, every boundary's recount holds (no shared page freed while held, none
leaked, no GPU over capacity), every sequence finishes, and sharing computes fewer prompt tokens, never fewer than
the distinct ones."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from batchgen.core.sequences import FINISHED, InvariantError
from batchgen.memory import ConfigError, MemorySettings
from batchgen.policy.base import Capabilities
from batchgen.results.metrics import bct
from batchgen.sim.run import simulate
from batchgen.workload.prefixes import prefill_tokens_distinct
from batchgen.workload.spec import Workload
from conftest import make_job


def grouped_job(policy="continuous", n=48, group_size=4, prefix=200, suffix=(1, 80), max_out=120, page_tokens=16,
                seed=0, kv_gb=None, num_gpus=2, host_gb=None, outer=0, **knobs):
    """Groups of `group_size` sharing `prefix` tokens; with `outer`, the groups' prefixes begin with one of two
    system prompts of `outer` tokens (nested levels), the groups interleaved over the queue."""
    from batchgen.workload.prefix_tree import PrefixTree

    rng = np.random.default_rng(seed)
    inputs = prefix + rng.integers(suffix[0], suffix[1] + 1, n)
    outputs = rng.integers(1, max_out + 1, n)
    group = np.arange(n) // group_size
    tree = None
    if outer:
        count = int(group[-1]) + 1
        group = 2 + (np.arange(n) % count)
        tree = PrefixTree([-1, -1, *(np.arange(count) % 2)], [outer, outer, *[prefix] * count])
    job = make_job(policy, "qwen3_30b_a3b", "h100_8", inputs, outputs, page_tokens=page_tokens,
                   policy_overrides=knobs, cluster_overrides={"num_gpus": num_gpus,
                                                              **({"host_mem_gb_per_node": host_gb} if host_gb else {})})
    job = dataclasses.replace(job, workload=Workload("grouped", inputs, outputs, prefix_group=group,
                                                     prefix_len=np.full(n, prefix), prefix_tree=tree))
    if kv_gb:  # a KV pool of about kv_gb per GPU: preemptions (evictions) while prefixes are shared
        from batchgen.job import prepare
        probe = prepare(job)
        usable = job.cluster.gpu.hbm_bytes / 1e9 * job.memory.gpu_memory_fraction
        weights = (probe.budget.weights_per_gpu_bytes + probe.budget.activation_bytes) / 1e9
        job = dataclasses.replace(job, memory=MemorySettings(activation_reserve_gb=max(usable - weights - kv_gb, 0)))
    return job


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({
    "policy": st.sampled_from(["continuous", "sglang_opt", "coroutine"]),
    "group_size": st.sampled_from([1, 3, 16]),
    "prefix": st.integers(1, 600),
    "page_tokens": st.sampled_from([16, 64]),
    "token_budget": st.sampled_from([64, 300, 8192]),
    "kv_gb": st.sampled_from([None, 0.05]),
    "seed": st.integers(0, 2**16),
    "residency": st.sampled_from(["device", "mixed", "host"]),  # coroutine's
    "host_gb": st.sampled_from([None, 68.2, 68.5]),  # GB of host memory per node: 3,216 or 5,962 KV tokens
    "outer": st.sampled_from([0, 0, 5, 40]),  # tokens of a system prompt before the groups' own (nested levels)
}))
@example({  # prefixes kept for members still to start filled a 31-page pool: nothing could start (now dropped then)
    "policy": "continuous", "group_size": 3, "prefix": 158, "page_tokens": 16, "token_budget": 64, "kv_gb": 0.05,
    "seed": 0, "residency": "device", "host_gb": None, "outer": 0})
def test_shared_pages_are_counted_exactly_and_every_sequence_finishes(p):
    knobs = {"token_budget": p["token_budget"]}
    if p["policy"] == "sglang_opt":
        knobs["two_batch_overlap"] = False
    if p["policy"] == "coroutine":  # its prefill forwards share (to host), and so do its host copies on a node
        knobs = {"kv_residency": p["residency"], "prefill_tokens_per_rank": p["token_budget"]}
    try:
        outer = min(p["outer"], p["prefix"] - 1)
        job = grouped_job(p["policy"], group_size=p["group_size"], prefix=p["prefix"], page_tokens=p["page_tokens"],
                          seed=p["seed"], kv_gb=p["kv_gb"], host_gb=p["host_gb"], outer=outer, **knobs)
        out = simulate(job)  # check_invariants: pages, prefixes and holders recounted at every boundary
    except ConfigError:
        assume(False)  # a pool squeezed below one sequence is refused up front
        return
    state, t = out.prepared.state, out.prepared.state.table
    assert state.sharing
    assert np.all(t.where == FINISHED) and np.array_equal(t.decoded, t.output_len)
    assert not state.prefixes and not state.prefix_held.any() and not state.pages_used.any()
    assert state.host_sharing and not state.host_prefixes and not state.host_held.any() and not state.host_used.any()
    assert np.all(state.peak_pages <= state.gpu_pages)
    w = job.workload
    distinct = prefill_tokens_distinct(w.input_lens, w.prefix_group, w.prefix_len, w.prefix_tree)
    assert state.prefill_computed >= distinct
    if not t.recomputes.any():
        assert state.prefill_computed <= int(w.input_lens.sum())


@pytest.mark.parametrize("policy,knobs", [("continuous", {"token_budget": 1024}), ("continuous", {}),
                                          ("coroutine", {})])
def test_sharing_computes_each_groups_prefix_about_once_per_gpu(policy, knobs):
    job = grouped_job(policy, n=64, group_size=16, prefix=512, page_tokens=16, num_gpus=2, **knobs)
    on = simulate(job)
    off = simulate(dataclasses.replace(job, policy=dataclasses.replace(job.policy, prefix_cache=False)))
    assert not off.prepared.state.sharing
    w = job.workload
    submitted = int(w.input_lens.sum())
    assert off.prepared.state.prefill_computed == submitted
    computed = on.prepared.state.prefill_computed
    # 4 groups on 2 GPUs: a prefix is computed by the members whose prefill starts before it is written there
    assert computed < submitted / 2
    assert bct(on) < bct(off)


def test_a_prefix_tail_below_a_page_is_copied_and_priced_not_recomputed(monkeypatch):
    """A prefix of 200 tokens on pages of 16: 12 whole pages held by reference and 8 tokens below a page, which with
    `prefix_tail` every member but each group's first copies (its computed tokens fewer by them) and the run pays
    for (a copy within the GPU, on the simulator's clock)."""
    from batchgen.latency.roofline import Roofline

    job = grouped_job("continuous", n=32, group_size=8, prefix=200, page_tokens=16, num_gpus=1, token_budget=4096,
                      prefix_tail=True)
    off = simulate(dataclasses.replace(job, policy=dataclasses.replace(job.policy, prefix_tail=False)))
    on = simulate(job)
    submitted, takers = int(job.workload.input_lens.sum()), 32 - 4
    assert off.prepared.state.prefill_computed == submitted - takers * 192
    assert on.prepared.state.prefill_computed == submitted - takers * 200
    monkeypatch.setattr(Roofline, "local_copy", lambda self, nbytes: np.where(np.asarray(nbytes) > 0, 1.0, 0.0))
    assert bct(simulate(job)) > bct(on) + 0.99  # the copies are on the clock (1 s instead of microseconds)
    assert bct(simulate(dataclasses.replace(job, policy=off.prepared.policy))) == bct(off)  # none without tails


def test_a_prefix_tails_page_goes_when_its_holder_needs_it():
    """A pool of 31 pages holding a prefix of 17 whole pages and its tail's page beside its last holder's 12 own
    pages: the holder's last page needs the tail's, which goes (later takers would compute those tokens); before,
    the run stopped with no progress."""
    job = grouped_job("continuous", n=24, group_size=6, prefix=280, page_tokens=16, seed=15, kv_gb=0.05, num_gpus=1,
                      token_budget=8192, prefix_tail=True)
    out = simulate(job)  # check_invariants: pages and prefixes recounted at every boundary
    assert np.all(out.prepared.state.table.where == FINISHED)


def test_a_host_copy_resumed_onto_another_gpu_takes_the_prefix_there_and_restores_the_rest():
    """Yielded members resumed onto a GPU of their node other than the one whose cache holds their host copy take
    their group's prefix there when it holds it, or has it copied from a sibling GPU (`resume_anywhere`), and the
    refill counts the pages they take (`RestoreTakes`): 12 groups of 16 on 4 GPUs with 0.5 GB of KV each restore
    15 GB from host instead of 77 and end in 1.70 s instead of 2.08 s; a backend without it (the capability off)
    copies them whole."""
    job = grouped_job("coroutine", n=192, group_size=16, kv_gb=0.5, num_gpus=4, seed=1)
    on, off = simulate(job), simulate(job, capabilities=Capabilities(resume_prefix=False))
    assert on.prepared.state.prefix_resumed > 0 and off.prepared.state.prefix_resumed == 0
    assert on.h2d_bytes < off.h2d_bytes / 2 and bct(on) < 0.9 * bct(off)


def test_a_prefix_another_gpu_holds_is_copied_and_priced_not_recomputed(monkeypatch):
    """Eight groups interleaved over the queue on 4 GPUs: a GPU without a group's prefix that another GPU wrote in
    an earlier forward copies it from there (coroutine's `prefix_fetch`, core.prefix_fetch), computing fewer
    tokens, and the simulator prices the copy (NVLink: one node's GPUs)."""
    from batchgen.core.ops import KVOps

    job = grouped_job("coroutine", n=64, group_size=8, prefix=200, page_tokens=16, num_gpus=4,
                      prefill_tokens_per_rank=1000)
    w = job.workload
    job = dataclasses.replace(job, workload=Workload("grouped", w.input_lens, w.output_lens,
                                                     prefix_group=np.arange(64) % 8, prefix_len=w.prefix_len))
    on = simulate(job)  # check_invariants: the copied prefixes' pages counted at every boundary
    off = simulate(dataclasses.replace(job, policy=dataclasses.replace(job.policy, prefix_fetch=False)))
    fetched = on.prepared.state.prefix_fetched
    assert fetched > 0 and not off.prepared.state.prefix_fetched
    assert on.prepared.state.prefill_computed < off.prepared.state.prefill_computed
    priced = []  # the bytes of the copies, as the simulator prices them (NVLink here: one node)
    moves = KVOps.moves

    def pricing(self, num_gpus):
        m = moves(self, num_gpus)
        priced.append(float(self.share_bytes[self._share_src() >= 0].sum()) if self.share_bytes.size else 0.0)
        return m

    monkeypatch.setattr(KVOps, "moves", pricing)
    again = simulate(job)
    assert bct(again) == bct(on) and sum(priced) == fetched * job.model.kv_bytes_per_token


@pytest.mark.parametrize("n,group_size,chunk,again", [(96, 16, 600, 0), (128, 32, 1000, 0), (64, 64, 6000, 3),
                                                      (256, 256, 1000, 0)])
def test_coroutine_computes_each_shared_token_once_but_at_the_queues_end(n, group_size, chunk, again):
    """Groups whose prefix ends inside a page, spread over 4 GPUs in forwards of `chunk` tokens per rank: each
    group's prefix is written once (a second GPU copies it, the prompts that would write it again wait a forward)
    and its tail is copied, so the prefill computes the distinct tokens exactly; except at the queue's end, spread
    evenly: one group whose 64 prompts all fit the first forward is written on each rank."""
    job = grouped_job("coroutine", n=n, group_size=group_size, prefix=200, page_tokens=16, num_gpus=4,
                      prefill_tokens_per_rank=chunk)
    out = simulate(job)
    w = job.workload
    assert out.prepared.state.prefill_computed == prefill_tokens_distinct(w.input_lens, w.prefix_group,
                                                                          w.prefix_len) + again * 200
    assert (out.prepared.state.prefix_fetched > 0) == (not again)


def test_partition_refuses_a_sequence_that_holds_a_shared_prefix():
    job = grouped_job(n=8, group_size=8, prefix=64, page_tokens=16, num_gpus=1)
    from batchgen.job import prepare
    state = prepare(job).state
    t = state.table
    first = np.array([0])
    state.take_pending(0, first)
    state.prefill_chunks(0, first, np.array([0]), np.array([0]), np.array([int(t.input_len[0])]))
    assert state.prefix_held[0] == 64 and state.pages_used[0] == t.pages[0] + 4
    t.decoded[0] = 1  # its prefill's token
    with pytest.raises(InvariantError, match="holding no shared prefix"):
        state.partition(0, first, np.array([1]))
    state.check()


def test_a_restore_home_counts_the_levels_copied_there_before_it():
    """Nested levels (a 10-token system prompt before groups of 4 sharing 89) over 4 GPUs, coroutine copying levels
    between GPUs: a host copy restored onto its home GPU, which lacks its group's level, has it copied from a sibling
    first, tail page and all; the refill counts those pages (`restore_shares`), where it used to count only the level
    there and overfill the GPU by the copy's tail page."""
    job = grouped_job("coroutine", n=96, group_size=4, prefix=89, page_tokens=16, seed=20, kv_gb=0.2, num_gpus=4,
                      outer=10, kv_residency="mixed", prefill_tokens_per_rank=8192, prefix_fetch=True)
    out = simulate(job)  # check_invariants: no GPU over its pages at any boundary
    assert np.all(out.prepared.state.table.where == FINISHED) and out.prepared.state.prefix_fetched > 0
