"""Prefill budgets count the tokens a forward computes, not the prompt tokens it takes from shared prefixes
(batchgen.policy.prefix_budget): the split's rules, and the engine computing exactly what the policy budgeted."""

import dataclasses

import numpy as np
import pytest

import batchgen.engine.apply as apply
from batchgen.policy.prefix_budget import ForwardPrefixes, computed_whole, split_sharing, spread_sharing
from batchgen.sim.run import simulate
from test_prefix_pages import grouped_job


class View:
    """A prefix cache as a policy reads it: groups, shared tokens and the prefixes already on ranks."""

    def __init__(self, group, shared, there=None, span=None, outer=None):
        self._group, self._shared = np.array(group), np.array(shared)
        self._span = self._shared if span is None else np.array(span)
        # (rank, group) -> tokens, or (tokens, tail): a prefix there (with the tail a taker copies)
        self._there = {k: v if isinstance(v, tuple) else (v, 0) for k, v in (there or {}).items()}
        self._outer = outer or {}  # group -> (its outer group, that one's tokens): nested levels

    def levels(self, ids):
        out = []
        for g, n in zip(self._group[ids].tolist(), self._shared[ids].tolist()):
            chain = [] if g < 0 or not n else [(g, n)]
            while chain and chain[0][0] in self._outer:
                chain.insert(0, self._outer[chain[0][0]])
            out.append(chain)
        return out

    def group(self, ids):
        return self._group[ids]

    def shared_tokens(self, ids):
        return self._shared[ids]

    def shared_span(self, ids):
        return self._span[ids]

    def on_ranks(self):
        return dict(self._there)


def test_the_first_of_a_group_on_a_rank_computes_its_prefix_and_the_rest_only_their_own_tokens():
    # six prompts of 1,100 tokens sharing 1,024; a budget of 1,400 computed tokens per rank
    view = View([0] * 6, [1024] * 6)
    ranks, computed = split_sharing(np.arange(6), np.full(6, 1100), np.array([1400, 1400]), view)
    # 1,100 + 3 x 76 fit 1,400 and a fourth taker does not: on rank 1 the next writes the prefix again
    assert ranks.tolist() == [0, 0, 0, 0, 1, 1]
    assert computed.tolist() == [1100, 76, 76, 76, 1100, 76]


def test_a_prefix_already_on_a_rank_is_taken_and_a_shorter_one_is_not():
    view = View([0, 0, 1, -1], [1024, 1024, 512, 0], there={(0, 0): 1024, (0, 1): 768})
    ranks, computed = split_sharing(np.arange(4), np.array([1100, 1100, 600, 300]), np.array([10_000]), view)
    # group 1's prefix on rank 0 is longer than what its prompt shares: computed whole, and not written again
    assert ranks.tolist() == [0, 0, 0, 0] and computed.tolist() == [76, 76, 600, 300]
    assert computed_whole(view, np.arange(4), [1100, 1100, 600, 300], 1, {}) == [1100, 76, 600, 300]


def test_a_prompt_goes_to_the_rank_that_holds_its_groups_prefix_while_it_has_budget():
    # group 0's prefix is on rank 1 already; group 1 starts on rank 0, the rank being filled
    view = View([1, 0, 0, 1, 0], [512] * 5, there={(1, 0): 512})
    ranks, computed = split_sharing(np.arange(5), np.full(5, 600), np.array([1000, 300]), view)
    # group 0's members take rank 1's prefix (88 tokens each, 264 of its 300); group 1's second member follows its
    # first to rank 0
    assert ranks.tolist() == [0, 1, 1, 0, 1] and computed.tolist() == [600, 88, 88, 88, 88]


def test_ranks_without_budget_take_nothing_and_each_rank_with_budget_takes_one():
    view = View([0, 0, 0], [64, 64, 64])
    ranks, computed = split_sharing(np.arange(3), np.array([5000, 5000, 5000]), np.array([0, 100, 100]), view)
    assert ranks.tolist() == [1, 2] and computed.tolist() == [5000, 5000]


_TAKE_PREFILL, _TAKE_PREFIXES = apply._take_prefill, apply._take_prefixes


def _forwards(monkeypatch, job):
    """Simulate `job`; returns each forward's computed prefill tokens per rank, and the chunks the engine cut."""
    seen, cut = [], []
    take_prefill, take_prefixes = _TAKE_PREFILL, _TAKE_PREFIXES

    def prefill(state, instance, d, gpus):
        at = take_prefill(state, instance, d, gpus)
        tokens = state.table.context(d.prefill_ids) + 1 - (at if at.size else 0)
        seen.append(np.bincount(d.prefill_ranks, weights=tokens, minlength=gpus.size))
        return at

    def prefixes(state, instance, ids, gpus, starts, lens):
        out = take_prefixes(state, instance, ids, gpus, starts, lens)
        cut.append(int((out[1] != lens).sum()))
        return out

    monkeypatch.setattr(apply, "_take_prefill", prefill)
    monkeypatch.setattr(apply, "_take_prefixes", prefixes)
    out = simulate(job)
    return out, seen, cut


