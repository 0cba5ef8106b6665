"""Shared prompt prefixes on the executor (batchgen.exec.kv_prefixes, from the state's `share` ops): sequences of
a group hold their prefix's pages by reference and prefill only the rest, and their greedy outputs are the
unshared run's and transformers' own, with room to spare and with a pool so small that sequences are preempted
while they share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from batchgen.core.prefix_fetch import PrefixFetch
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models.loading import read_config
from batchgen.exec.run import ExecSettings, execute
from batchgen import job as job_module
from batchgen.workload.spec import Workload
from conftest import make_job

from .test_deepseek import tiny_hf as tiny_deepseek
from .test_exec_parity import hf_greedy, kv_mb_for
from .test_models import tiny_hf

N, GROUP, PREFIX = 12, 4, 37  # a prefix that ends inside a page: its last part is each member's own


def grouped(policy: str, prefix_cache: bool, num_gpus: int = 2, token_budget: int = 40, **knobs):
    rng = np.random.default_rng(11)
    inputs = PREFIX + rng.integers(4, 20, N)  # a budget of 40: one prompt starts per forward
    outputs = rng.integers(4, 30, N)
    job = make_job(policy, "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": num_gpus, "gpus_per_instance": None},
                   policy_overrides={"prefix_cache": prefix_cache, **knobs,
                                     **({"token_budget": token_budget} if token_budget else {})})
    return dataclasses.replace(job, workload=Workload("grouped", inputs, outputs, prefix_group=np.arange(N) // GROUP,
                                                      prefix_len=np.full(N, PREFIX)))


class always_pays:  # noqa: N801 - stands in for batchgen.pricing.costs.cascade_pays; a class: a state pickles
    """A CascadeRule.pays that takes every candidate (tiny models' reads never pay for a call)."""

    def __init__(self, lat) -> None:
        pass

    def __call__(self, queries, context, members, prefix, micro_batch):
        return np.ones(members.size, bool)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_hf("qwen3_moe")
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return model, path


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy,kv_tokens,gpus,budget", [("continuous", 5000, 2, 40), ("continuous", 120, 2, 40),
                                                          ("continuous", 5000, 2, 4096), ("sglang_opt", 5000, 1, 40),
                                                          ("sglang_opt", 5000, 1, 4096), ("coroutine", 5000, 2, 0),
                                                          ("coroutine", 120, 2, 0), ("whole", 5000, 2, 0)])
