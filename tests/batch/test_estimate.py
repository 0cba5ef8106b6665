"""batchgen.batch.estimate: the completion-time estimate of a batch job, per policy, from prompt lengths and
max_tokens alone."""

import dataclasses
import math

import numpy as np
import pytest

from batchgen.batch.estimate import (DEFAULT_OUTPUT, EstimateInput, describe_output, draw_output_lens, estimate,
                                     format_estimate, group_share, independent_groups, straggler_group)
from batchgen.job import Job, prepare
from batchgen.latency import load_efficiency
from batchgen.policy import make_policy
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from batchgen.workload import Workload

LONGTAIL = {"kind": "longtail", "mean": 100}


def make_input(n=200, seed=1, max_tokens=2000, ignore_every=0):
    rng = np.random.default_rng(seed)
    ignore = np.zeros(n, bool)
    if ignore_every:
        ignore[::ignore_every] = True
    return EstimateInput(rng.integers(16, 256, n), np.full(n, max_tokens) if np.isscalar(max_tokens)
                         else np.asarray(max_tokens), ignore)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny_moe"), dataclasses.replace(load_cluster("h100_8"), num_gpus=2)


@pytest.mark.parametrize("output", [DEFAULT_OUTPUT, LONGTAIL, {"kind": "uniform", "low": 1, "high": 5000},
                                    {"kind": "max_tokens"}])
def test_draw_output_lens_respects_max_tokens_and_ignore_eos(output):
    rng = np.random.default_rng(0)
    n = 2000
    inp = EstimateInput(rng.integers(1, 500, n), rng.integers(1, 700, n), rng.random(n) < 0.2)
    lens = draw_output_lens(inp, output, seed=3)
    assert lens.dtype == np.int64 and lens.shape == (n,)
    assert (lens >= 1).all() and (lens <= inp.max_tokens).all()
    assert (lens[inp.ignore_eos] == inp.max_tokens[inp.ignore_eos]).all()
    if output.get("kind") != "max_tokens":  # a distribution: some requests stop before max_tokens
        assert (lens[~inp.ignore_eos] < inp.max_tokens[~inp.ignore_eos]).any()
    assert (draw_output_lens(inp, output, seed=3) == lens).all()  # seeded
    if output.get("kind") != "max_tokens":
        assert not (draw_output_lens(inp, output, seed=4) == lens).all()