def test_coroutine_fills_its_prefill_forwards_with_computed_tokens(monkeypatch):
    job = grouped_job("coroutine", n=96, group_size=24, prefix=960, suffix=(8, 60), page_tokens=16, num_gpus=2,
                      prefill_tokens_per_rank=2048)
    on, fwd_on, _ = _forwards(monkeypatch, job)
    off, fwd_off, _ = _forwards(monkeypatch, dataclasses.replace(
        job, policy=dataclasses.replace(job.policy, prefix_cache=False)))
    for per_rank in fwd_on:  # a prompt of at most 1,020 tokens: never one alone over the budget
        assert per_rank.max() <= 2048
    # whole prompts: two of about 1,000 tokens per rank and forward; computed tokens: a prefix and ~20 others
    assert len(fwd_on) * 4 <= len(fwd_off)
    assert on.prepared.state.prefill_computed < off.prepared.state.prefill_computed / 4


@pytest.mark.parametrize("policy", ["continuous", "sglang_opt"])
def test_chunks_are_budgeted_past_the_prefix_they_take(monkeypatch, policy):
    knobs = {"token_budget": 1024, **({"two_batch_overlap": False} if policy == "sglang_opt" else {})}
    job = grouped_job(policy, n=64, group_size=16, prefix=512, page_tokens=16, num_gpus=2, **knobs)
    on, _, cut = _forwards(monkeypatch, job)
    assert sum(cut) == 0  # the policy knew where every chunk starts: the engine cut none to its context
    off = simulate(dataclasses.replace(job, policy=dataclasses.replace(job.policy, prefix_cache=False)))
    assert on.prepared.state.prefill_computed < off.prepared.state.prefill_computed / 2


def test_the_planner_predicts_a_shared_workloads_prefill_from_its_distinct_tokens():
    from batchgen.job import plan_prefill
    job = grouped_job("coroutine", n=256, group_size=64, prefix=2048, page_tokens=16, num_gpus=2,
                      prefill_parallel="auto")
    on = plan_prefill(job).prefill_plan
    unshared = dataclasses.replace(job, policy=dataclasses.replace(job.policy, prefix_cache=False))
    off = plan_prefill(unshared).prefill_plan
    assert [row[:2] for row in on] == [row[:2] for row in off] and on
    for shared, whole in zip(on, off):  # (mode, chunk, prefill s, decode s): about a 20th of the tokens computed
        assert shared[2] < whole[2] / 4 and shared[3] == whole[3]


def test_a_restore_goes_home_where_it_takes_its_prefix_and_the_rest_spread():
    from batchgen.policy.prefix_budget import fill_homes
    need = np.array([10, 10, 10, 10])        # pages of each whole KV
    shared = np.array([8, 8, 0, 8])          # pages of the prefix each takes at home
    home = np.array([1, 1, -1, 0])           # rank 0 has no room for even its own 2 pages
    ranks, pages = fill_homes(need, shared, home, slots=np.array([4, 4]), caps=np.array([2, 3]),
                              free=np.array([1, 30]), order=np.array([1, 0]))
    # home twice on rank 1 (2 pages each, out of its even share too); the third has no home: rank 1 (first in
    # order, one of its share left) whole; the fourth's home has no room and no rank has 10 pages left: cut there
    assert ranks.tolist() == [1, 1, 1] and pages.tolist() == [2, 2, 10]


def test_takers_copy_the_tail_below_a_page_that_the_prefix_has_and_they_share():
    # six prompts of 1,100 tokens sharing 1,050: 1,024 in whole pages and 26 below a page (`prefix_tail`)
    view = View([0] * 6, [1024] * 6, span=[1050] * 6)
    ranks, computed = split_sharing(np.arange(6), np.full(6, 1100), np.array([1400, 1400]), view)
    assert ranks.tolist() == [0] * 6 and computed.tolist() == [1100] + [50] * 5  # the writer's 26 copied
    # a prefix kept with 10 of its tail tokens (its writer's chunk ended there), and a member that shares 4 of them
    view = View([0, 0], [1024, 1024], there={(0, 0): (1024, 10)}, span=[1050, 1028])
    assert computed_whole(view, np.arange(2), [1100, 1100], 0, view.on_ranks()) == [66, 72]


class Fetching(View):
    """A cache whose ranks copy each other's prefixes (coroutine's `prefix_fetch`)."""

    fetches = True


