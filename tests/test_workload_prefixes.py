"""Workloads whose prompts share a prefix: the columns, the configs that draw them, and the prefill counts."""

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from batchgen.workload import Workload, build_workload

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "workload"
SHARED = ("rl_rollout_grouped", "fewshot_eval", "system_prompt_shared", "fewshot_pass_at_k")


def named(name: str, **changes) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{name}.yaml")), **changes}


def test_a_workload_without_prefixes_shares_nothing():
    w = Workload("w", [5, 7, 9], [1, 1, 1])
    assert w.prefix_group.tolist() == [-1, -1, -1] and w.prefix_len.tolist() == [0, 0, 0]
    assert w.prefill_tokens() == {"prefill_tokens_submitted": 21, "prefill_tokens_distinct": 21}


def test_distinct_prefill_counts_each_groups_prefix_once():
    # group 0: three prompts sharing 4 tokens; group 1: two sharing their whole 6-token prompt; one alone
    w = Workload("w", [10, 5, 4, 6, 6, 3], [1] * 6, prefix_group=[0, 0, 0, 1, 1, -1], prefix_len=[4, 4, 4, 6, 6, 0])
    assert w.prefill_tokens() == {"prefill_tokens_submitted": 34,
                                  "prefill_tokens_distinct": 4 + (6 + 1 + 0) + 6 + 3}


@pytest.mark.parametrize("group, shared, needle", [
    ([0, 0], [4, 6], "same for every member of a group: group 0 has 4 and 6"),
    ([0, 0], [4, 9], "longer than the prompt.*got 9 at sequence 1 \\(input_len 8\\)"),
    ([-1, 0], [2, 2], "must be 0 where prefix_group is -1"),
    ([0, -2], [0, 0], "group id >= 0, or -1"),
    ([0, 0], [-1, -1], "prefix_len must be >= 0"),
    ([0], [1], "one value per sequence"),
])
def test_bad_columns_are_refused(group, shared, needle):
    with pytest.raises(ValueError, match=needle):
        Workload("w", [5, 8], [1, 1], prefix_group=group, prefix_len=shared)


def test_rl_rollout_groups_share_the_whole_prompt():
    w = build_workload(named("rl_rollout_grouped", num_sequences=64), seed=3)
    assert np.array_equal(w.prefix_group, np.repeat(np.arange(4), 16))
    assert np.array_equal(w.prefix_len, w.input_lens)
    assert all(len(set(w.input_lens[w.prefix_group == g].tolist())) == 1 for g in range(4))
    counts = w.prefill_tokens()
    assert counts["prefill_tokens_distinct"] * 16 == counts["prefill_tokens_submitted"]
    assert w.output_lens.max() > 4 * np.median(w.output_lens)  # rl_rollout's long tail, not one length per group


def test_fewshot_and_system_prompt_share_a_prefix_before_distinct_suffixes():
    few = build_workload(named("fewshot_eval", num_sequences=570), seed=0)
    assert sorted(set(few.prefix_group.tolist())) == list(range(57)) and np.bincount(few.prefix_group).min() == 10
    assert (few.input_lens - few.prefix_len).min() >= 32 and few.output_lens.max() <= 32
    sys_prompt = build_workload(named("system_prompt_shared", num_sequences=100), seed=0)
    assert set(sys_prompt.prefix_len.tolist()) == {4096} and set(sys_prompt.prefix_group.tolist()) == {0}
    suffixes = int((sys_prompt.input_lens - 4096).sum())
    assert sys_prompt.prefill_tokens()["prefill_tokens_distinct"] == 4096 + suffixes


def test_shuffled_order_keeps_each_group_and_its_lengths():
    grouped = build_workload(named("rl_rollout_grouped", num_sequences=64), seed=1)
    shuffled = build_workload(named("rl_rollout_grouped", num_sequences=64,
                                    prefix={"group_size": 16, "length": "prompt", "order": "shuffled"}), seed=1)
    assert not np.array_equal(grouped.prefix_group, shuffled.prefix_group)
    def rows(w):
        return sorted(zip(w.prefix_group.tolist(), w.input_lens.tolist(), w.output_lens.tolist()))
    assert rows(grouped) == rows(shuffled)


