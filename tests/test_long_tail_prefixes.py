"""experiments/long_tail.py's RSA rounds carry prefix groups: each problem's prompts share its statement."""

from __future__ import annotations

import numpy as np

from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from batchgen.workload import Workload
from experiments.long_tail import RSA_PROBLEM_TOKENS, rsa_workload

PROBLEMS, POPULATION = 3, 4


def test_first_round_shares_the_whole_prompt_later_rounds_the_problem():
    n = PROBLEMS * POPULATION
    first = rsa_workload("r0", np.full(n, RSA_PROBLEM_TOKENS), np.full(n, 8), POPULATION)
    assert first.prefill_tokens() == {"prefill_tokens_submitted": n * RSA_PROBLEM_TOKENS,
                                      "prefill_tokens_distinct": PROBLEMS * RSA_PROBLEM_TOKENS}
    prompts = RSA_PROBLEM_TOKENS + np.arange(n) * 100  # the problem, then K candidates of varied length
    later = rsa_workload("r1", prompts, np.full(n, 8), POPULATION).prefill_tokens()
    # only the problem statement is shared: (population - 1) copies of it per problem are saved
    assert later["prefill_tokens_submitted"] - later["prefill_tokens_distinct"] == (
        PROBLEMS * (POPULATION - 1) * RSA_PROBLEM_TOKENS)


def test_groups_change_nothing_without_prefix_caching_and_share_with_it():
    """With `prefix_cache` off the rounds' BCTs and counts stay as the ungrouped workload's; with it on each
    problem's statement is computed less often, and no sequence finishes later than without sharing by much."""
    n = PROBLEMS * POPULATION
    rng = np.random.default_rng(0)
    prompts, outputs = RSA_PROBLEM_TOKENS + rng.integers(0, 512, n), rng.integers(1, 64, n)
    runs = []
    for w, cache in ((Workload("plain", prompts, outputs), True), (rsa_workload("grouped", prompts, outputs,
                                                                              POPULATION), False),
                     (rsa_workload("grouped", prompts, outputs, POPULATION), True)):
        policy = make_policy({"name": "coroutine", "prefix_cache": cache})
        runs.append(simulate(Job(load_model("tiny_moe"), load_cluster("h100_8"), w, policy)).prepared.state)
    plain, off, on = runs
    np.testing.assert_array_equal(plain.table.finish_time, off.table.finish_time)
    assert on.sharing and not off.sharing
    assert on.prefill_computed < off.prefill_computed == int(prompts.sum())
    assert on.table.finish_time.max() < off.table.finish_time.max()