def test_shared_prefix_outputs_equal_unshared_and_transformers(saved, policy, kv_tokens, gpus, budget):
    """A budget of 4,096 tokens starts every prompt in the first forward: its group's prefix is created and taken
    in the same forward (coroutine: its prefill forwards, to host). (sglang_opt pins each prompt to the rank with
    the least load, wherever its group's prefix is: on one GPU its members meet; a max_tokens of 64 lets its
    reserve admit several at once.)"""
    model, path = saved
    knobs = {"sglang_opt": {"two_batch_overlap": False, "reserve_max_tokens": 64},
             "coroutine": {"b_moe": 4, "b_attn": 4}, "whole": {"chunked_prefill": False}}.get(policy, {})
    policy = "continuous" if policy == "whole" else policy  # whole prompts prefilled onto the device
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, kv_tokens), threads=1)
    on = execute(grouped(policy, True, gpus, budget, **knobs), settings)
    off = execute(grouped(policy, False, gpus, budget, **knobs), settings)
    assert on.prepared.state.sharing and not off.prepared.state.sharing
    assert on.tokens.prompts[0][:PREFIX].tolist() == on.tokens.prompts[GROUP - 1][:PREFIX].tolist()
    t = on.prepared.state.table
    for sid in range(N):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(t.output_len[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid
    computed, submitted = on.prepared.state.prefill_computed, off.prepared.state.prefill_computed
    assert computed < submitted, (computed, submitted)
    if kv_tokens < 1000:  # the pool holds a few sequences: preempted or yielded ones let go of the prefix
        assert (t.recomputes + t.yields).sum() > 0
    elif policy == "coroutine":  # restored onto the GPU that prefilled them, they take the prefix kept there
        assert on.prepared.state.prefix_restored > 0
    if policy == "coroutine":  # their host copies hold their node's host prefix once
        assert on.prepared.state.host_prefix_taken > 0


@pytest.mark.usefixtures("one_thread")
def test_a_prefix_created_and_taken_in_one_forward_is_written_before_it_is_read(saved):
    """The creator's prompt is long and its group's others short: attention runs in calls of similar lengths,
    shortest first, so without the creator's call first the others would read its prefix before it is written."""
    model, path = saved
    inputs = np.array([PREFIX + 80, PREFIX + 3, PREFIX + 5, PREFIX + 4])
    outputs = np.array([6, 7, 5, 8])
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 5000), threads=1)
    runs = {}
    for on in (True, False):
        job = make_job("continuous", "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                       cluster_overrides={"num_gpus": 1, "gpus_per_instance": None},
                       policy_overrides={"prefix_cache": on, "token_budget": 4096})
        runs[on] = execute(dataclasses.replace(job, workload=Workload("grouped", inputs, outputs,
                                                                      prefix_group=np.zeros(4, np.int64),
                                                                      prefix_len=np.full(4, PREFIX))), settings)
    on, off = runs[True], runs[False]
    assert on.prepared.state.prefill_computed == int(inputs.sum()) - 3 * 32  # three members took 32 tokens each
    for sid in range(4):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(outputs[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("budget", [4096, 60])
def test_a_prefix_tail_below_a_page_is_copied_not_recomputed(saved, budget):
    """The prefix of 37 tokens ends 5 tokens into a page: with `prefix_tail` each member copies those 5 into its
    first own page (in the forward that writes them, from the creator's rows: budget 4,096; later, from the page
    the prefix keeps: budget 60, one prompt per forward), computes only the rest, and decodes what transformers
    and the unshared run decode."""
    model, path = saved
    inputs = np.array([PREFIX + 80, PREFIX + 3, PREFIX + 5, PREFIX + 4, PREFIX + 9])
    outputs = np.array([6, 7, 5, 8, 4])
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 5000), threads=1)
    runs = {}
    for tail in (True, False):
        job = make_job("continuous", "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                       cluster_overrides={"num_gpus": 1, "gpus_per_instance": None},
                       policy_overrides={"token_budget": budget, "prefix_tail": tail})
        runs[tail] = execute(dataclasses.replace(job, workload=Workload("grouped", inputs, outputs,
                                                                        prefix_group=np.zeros(5, np.int64),
                                                                        prefix_len=np.full(5, PREFIX))), settings)
    on, off = runs[True], runs[False]
    assert on.prepared.state.prefill_computed == int(inputs.sum()) - 4 * PREFIX  # four members took all 37
    assert off.prepared.state.prefill_computed == int(inputs.sum()) - 4 * 32    # ... or its whole pages only
    # the creator's 5 into the prefix's page and each taker's 5 into its own: the bytes the state priced
    per_token = PagedKVCache.page_bytes(**read_config(path).kv_cache_geometry()._asdict(), page_size=1,
                                        dtype=torch.float32)
    assert on.kv_account.of("share")["local"].sum() == 5 * 5 * per_token
    for sid in range(5):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(outputs[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


@pytest.mark.usefixtures("one_thread")
def test_a_prefix_copied_from_another_gpu_decodes_what_a_recomputed_one_does(saved):
    """Six groups interleaved over the queue, a few prompts prefilled per rank and forward on 4 GPUs: a rank without
    a group's prefix copies it from a rank that wrote it in an earlier forward (coroutine's `prefix_fetch`)
    instead of computing it again; the copies are the bytes the state priced, and every output is transformers'
    and the run without copies'."""
    model, path = saved
    rng = np.random.default_rng(3)
    n = 24
    inputs, outputs = PREFIX + rng.integers(4, 20, n), rng.integers(4, 30, n)
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 5000), threads=1)
    runs = {}
    for fetch in (True, False):
        job = make_job("coroutine", "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                       cluster_overrides={"num_gpus": 4, "gpus_per_instance": None},
                       policy_overrides={"b_moe": 4, "b_attn": 4, "prefill_tokens_per_rank": 100,
                                         "prefix_fetch": fetch})
        runs[fetch] = execute(dataclasses.replace(job, workload=Workload("grouped", inputs, outputs,
                                                                         prefix_group=np.arange(n) % 6,
                                                                         prefix_len=np.full(n, PREFIX))), settings)
    on, off = runs[True], runs[False]
    fetched = on.prepared.state.prefix_fetched
    assert fetched > 0 and on.prepared.state.prefill_computed < off.prepared.state.prefill_computed
    per_token = PagedKVCache.page_bytes(**read_config(path).kv_cache_geometry()._asdict(), page_size=1,
                                        dtype=torch.float32)
    assert on.kv_account.of("share")["peer"].sum() == fetched * per_token  # one node: over NVLink
    for sid in range(n):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(outputs[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


@pytest.mark.usefixtures("one_thread")
def test_a_host_copy_resumed_onto_another_gpu_takes_the_prefix_there(saved, monkeypatch):
    """A pool of 300 tokens per GPU on 2 GPUs: yielded members resume onto the other GPU than the one whose cache
    holds their host copy, which holds their group's prefix: they take it there and copy only the rest of their KV
    (`resume_anywhere`); members restored onto a GPU without it have it copied from the other first (`fetch`); and
    all decode what transformers and the unshared run decode."""
    model, path = saved
    fetch, copied = PrefixFetch.fetch_prefixes, []

    def counted(state, instance, ids, gpus, resuming=False):
        before = state.prefix_fetched
        fetch(state, instance, ids, gpus, resuming)
        copied.append(resuming * (state.prefix_fetched - before))

    monkeypatch.setattr(PrefixFetch, "fetch_prefixes", counted)
    rng = np.random.default_rng(5)
    n = 16
    inputs, outputs = PREFIX + rng.integers(4, 30, n), rng.integers(4, 30, n)
    outputs[:2] = 60
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 300), threads=1)
    runs = {}
    for share in (True, False):
        job = make_job("coroutine", "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                       cluster_overrides={"num_gpus": 2, "gpus_per_instance": None},
                       policy_overrides={"b_moe": 4, "b_attn": 4, "kv_residency": "device", "prefix_cache": share})
        runs[share] = execute(dataclasses.replace(job, workload=Workload(
            "grouped", inputs, outputs, prefix_group=np.arange(n) // 4, prefix_len=np.full(n, PREFIX))), settings)
    on, off = runs[True], runs[False]
    assert on.prepared.state.prefix_resumed > 0 and sum(copied) > 0
    for sid in range(n):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(outputs[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy,knobs", [("continuous", {"cascade_attention": "groups"}),
                                          ("coroutine", {"b_moe": 4, "b_attn": 2})])
def test_cascades_read_on_the_executor_what_the_engine_accounts(saved, monkeypatch, policy, knobs):
    """Members decoding together on a rank read their prefix once per call (batchgen.core.cascade): the
    executor's cascaded calls read exactly the prefix tokens the engine counted (and the simulator prices), and
    every output is the one without cascades and transformers'. (The tiny model's reads are too small to pay
    for a call on the rig's roofline, so every cascade is taken to pay here.)"""
    monkeypatch.setattr(job_module, "cascade_pays", always_pays)
    model, path = saved
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 5000), threads=1)
    budget = 40 if policy == "continuous" else 0
    on = execute(grouped(policy, True, 2, budget, **knobs), settings)
    off = execute(grouped(policy, True, 2, budget, **{**knobs, "cascade_attention": "off"}), settings)
    state = on.prepared.state
    assert on.kv_traffic["cascade_prefix_reads"] == state.cascade_prefix_read > 0
    assert off.kv_traffic["cascade_prefix_reads"] == off.prepared.state.cascade_prefix_read == 0
    assert state.decode_kv_read < off.prepared.state.decode_kv_read
    for sid in range(N):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(state.table.output_len[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


def test_batch_invariant_mode_runs_without_cascades(saved, monkeypatch):
    """Each query attends its own context alone there: the job's plans carry no cascade, whatever the policy says."""
    monkeypatch.setattr(job_module, "cascade_pays", always_pays)
    _, path = saved
    out = execute(grouped("coroutine", True, 2, 0), ExecSettings(device="cpu", model_path=str(path), threads=1,
                                                                  batch_invariant=True))
    assert out.prepared.state.sharing and out.prepared.state.cascade.mode == "off"
    assert out.kv_traffic["cascade_prefix_reads"] == out.prepared.state.cascade_prefix_read == 0


@pytest.fixture(scope="module")
def saved_mla(tmp_path_factory):
    model = tiny_deepseek()
    path = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(path)
    return model, path


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("weights", ["saved", "saved_mla"])
def test_host_resident_members_restore_their_prefix_once_per_call(weights, request):
    """Host-resident members of a group decoding on a rank form cascades (batchgen.core.cascade.staged_groups):
    each staged call restores the prefix's pages once, from its first member's host copy, and attends them once
    (GQA and MLA). The bytes the staging restores fall by exactly the prefix reads the engine saved (every decode
    staged, the same decisions), the executor's cascaded calls read what the engine counted, and every output is
    the one restored member by member and transformers'."""
    model, path = request.getfixturevalue(weights)
    knobs = {"b_moe": 8, "b_attn": 4, "kv_residency": "host"}
    page, longest = 8, -(-int(PREFIX + 20 + 30) // 8) * 8
    settings = ExecSettings(device="cpu", model_path=str(path), threads=1,
                            kv_budget_mb=kv_mb_for(path, 400, staging_seqs=4, max_context=longest))
    on = execute(grouped("coroutine", True, 2, 0, **knobs), settings)
    off = execute(grouped("coroutine", True, 2, 0, **{**knobs, "cascade_attention": "off"}), settings)
    state, plain = on.prepared.state, off.prepared.state
    # every decode staged (the other steps: each prompt's first token, made by its prefill)
    assert on.kv_traffic["host_resident_seq_steps"] == on.kv_traffic["seq_steps"] - N > 0
    assert on.kv_traffic["cascade_prefix_reads"] == state.cascade_prefix_read > 0
    assert off.kv_traffic["cascade_prefix_reads"] == plain.cascade_prefix_read == 0
    saved_tokens = plain.decode_kv_read - state.decode_kv_read
    assert saved_tokens > 0 and saved_tokens % page == 0  # whole pages of prefix, once per member but one
    per_token = PagedKVCache.page_bytes(**read_config(path).kv_cache_geometry()._asdict(), page_size=1,
                                        dtype=torch.float32)  # every layer's
    assert off.kv_traffic["restored_bytes"] - on.kv_traffic["restored_bytes"] == saved_tokens * per_token
    for sid in range(N):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(state.table.output_len[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


def nested(policy: str, prefix_cache: bool, tree: bool, num_gpus: int, **knobs):
    """Two system prompts (21 tokens: 5 into a page), each before three prompts (41 tokens in all) sampled three
    times; groups interleaved over the queue, so that levels are written, taken and copied in every order."""
    from batchgen.workload.prefix_tree import PrefixTree

    rng = np.random.default_rng(5)
    outer, inner, n = 21, 41, 18
    group = 2 + (np.arange(n) % 6)  # inner groups 2..7; 2, 4, 6 after system prompt 0, 3, 5, 7 after 1
    inputs, outputs = inner + rng.integers(4, 20, n), rng.integers(4, 30, n)
    levels = PrefixTree([-1, -1, 0, 1, 0, 1, 0, 1], [outer, outer, *[inner] * 6])
    job = make_job(policy, "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                   cluster_overrides={"num_gpus": num_gpus, "gpus_per_instance": None},
                   policy_overrides={"prefix_cache": prefix_cache, **knobs})
    return dataclasses.replace(job, workload=Workload("nested", inputs, outputs, prefix_group=group,
                                                      prefix_len=np.full(n, inner),
                                                      prefix_tree=levels if tree else None))


@pytest.mark.usefixtures("one_thread")
def test_three_nested_levels_written_in_one_forward_decode_what_transformers_do(saved):
    """A system prompt (11 tokens), two few-shot blocks after it (27), two questions after each (43), each question
    sampled four times, every prompt in one prefill forward (coroutine's, attention in calls of two): its writers
    run their attention in three waves, each after the writer of the level it reads; every output is transformers'
    and the unshared run's."""
    from batchgen.workload.prefix_tree import PrefixTree

    model, path = saved
    tree = PrefixTree([-1, 0, 0, 1, 1, 2, 2], [11, 27, 27, 43, 43, 43, 43])
    rng = np.random.default_rng(2)
    group = np.tile(np.arange(3, 7), 4)
    inputs, outputs = 43 + rng.integers(3, 15, group.size), rng.integers(4, 25, group.size)
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 5000), threads=1)
    runs = {}
    for share in (True, False):
        job = make_job("coroutine", "tiny_moe", inputs=inputs, outputs=outputs, page_tokens=8,
                       cluster_overrides={"num_gpus": 1, "gpus_per_instance": None},
                       policy_overrides={"prefix_cache": share, "b_moe": 16, "b_attn": 2,
                                         "prefill_tokens_per_rank": 4096})
        runs[share] = execute(dataclasses.replace(job, workload=Workload(
            "three", inputs, outputs, prefix_group=group, prefix_len=np.full(group.size, 43), prefix_tree=tree)),
            settings)
    on, off = runs[True], runs[False]
    # whole pages of 8: the first prompt writes all three levels (8, 24, 40 tokens); the second takes its block (24),
    # the third the system prompt (8, writing the other block), the fourth that block (24); the other twelve take
    # their question (40) and the 3 tokens of its tail
    assert on.prepared.state.prefill_computed == int(inputs.sum()) - (24 + 8 + 24 + 12 * 43)
    for sid in range(group.size):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(outputs[sid]))
        assert on.tokens.generated[sid] == off.tokens.generated[sid] == expected, sid


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy,gpus,knobs", [
    ("continuous", 1, {"token_budget": 40}), ("continuous", 2, {"token_budget": 4096}),
    ("continuous", 1, {"chunked_prefill": False}),
    ("coroutine", 2, {"b_moe": 4, "b_attn": 4}),
    ("coroutine", 4, {"b_moe": 4, "b_attn": 4, "prefill_tokens_per_rank": 100, "prefix_fetch": True})])
def test_nested_prefixes_decode_what_transformers_and_the_unshared_run_do(saved, policy, gpus, knobs):
    """A system prompt's pages held once on a GPU beneath each prompt's own level: every output is transformers'
    and the unshared run's (the same prompts), and fewer prompt tokens are computed than with one level of groups
    (each system prompt then computed again per prompt)."""
    model, path = saved
    settings = ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 5000), threads=1)
    runs = {name: execute(nested(policy, on, tree, gpus, **knobs), settings)
            for name, on, tree in (("nested", True, True), ("flat", True, False), ("off", False, True))}
    on = runs["nested"]
    assert on.prepared.state.nested and on.tokens.prompts[0][:21].tolist() == on.tokens.prompts[2][:21].tolist()
    computed = {name: out.prepared.state.prefill_computed for name, out in runs.items()}
    assert computed["nested"] < computed["flat"] < computed["off"], computed
    t = on.prepared.state.table
    for sid in range(len(t)):
        expected = hf_greedy(model, on.tokens.prompts[sid], int(t.output_len[sid]))
        assert on.tokens.generated[sid] == runs["off"].tokens.generated[sid] == expected, sid