def test_max_input_clips_the_shared_prefix_with_the_prompt():
    w = build_workload(named("system_prompt_shared", num_sequences=10, max_input=1000), seed=0)
    assert set(w.input_lens.tolist()) == {1000} and set(w.prefix_len.tolist()) == {1000}


@pytest.mark.parametrize("prefix, needle", [
    ({"group_size": 16, "length": "prompt"}, "not a multiple of workload.prefix.group_size=16"),
    ({"groups": 0, "length": "prompt"}, "groups must be an integer >= 1, got 0"),
    ({"groups": 100, "length": "prompt"}, "groups=100 is more than workload.num_sequences=40"),
    ({"groups": 2, "group_size": 20, "length": "prompt"}, "exactly one of groups"),
    ({"groups": 2}, "prefix.length is missing"),
    ({"groups": 2, "length": {"kind": "fixed", "value": 0}}, "prefix.length: value must be >= 1"),
    ({"groups": 2, "length": "prompt", "order": "random"}, "order must be one of grouped, shuffled"),
    ({"groups": 2, "length": "prompt", "share": 3}, r"unknown workload.prefix key\(s\) \['share'\]"),
    ({"group_size": 4, "length": "prompt", "outer": {"groups": 3, "length": "prompt"}},
     "outer.length must be a length distribution"),
    ({"group_size": 4, "length": "prompt", "outer": {"group_size": 3, "length": {"kind": "fixed", "value": 9}}},
     "the groups=10 is not a multiple of workload.prefix.outer.group_size=3"),
    ({"group_size": 4, "length": "prompt", "outer": {"groups": 2, "length": {"kind": "fixed", "value": 9}, "n": 1}},
     r"unknown workload.prefix.outer key\(s\) \['n'\]"),
])
def test_bad_prefix_configs_fail_before_drawing(prefix, needle):
    with pytest.raises(ValueError, match=needle):
        build_workload(named("rl_rollout_grouped", num_sequences=40, prefix=prefix), seed=0)