def test_default_output_is_the_azure_conversation_trace():
    inp = make_input(n=5000, max_tokens=100_000)
    lens = draw_output_lens(inp, DEFAULT_OUTPUT, seed=0)
    assert lens.max() <= 1000 and 100 < np.median(lens) < 160  # the trace: median 129, max 1000
    assert "Azure" in describe_output(DEFAULT_OUTPUT)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="kind"):
        draw_output_lens(make_input(10), {"kind": "lognormal"}, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        EstimateInput(np.array([5, 6]), np.array([0, 3]), np.zeros(2, bool))
    with pytest.raises(ValueError, match="one length"):
        EstimateInput(np.array([5, 6]), np.array([3]), np.zeros(2, bool))


def test_one_row_per_policy_and_coroutine_beats_static_on_a_long_tail(tiny):
    model, cluster = tiny
    inp = make_input()
    policies = [{"name": "coroutine"}, {"name": "continuous"}, {"name": "static"}]
    rows = estimate(model, cluster, inp, policies, output=LONGTAIL, seed=0, workers=1)
    assert [r.policy for r in rows] == ["coroutine", "continuous", "static"]
    outputs = draw_output_lens(inp, LONGTAIL, 0)
    for r in rows:
        assert r.ok and r.bct_s > 0 and r.wall_s > 0 and r.simulated_requests == len(inp)
        assert r.tokens_per_s == pytest.approx(outputs.sum() / r.bct_s)
    by = {r.policy: r for r in rows}
    # static runs padded fixed batches to completion: the tail holds every batch (measured: ~2.3x here)
    assert by["coroutine"].bct_s < by["static"].bct_s
    # the figures are the simulator's own for the same job
    job = Job(model, cluster, Workload("x", inp.prompt_lens, outputs), make_policy({"name": "static"}),
              efficiency=load_efficiency({"auto": True}, cluster.gpu.name))
    assert by["static"].bct_s == pytest.approx(float(np.nanmax(simulate(job).prepared.state.table.finish_time)))


def test_a_policy_that_cannot_fit_gets_an_error_row(tiny):
    model, cluster = tiny
    inp = make_input(n=100)
    policies = [{"name": "static", "batch_size": 10**7}, {"name": "coroutine"}]
    rows = estimate(model, cluster, inp, policies, output=LONGTAIL, workers=1)
    assert [r.policy for r in rows] == ["static", "coroutine"]
    assert not rows[0].ok and "GB" in rows[0].error and math.isnan(rows[0].bct_s)
    assert rows[1].ok and rows[1].bct_s > 0
    text = format_estimate(rows, inp, LONGTAIL, model, cluster)
    assert "static" in text and "cannot run this job" in text


def test_a_malformed_policy_config_fails_before_anything_runs(tiny):
    with pytest.raises(ValueError, match="no setting"):
        estimate(*tiny, make_input(10), [{"name": "coroutine"}, {"name": "static", "batchsize": 4}], workers=1)


def test_format_states_the_output_assumption_and_the_guessed_prompts(tiny):
    model, cluster = tiny
    inp = dataclasses.replace(make_input(n=60, ignore_every=3), approximate_prompts=True)
    rows = estimate(model, cluster, inp, [{"name": "coroutine"}], workers=1)
    text = format_estimate(rows, inp, DEFAULT_OUTPUT, model, cluster)
    assert "output lengths are unknown" in text and "Azure LLM conversation trace" in text
    assert "max_tokens" in text and "20 request(s) with ignore_eos" in text
    assert "prompt lengths are approximate" in text
    assert "groups" not in text  # simulated whole: no share approximation to state


def test_groups_and_the_round_robin_share():
    moe = load_model("tiny_moe")
    c = dataclasses.replace(load_cluster("h20_16"), gpus_per_instance=8)
    assert independent_groups(moe, c) == (2, 8)
    assert independent_groups(moe, load_cluster("h20_128")) == (2, 64)
    assert independent_groups(moe, load_cluster("h100_8")) == (1, 8)
    # the share holds exactly the requests prepare() sends to the first group's instances, in order
    c4 = dataclasses.replace(load_cluster("h100_8"), num_gpus=32, gpus_per_instance=8)  # 4 instances, 4 groups
    rng = np.random.default_rng(0)
    w = Workload("x", rng.integers(16, 64, 23), rng.integers(1, 20, 23))
    state = prepare(Job(moe, c4, w, make_policy({"name": "coroutine"}))).state
    for group in range(4):
        sub, idx, groups = group_share(moe, c4, 23, group)
        assert groups == 4 and sub.num_gpus == 8 and sub.num_instances == 1
        assert idx.tolist() == np.flatnonzero(state.table.instance == group).tolist() == list(range(group, 23, 4))
    # two 2-instance groups: the second group's requests fall on its instances in round-robin order
    c2 = dataclasses.replace(c4, gpus_per_instance=4, gpus_per_node=8)  # 8 instances of 4 GPUs, 4 nodes
    sub, idx, groups = group_share(moe, c2, 40, 1)
    assert groups == 4 and sub.num_instances == 2
    assert idx.tolist() == [i for i in range(40) if (i % 8) // 2 == 1]
    assert straggler_group(moe, c4, np.ones(23, np.int64), np.where(np.arange(23) == 6, 99, 1)) == 2


def test_the_share_is_stated_and_close_to_the_whole_cluster(tiny):
    model = tiny[0]
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=4, gpus_per_node=2, gpus_per_instance=2)
    inp = make_input(n=200)
    policies = [{"name": "coroutine"}, {"name": "static"}]
    whole = estimate(model, cluster, inp, policies, output=LONGTAIL, share=False, workers=1)
    half = estimate(model, cluster, inp, policies, output=LONGTAIL, share=True, workers=2)  # also: in processes
    for w, h in zip(whole, half):
        assert w.simulated_requests == 200 and h.simulated_requests == 100
        # the simulated group is the one the longest request lands in: it sets the BCT (measured: equal here)
        assert h.bct_s == pytest.approx(w.bct_s, rel=0.05)
    text = format_estimate(half, inp, LONGTAIL, model, cluster)
    assert "one of the cluster's 2 independent groups of 2 GPUs" in text and "100 of 200 requests" in text
    assert "approximation" in text and "longtail distribution (mean=100)" in text
    assert "groups" not in format_estimate(whole, inp, LONGTAIL, model, cluster)


def test_the_estimate_counts_a_requests_choices_sharing_their_prompt(tiny):
    """n choices of a request share its whole prompt: with prefix caching on, the simulated job prefills each
    prompt about once per GPU, and finishes sooner than with it off."""
    model, cluster = tiny
    rng = np.random.default_rng(4)
    requests, n = 16, 8
    prompts = np.repeat(rng.integers(400, 900, requests), n)
    group = np.repeat(np.arange(requests), n)
    inp = EstimateInput(prompts, np.full(prompts.size, 64), np.zeros(prompts.size, bool), requests=requests,
                        prefix_group=group, prefix_len=prompts)
    rows = estimate(model, cluster, inp, [{"name": "continuous"}, {"name": "continuous", "prefix_cache": False}],
                    output={"kind": "max_tokens"}, seed=0, workers=1, share=False)
    on, off = rows
    assert on.ok and off.ok and on.bct_s < off.bct_s
