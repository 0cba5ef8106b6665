"""The simulator's fast paths (batchgen.fastpath) change nothing: every job simulated with them and with the
general code they skip takes the same decisions and ends with the same times, step by step, bit for bit."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

from batchgen import fastpath
from batchgen.decisions import first_difference, trace_of
from batchgen.latency.roofline import Roofline
from batchgen.memory import ConfigError
from batchgen.sim.run import simulate
from conftest import make_job
from test_sim_properties import POLICIES, build, jobs


def outcome(job):
    """Everything a run produces that the fast paths could change."""
    out = simulate(job, progress=False)
    t = out.prepared.state.table
    steps = [(r.instance, r.start, r.duration, r.phase, r.iterations, r.tokens, r.running, r.expert_tokens,
              r.expert_calls, np.asarray(r.rank_busy).tolist(), np.asarray(r.rank_comm).tolist(),
              sorted(r.modules.items())) for r in out.records]
    return dict(finish=t.finish_time.copy(), first=t.first_token_time.copy(), trace=trace_of(out.records),
                steps=steps, events=out.events, host_bytes=out.host_bytes,
                host_bytes_per_iteration=out.host_bytes_per_iteration)


def assert_same(fast, ref):
    diff = first_difference(fast["trace"], ref["trace"])
    assert diff is None, diff.describe()
    for key in ("finish", "first"):
        assert np.array_equal(fast[key], ref[key], equal_nan=True), key
    for k, (a, b) in enumerate(zip(fast["steps"], ref["steps"])):
        assert a == b, f"step {k}: {a} != {b}"
    for key in ("steps", "events", "host_bytes", "host_bytes_per_iteration"):
        assert fast[key] == ref[key], key


def both_ways(job):
    assert fastpath.ENABLED
    fast = outcome(job)
    with fastpath.reference():
        assert not fastpath.ENABLED
        ref = outcome(job)
    assert fastpath.ENABLED
    return fast, ref


def vidur_like(policy, n=150, **knobs):
    """A scaled-down sim_scale --policies job: Llama-2-7B on one A100, conversation-like lengths."""
    rng = np.random.default_rng(1)
    inputs, outputs = rng.integers(8, 3000, n), rng.integers(1, 600, n)
    job = make_job(policy, "llama2_7b", "a100_8", inputs, outputs, policy_overrides=knobs,
                   cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})
    return job


CASES = {
    **{f"{p}-a100": (lambda p=p: vidur_like(p)) for p in POLICIES if p != "pd_disagg"},  # it needs experts
    "pd_disagg-tiny-2x4": lambda: make_job("pd_disagg", "tiny_moe", "h100_8", n=80),
    "continuous-whole-prompts": lambda: vidur_like("continuous", chunked_prefill=False),
    "continuous-conservative": lambda: vidur_like("continuous", n=80, admission="conservative", token_budget=512),
    # several ranks and instances, host-resident KV, migration and partition: the general paths' territory
    "coroutine-host-2x8": lambda: dataclasses.replace(
        make_job("coroutine", "qwen3_30b_a3b", "h20_16", np.full(40, 3000), np.arange(1, 41) * 40,
                 policy_overrides={"kv_residency": "mixed", "b_moe": 8, "partition_min_context": 1024}),
    ),
    "static-tiny-8": lambda: make_job("static", "tiny_moe", "h100_8", n=80),
    "continuous-tiny-8": lambda: make_job("continuous", "tiny_moe", "h100_8", n=80,
                                          policy_overrides={"token_budget": 300}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_paths_reproduce_the_general_code(case):
    fast, ref = both_ways(CASES[case]())
    assert len(fast["steps"]) > 1
    assert_same(fast, ref)


def test_the_comparison_catches_a_shortcut_that_changes_a_price(monkeypatch):
    """A shortcut one part in 10^12 off is caught: the test above can fail."""
    job = vidur_like("continuous", n=40)
    honest = Roofline._gemm_lookup

    def off(self, *args):
        out = honest(self, *args)
        return None if out is None else out * (1 + 1e-12)

    monkeypatch.setattr(Roofline, "_gemm_lookup", off)
    fast, ref = both_ways(job)
    with pytest.raises(AssertionError):
        assert_same(fast, ref)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs)
def test_fast_paths_reproduce_the_general_code_on_random_jobs(p):
    try:
        job = dataclasses.replace(build(p), check_invariants=False)
        fast, ref = both_ways(job)
    except ConfigError:
        assume(False)
    assert_same(fast, ref)