def test_a_prompt_that_would_write_again_a_prefix_this_forward_writes_waits_where_ranks_copy_prefixes():
    # two groups, each prompt 1,100 tokens sharing 1,024; 1,400 computed tokens per rank
    group = [0, 0, 0, 0, 0, 0, 1, 1]
    tokens, budgets = np.full(8, 1100), np.array([1400, 1400])
    # without copies: group 0's fifth member writes its prefix again on rank 1, and group 1 finds no room
    ranks, computed = split_sharing(np.arange(8), tokens, budgets, View(group, [1024] * 8))
    assert ranks.tolist() == [0, 0, 0, 0, 1, 1] and computed.tolist() == [1100, 76, 76, 76, 1100, 76]
    # with copies: group 0's last two wait (rank -1) for the next forward to copy its prefix; group 1 fills rank 1
    ranks, computed = split_sharing(np.arange(8), tokens, budgets, Fetching(group, [1024] * 8))
    assert ranks.tolist() == [0, 0, 0, 0, -1, -1, 1, 1] and computed.tolist() == [1100, 76, 76, 76, 0, 0, 1100, 76]
    # a prefix another rank held before the forward is copied instead: the prompt takes it where it lands
    ranks, computed = split_sharing(np.arange(2), np.full(2, 1100), np.array([0, 1400]),
                                    Fetching([0, 0], [1024] * 2, there={(0, 0): 1024}))
    assert ranks.tolist() == [1, 1] and computed.tolist() == [76, 76]
    # one group only: its last two wait too, rank 1 idling a forward (spread_sharing spreads the queue's end)
    ranks, computed = split_sharing(np.arange(6), np.full(6, 1100), budgets, Fetching([0] * 6, [1024] * 6))
    assert ranks.tolist() == [0, 0, 0, 0, -1, -1]
    ranks, computed = spread_sharing(np.arange(6), np.full(6, 1100), 10_000, 2, Fetching([0] * 6, [1024] * 6))
    assert ranks.tolist() == [0, 0, 0, 1, 1, 1] and computed.tolist() == [1100, 76, 76, 1100, 76, 76]


def test_nested_levels_are_taken_where_they_are_and_written_where_they_are_not():
    """Groups 1 and 2 (1,024 tokens each) begin with group 0's 512 (a system prompt): on a rank with group 0's level
    a prompt of either computes from 512, on one with its own group's from 1,024; one whose rank lacks both copies
    what another rank holds (outermost first) and the pages of those copies are charged to it."""
    from batchgen.policy.prefix_budget import fetched_tokens

    outer = {1: (0, 512), 2: (0, 512)}
    view = View([1, 2, 2], [1024] * 3, there={(0, 0): 512, (1, 2): 1024}, outer=outer)
    seen = ForwardPrefixes(view, np.arange(3))
    assert seen.levels[0] == [(0, 512), (1, 1024)]
    assert [seen.start(0, 0, 0), seen.start(0, 1, 0), seen.start(1, 1, 0), seen.start(1, 0, 0)] == [512, 512, 1024, 0]
    seen.wrote(0, 0, 512, 1100)  # group 1's level written on rank 0, past the outer one there
    assert seen.start(0, 0, 0) == 1024 and seen.there[(0, 1)] == (1024, 0)
    # rank 1 copies group 0's level (512) for the first prompt and group 2's own segment (512) for the second; rank 2
    # copies both levels (1,024)
    fetching = Fetching([1, 2, 2], [1024] * 3, there={(0, 0): 512, (0, 2): 1024}, outer=outer)
    got = fetched_tokens(fetching, np.arange(3), np.array([1, 1, 2]), np.array([588, 76, 76]), np.full(3, 1100), 64)
    assert got.tolist() == [512, 512, 1024]
    # one forward's ranks: the outer level written on rank 0 is written again on rank 1 (only a prompt's own group's
    # level makes it wait), each group's own level once
    ranks, computed = split_sharing(np.arange(4), np.full(4, 1100), np.array([1200, 1200]),
                                    Fetching([1, 1, 2, 2], [1024] * 4, outer=outer))
    assert ranks.tolist() == [0, 0, 1, 1] and computed.tolist() == [1100, 76, 1100, 76]


def test_a_restore_away_from_home_counts_the_prefix_it_takes_or_copies_there():
    from batchgen.policy.prefix_budget import RestoreTakes, fill_homes
    # four members of group 0 sharing 1,024 tokens (16 pages of 64), 20 pages whole each; rank 0 holds the prefix
    # with a tail, rank 1 does not; ranks copy prefixes
    view = Fetching([0] * 4, [1024] * 4, there={(0, 0): (1024, 10)})
    need, none = np.full(4, 20), np.zeros(4, np.int64)
    takes = RestoreTakes(view, np.arange(4), 64, np.array([True, True]))
    ranks, pages = fill_homes(need, none, np.full(4, -1), slots=np.array([4, 4]), caps=np.array([1, 3]),
                              free=np.array([100, 100]), order=np.array([0, 1]), takes=takes)
    # rank 0 takes one (its even share): 4 pages of its own; rank 1 copies the prefix (16 pages and the tail's) for
    # the first, 4 + 17 pages, then 4 each
    assert ranks.tolist() == [0, 1, 1, 1] and pages.tolist() == [4, 21, 4, 4]
    # a rank of another node takes nothing by reference: whole
    takes = RestoreTakes(view, np.arange(4), 64, np.array([True, False]))
    ranks, pages = fill_homes(need, none, np.full(4, -1), slots=np.array([4, 4]), caps=np.array([1, 3]),
                              free=np.array([100, 100]), order=np.array([0, 1]), takes=takes)
    assert ranks.tolist() == [0, 1, 1, 1] and pages.tolist() == [4, 20, 20, 20]
