"""Host copies sharing their group's prefix on a node (batchgen.core.host_prefixes): counted once in host memory,
written once, let go by every way a copy goes, and what that buys coroutine on a long system prompt."""

import dataclasses

import numpy as np
import pytest

from batchgen.job import prepare
from batchgen.policy.base import Capabilities
from batchgen.results.metrics import summarize
from batchgen.sim.run import simulate
from batchgen.workload.spec import Workload
from conftest import make_job, priced

PAGE, PREFIX = 16, 200  # whole pages shared: 192 tokens


def grouped(n=6, inputs=(230, 250, 240, 260, 235, 245), group=(0, 0, 0, 1, 1, -1), host=True, **knobs):
    job = make_job("coroutine", model="qwen3_30b_a3b", n=n, inputs=np.array(inputs), outputs=np.full(n, 40),
                   page_tokens=PAGE, cluster_overrides={"num_gpus": 2, "gpus_per_node": 1, "gpus_per_instance": 2},
                   policy_overrides=knobs)
    job = dataclasses.replace(job, workload=Workload("grouped", job.workload.input_lens, job.workload.output_lens,
                                                     prefix_group=np.array(group),
                                                     prefix_len=np.where(np.array(group) >= 0, PREFIX, 0)))
    return job, prepare(job, host_prefixes=host).state


def to_host(state, ids, gpus):
    state.take_pending(0, ids)
    state.start_prefill_to_host(0, ids, gpus)
    state.prefilled_to_host(0, ids, gpus)


def test_a_nodes_host_copies_hold_their_groups_prefix_once():
    job, state = grouped()
    ctx = job.workload.input_lens
    to_host(state, np.arange(6), np.array([0, 0, 1, 0, 0, 0]))  # node 0: 0, 1 of group 0, 3, 4 of group 1, 5 alone
    shared = PREFIX // PAGE * PAGE
    assert state.host_prefixes == {(0, 0): [shared, 2], (1, 0): [shared, 1], (0, 1): [shared, 2]}
    assert state.host_held.tolist() == [shared] * 5 + [0]
    assert state.host_used.tolist() == [ctx[[0, 1, 3, 4, 5]].sum() - 2 * shared, ctx[2]]
    assert state.host_prefix_taken == 2 * shared  # members 1 and 4 wrote only their own tokens
    state.check()


def test_a_yield_writes_only_what_follows_its_nodes_prefix_and_the_last_holder_frees_it():
    job, state = grouped(n=3, inputs=(230, 250, 240), group=(0, 0, 0))
    ids, gpus = np.arange(3), np.zeros(3, np.int64)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, gpus, lookahead_tokens=1)
    state.advance(ids, np.ones(3, np.int64), host_sync=False)
    state.yield_(0, ids[:2])  # the first writes the prefix with its own KV, the second only the rest
    kv, shared = state.kv_bytes_per_token, PREFIX // PAGE * PAGE
    assert priced(state).d2h[0] == pytest.approx((230 + 250 - shared) * kv)
    ctx = state.table.context(ids)  # a copy counts every token of the context (a page of room for the newest)
    assert state.host_used[0] == ctx[0] + ctx[1] - shared
    state.combine(0, 0, np.array([0]), np.array([0]), lookahead_tokens=1, keep_host_copy=False)
    assert state.host_prefixes == {(0, 0): [shared, 1]} and state.host_used[0] == ctx[1]  # the prefix stays held
    state.check()
    state.combine(0, 0, np.array([1]), np.array([1]), lookahead_tokens=1, keep_host_copy=False)
    assert state.host_prefixes == {} and state.host_used[0] == 0
    state.check()


def test_a_copy_carried_to_another_node_arrives_whole_and_holds_none():
    job, state = grouped()
    to_host(state, np.arange(3), np.zeros(3, np.int64))
    state.combine(0, 0, np.array([0]), np.array([1]), lookahead_tokens=1)  # resumed on node 1: its copy goes there
    shared = PREFIX // PAGE * PAGE  # (its creator gone, the prefix stays with its other holders)
    assert state.host_held[0] == 0 and state.host_prefixes == {(0, 0): [shared, 2]}
    assert state.host_used.tolist() == [250 + 240 - shared, 230]
    state.check()


def test_without_the_backend_every_copy_is_whole():
    _, state = grouped(host=False)
    to_host(state, np.arange(6), np.zeros(6, np.int64))
    assert not state.host_sharing and state.host_used[0] == sum((230, 250, 240, 260, 235, 245))


def test_coroutine_keeps_more_in_flight_when_the_host_holds_a_system_prompt_once():
    """Qwen3-30B-A3B on 2 H100s of one node, 1,200 requests after one 3,072-token system prompt, host memory for
    about half of their whole copies: with every copy whole, the host watermark bounds what coroutine prefills and
    runs; with the prompt held once, the host stays far below it and the batch ends sooner."""
    rng = np.random.default_rng(1)
    n, prefix = 1200, 3072
    inputs, outputs = prefix + rng.integers(16, 128, n), rng.integers(64, 512, n)
    job = make_job("coroutine", model="qwen3_30b_a3b", n=n, inputs=inputs, outputs=outputs,
                   cluster_overrides={"num_gpus": 2, "host_mem_gb_per_node": 262})
    job = dataclasses.replace(job, workload=Workload("system", inputs, outputs, prefix_group=np.zeros(n, np.int64),
                                                     prefix_len=np.full(n, prefix)))
    on = simulate(job)
    off = simulate(job, capabilities=Capabilities(host_prefixes=False))  # a backend that keeps every copy whole
    budget = off.prepared.state.host_kv_tokens[0]
    assert int(inputs.sum()) > 2 * budget  # whole copies of every prompt would not fit
    assert not off.prepared.state.host_sharing and off.prepared.state.peak_host[0] > 0.65 * budget
    assert on.prepared.state.host_prefix_taken > 0 and on.prepared.state.peak_host[0] < 0.3 * budget
    assert summarize(on)["bct_s"] < summarize(off)["bct_s"]