def test_an_outer_prefix_nests_the_groups_beneath_it():
    """Ten prompts sampled four times, in two families whose system prompt (300 tokens) begins each prompt: the
    families are groups 0 and 1 of the tree, the prompts' groups 2..11 beneath them, and the distinct tokens count
    each system prompt once and each prompt's own part once."""
    from batchgen.workload.prefix_tree import PrefixTree

    cfg = named("rl_rollout_grouped", num_sequences=40, prefix={
        "group_size": 4, "length": "prompt", "outer": {"groups": 2, "length": {"kind": "fixed", "value": 300}}})
    w = build_workload(cfg, seed=0)
    tree = w.prefix_tree
    assert tree.parent.tolist() == [-1, -1] + [0] * 5 + [1] * 5 and tree.length[:2].tolist() == [300, 300]
    assert w.prefix_group.tolist() == np.repeat(np.arange(2, 12), 4).tolist()
    assert (w.prefix_len == w.input_lens).all() and (w.input_lens > 300).all()
    assert w.prefill_tokens()["prefill_tokens_distinct"] == 2 * 300 + int(w.input_lens[::4].sum()) - 10 * 300
    assert tree.chains()[6] == (0, 6) and tree.chains()[7] == (1, 7) and tree.segment_tokens(w.prefix_group, 64) == (
        2 * 256 + int((w.input_lens[::4] // 64 * 64 - 256).sum()))
    # more outer groups than groups (a smaller run of the same workload): one outer group per group
    small = build_workload(named("rl_rollout_grouped", num_sequences=40, prefix={
        "group_size": 4, "length": "prompt", "outer": {"groups": 57, "length": {"kind": "fixed", "value": 30}}}), seed=0)
    assert small.prefix_tree.parent.tolist() == [-1] * 10 + list(range(10))
    with pytest.raises(ValueError, match="must be longer than its parent"):
        PrefixTree([-1, 0], [300, 300])
    with pytest.raises(ValueError, match="parent must be -1 or a smaller group id"):
        PrefixTree([1, -1], [10, 20])
    with pytest.raises(ValueError, match="is not its group 1's length"):
        Workload("w", [30, 30], [1, 1], prefix_group=[1, 1], prefix_len=[25, 25],
                 prefix_tree=PrefixTree([-1, 0], [10, 20]))


def test_a_trace_workload_cannot_draw_prefixes():
    with pytest.raises(ValueError, match="shared prefixes are drawn for 'input'/'output' workloads only"):
        build_workload({"name": "t", "trace": "azure_conv_2023.csv", "prefix": {"groups": 1, "length": "prompt"}}, 0)


@pytest.mark.parametrize("name", SHARED)
def test_the_shared_configs_build_at_full_size(name):
    w = build_workload(named(name), seed=0, progress=False)
    counts = w.prefill_tokens()
    assert len(w) == named(name)["num_sequences"] and counts["prefill_tokens_distinct"] < counts[
        "prefill_tokens_submitted"] / 5


def test_synthetic_prompts_share_their_groups_prefix_tokens():
    from batchgen.exec.sequences import random_prompts
    from batchgen.workload.prefixes import distinct_prefix_tokens

    w = Workload("w", [6, 9, 7, 5, 4], [1] * 5, prefix_group=[0, 1, 0, 1, -1], prefix_len=[4, 5, 4, 5, 0])
    plain = random_prompts(w.input_lens, 1000, seed=3)
    shared = random_prompts(w.input_lens, 1000, seed=3, prefix_group=w.prefix_group, prefix_len=w.prefix_len)
    assert shared[0][:4].tolist() == shared[2][:4].tolist() and shared[1][:5].tolist() == shared[3][:5].tolist()
    assert [p.tolist() for p in shared[:2] + shared[4:]] == [p.tolist() for p in plain[:2] + plain[4:]]
    assert shared[2][4:].tolist() == plain[2][4:].tolist()  # the suffixes are each sequence's own draws
    assert distinct_prefix_tokens(shared) == w.prefill_tokens()["prefill_tokens_distinct"]
    # nested: group 1's prefix begins with group 0's (3 tokens), which group 2 shares too
    from batchgen.workload.prefix_tree import PrefixTree

    w = Workload("w", [6, 9, 7, 5], [1] * 4, prefix_group=[1, 1, 2, 2], prefix_len=[5, 5, 4, 4],
                 prefix_tree=PrefixTree([-1, 0, 0], [3, 5, 4]))
    nested = random_prompts(w.input_lens, 1000, seed=3, prefix_group=w.prefix_group, prefix_len=w.prefix_len,
                            tree=w.prefix_tree)
    assert len({tuple(p[:3].tolist()) for p in nested}) == 1 and nested[0][:5].tolist() == nested[1][:5].tolist()
    # segments 3 + 2 + 1, then the suffixes 1, 4, 3, 1
    assert distinct_prefix_tokens(nested) == w.prefill_tokens()["prefill_tokens_distinct"] == 6 + 9


def test_distinct_prefix_tokens_counts_a_prefix_tree():
    from batchgen.workload.prefixes import distinct_prefix_tokens

    assert distinct_prefix_tokens([]) == 0
    assert distinct_prefix_tokens([[7, 8, 9]] * 4) == 3  # one prompt four times (n samples)
    # a system prompt [1, 2] before two few-shot blocks, each before two questions: 2 + 2 * 1 + 4 * 1
    assert distinct_prefix_tokens([[1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4, 5], [1, 2, 4, 6]]) == 8
    assert distinct_prefix_tokens([[1, 2], [1, 2, 3]]) == 3  # a prompt that is another's prefix
    assert distinct_prefix_tokens([[256, 1], [1, 256]]) == 4  # token order, not byte order of small ids


def _paged(tree, page):
    """The tree's lengths in whole pages (what a paged cache shares)."""
    from batchgen.workload.prefix_tree import PrefixTree

    return PrefixTree(tree.parent, tree.length // page * page)


def _saving(sequences, group, prefix_len, page=1):
    """Prompt tokens a one-level grouping saves: each group's prefix (whole pages) once less."""
    out = 0
    for g in set(group.tolist()) - {-1}:
        members = np.flatnonzero(group == g)
        out += (members.size - 1) * (int(prefix_len[members[0]]) // page * page)
    return out


def test_discovered_prefixes_nest_choices_beneath_a_system_prompt():
    from batchgen.workload.prefixes import discover_prefixes, distinct_prefix_tokens, prefill_tokens_distinct

    system = list(range(1000, 1130))                      # 130 tokens before every request of a family
    family = [system + [k, k + 1, k + 2] for k in range(6) for _ in range(3)]  # six requests, three choices each
    n_choices = [[7, 8, 9, k] for k in range(3) for _ in range(4)]  # three prompts, four choices each
    loner = [[5, 5, 5]]
    sequences = family + n_choices + loner
    group, prefix_len, tree = discover_prefixes(sequences)
    fam = group[:18]
    assert [len(set(fam[i:i + 3].tolist())) for i in range(0, 18, 3)] == [1] * 6 and len(set(fam.tolist())) == 6
    assert (prefix_len[:18] == 133).all() and {int(tree.parent[g]) for g in fam} == {int(tree.parent[fam[0]])}
    system_group = int(tree.parent[fam[0]])
    assert tree.length[system_group] == 130 and tree.parent[system_group] == -1  # the system prompt: the outer level
    choices = group[18:30]
    assert [len(set(choices[i:i + 4].tolist())) for i in range(0, 12, 4)] == [1, 1, 1] and (prefix_len[18:30] == 4).all()
    assert len({int(tree.parent[g]) for g in choices}) == 1  # beneath their common 3 tokens
    assert group[30] == -1 and prefix_len[30] == 0
    lens = np.array([len(s) for s in sequences])
    assert prefill_tokens_distinct(lens, group, prefix_len, tree) == distinct_prefix_tokens(sequences)
    # whole pages of 64: the family's 130 tokens share two pages; a request's 133 no more; a 4-token prompt none
    group, prefix_len, tree = discover_prefixes(sequences, page_tokens=64)
    assert (group[:18] == group[0]).all() and group[0] >= 0 and (group[18:] == -1).all() and len(tree) == 1


@pytest.mark.parametrize("seed", range(8))
def test_discovered_prefixes_are_shared_and_save_every_whole_page_the_tree_shares(seed):
    """Random families (a system prompt, then requests with n choices): every group's members share their prefix,
    each group's prefix begins with its parent's, and the groups save every whole page the prompts' prefix tree
    shares: at least what grouping each request's choices alone saves."""
    from batchgen.workload.prefixes import discover_prefixes, prefill_tokens_distinct

    rng = np.random.default_rng(seed)
    sequences, request = [], []
    for f in range(int(rng.integers(1, 4))):
        system = rng.integers(0, 50, int(rng.integers(0, 40))).tolist()
        for r in range(int(rng.integers(1, 5))):
            prompt = system + rng.integers(0, 50, int(rng.integers(1, 20))).tolist()
            for _ in range(int(rng.integers(1, 4))):
                sequences.append(prompt)
                request.append(f * 100 + r)
    page = int(rng.choice([1, 4, 16]))
    group, prefix_len, tree = discover_prefixes(sequences, page)
    chains = tree.chains()
    for g in set(group.tolist()) - {-1}:
        members = np.flatnonzero(group == g)
        for a in chains[g]:  # every level of its chain is shared by all of them
            n = int(tree.length[a])
            assert all(len(sequences[m]) >= n and sequences[m][:n] == sequences[members[0]][:n] for m in members)
        assert (prefix_len[members] == tree.length[g]).all()
    lens = np.array([len(s) for s in sequences])
    request = np.array(request)
    by_request = np.where(np.bincount(request)[request] > 1, request, -1)
    saved = int(lens.sum()) - prefill_tokens_distinct(lens, group, prefix_len // page * page, _paged(tree, page))
    assert saved >= _saving(sequences, by_request, lens, page)
