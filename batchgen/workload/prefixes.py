"""Shared prompt prefixes of a workload: which sequences share one, how long it is, and what sharing saves.

Batch jobs repeat themselves: an RL step samples n completions of each prompt, an evaluation puts the same
k-shot examples before every question of a subject, a data-generation job puts one long system prompt before
every request. A workload says so with two per-sequence columns:

* `prefix_group`: the id of the sequences it shares a prefix with (-1: none);
* `prefix_len`: how many leading tokens of its prompt are identical in every member of its group (0: none).

A prompt shared whole (n samples) has prefix_len equal to its input length. Where groups nest (a system prompt
before each prompt's n samples), a `PrefixTree` (batchgen.workload.prefix_tree) says which group's prefix begins
each group's; the columns then name each sequence's deepest group. The counts here need no scheduling:
`prefill_tokens_submitted` is what a system without sharing prefills, `prefill_tokens_distinct` what one that
computes each shared prefix (each segment of the tree) once must prefill.

The `prefix` key of a workload config draws the columns (`PrefixSpec`): `groups` (how many) or `group_size`
(sequences per group), and `length`: `prompt` (the whole prompt is shared: `input` is drawn once per group) or
a length distribution drawn once per group (then `input` is each sequence's own suffix, after the prefix).
Members of a group are adjacent unless `order: shuffled`. `outer: {groups or group_size, length}` puts an outer
prefix (a system prompt, a few-shot block) before the groups' own: `groups` outer groups over the groups, or
`group_size` groups per outer group, each outer prefix's length drawn once.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from .distributions import Distribution, make_distribution
from .prefix_tree import NO_PARENT, PrefixTree

NO_GROUP = -1
ORDERS = ("grouped", "shuffled")
VALID_KEYS = ("groups", "group_size", "length", "order", "outer")
WHOLE_PROMPT = "prompt"


def check_prefix_columns(input_lens: np.ndarray, group: Any, prefix_len: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both columns as read-only int64 arrays (None: no sharing), after checking they describe one shared prefix
    per group that fits every member's prompt."""
    n = input_lens.size
    group = np.full(n, NO_GROUP, dtype=np.int64) if group is None else np.array(group, dtype=np.int64, ndmin=1)
    prefix_len = np.zeros(n, dtype=np.int64) if prefix_len is None else np.array(prefix_len, dtype=np.int64, ndmin=1)
    for name, col in (("prefix_group", group), ("prefix_len", prefix_len)):
        if col.shape != input_lens.shape:
            raise ValueError(f"{name} must have one value per sequence ({n}), got shape {col.shape}")
    if n:
        _first_bad(group < NO_GROUP, "prefix_group must be a group id >= 0, or -1 for none", group)
        _first_bad(prefix_len < 0, "prefix_len must be >= 0", prefix_len)
        _first_bad((group == NO_GROUP) & (prefix_len != 0),
                   "prefix_len must be 0 where prefix_group is -1 (no group, nothing shared)", prefix_len)
        _first_bad(prefix_len > input_lens, "a shared prefix longer than the prompt: prefix_len must be <= "
                                            "input_len", prefix_len, input_lens)
        grouped = group != NO_GROUP
        if grouped.any():
            ids, first = np.unique(group[grouped], return_inverse=True)
            lo = np.full(ids.size, np.iinfo(np.int64).max)
            hi = np.full(ids.size, -1)
            np.minimum.at(lo, first, prefix_len[grouped])
            np.maximum.at(hi, first, prefix_len[grouped])
            if (lo != hi).any():
                g = int(ids[np.argmax(lo != hi)])
                raise ValueError(f"prefix_len must be the same for every member of a group: group {g} has "
                                 f"{int(lo[ids == g][0])} and {int(hi[ids == g][0])}")
    for col in (group, prefix_len):
        col.setflags(write=False)
    return group, prefix_len


def _first_bad(bad: np.ndarray, what: str, values: np.ndarray, limit: np.ndarray | None = None) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        extra = "" if limit is None else f" (input_len {int(limit[i])})"
        raise ValueError(f"{what}; got {int(values[i])} at sequence {i}{extra}")


def prefill_tokens_submitted(input_lens: np.ndarray) -> int:
    """Prompt tokens as submitted: what a system that shares nothing prefills."""
    return int(np.asarray(input_lens, dtype=np.int64).sum())


def prefill_tokens_distinct(input_lens: np.ndarray, group: np.ndarray, prefix_len: np.ndarray,
                            tree: PrefixTree | None = None) -> int:
    """Each group's shared prefix once (each segment of a `tree` once), plus every sequence's own suffix: what a
    system that computes a shared prefix once must prefill."""
    suffixes = int((input_lens - prefix_len).sum())
    if not (group != NO_GROUP).any():
        return suffixes
    return suffixes + (tree or PrefixTree.flat(group, prefix_len)).segment_tokens(group)


def shared_prefix_tokens(group: np.ndarray, prefix_len: np.ndarray, page_tokens: int,
                         tree: PrefixTree | None = None) -> tuple[float, float]:
    """(the whole-page prefix tokens a sequence holds by reference, on average over all sequences; every group's
    prefix's whole-page tokens together, each segment of a `tree` once): what a memory plan counts once per group,
    not per sequence."""
    grouped = group != NO_GROUP
    if not grouped.any():
        return 0.0, 0.0
    whole = prefix_len[grouped] // page_tokens * page_tokens
    segments = (tree or PrefixTree.flat(group, prefix_len)).segment_tokens(group, page_tokens)
    return float(whole.sum() / group.size), float(segments)


def _sorted_lcp(sequences) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """(the sequences as arrays, their lexicographic order, lcp[i]: the common prefix of the i-th and (i-1)-th in
    that order; lcp[0] = 0)."""
    arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
    keys = [a.astype(">i8").tobytes() for a in arrays]  # big-endian: byte order is token order
    order = sorted(range(len(arrays)), key=keys.__getitem__)
    lcp = np.zeros(len(arrays), np.int64)
    for i, (prev, cur) in enumerate(pairwise(order), start=1):
        a, b = arrays[prev], arrays[cur]
        m = min(a.size, b.size)
        differ = np.flatnonzero(a[:m] != b[:m])
        lcp[i] = int(differ[0]) if differ.size else m
    return arrays, order, lcp


def discover_prefixes(sequences, page_tokens: int = 1) -> tuple[np.ndarray, np.ndarray, PrefixTree]:
    """`prefix_group`, `prefix_len` and the `PrefixTree` found in token ids, for prompts no one labelled (a batch
    file's): a radix tree of the prompts in whole pages of `page_tokens` (what a paged cache can share).

    In lexicographic order the sequences that share a prefix of at least h tokens are runs (the nodes of their
    prefix tree: lcp intervals). Every node over two or more sequences whose prefix has more whole pages than its
    nearest ancestor group's is a group, nested beneath that one (its parent); each sequence's group is the deepest
    that holds it. A system prompt before requests with n choices each is then two levels: the system prompt's
    group, and each request's beneath it."""
    arrays, order, lcp = _sorted_lcp(sequences)
    n = len(arrays)
    group, prefix_len = np.full(n, NO_GROUP, np.int64), np.zeros(n, np.int64)
    parents: list[int] = []
    lengths: list[int] = []
    if n < 2:
        return group, prefix_len, PrefixTree(parents, lengths)
    # the lcp intervals (value, first, last, children), closed at the boundary where lcp falls below their value
    nodes: list[tuple[int, int, int, list]] = []
    stack: list[list] = [[0, 0, []]]
    for i in range(1, n + 1):
        h = int(lcp[i]) if i < n else -1
        first, last = i - 1, None
        while stack and h < stack[-1][0]:
            value, first, children = stack.pop()
            nodes.append((value, first, i - 1, children))
            last = len(nodes) - 1
            if stack and h <= stack[-1][0]:
                stack[-1][2].append(last)
        if not stack or h > stack[-1][0]:
            stack.append([h, first, [last] if last is not None else []])
    todo = [(len(nodes) - 1, NO_PARENT, 0)]  # (node, the group above it, that group's whole-page tokens)
    while todo:  # top down: a parent's id comes before its children's, and a deeper group overwrites its members
        node, parent, above = todo.pop()
        value, first, last, children = nodes[node]
        whole = value // page_tokens * page_tokens
        if last > first and whole > above:
            parents.append(parent)
            lengths.append(value)
            parent, above = len(parents) - 1, whole
            members = [order[j] for j in range(first, last + 1)]
            group[members], prefix_len[members] = parent, value
        todo.extend((c, parent, above) for c in children)
    return group, prefix_len, PrefixTree(parents, lengths)


def distinct_prefix_tokens(sequences) -> int:
    """Tokens of the prefix tree of `sequences` (token-id arrays): what a prefill that computes every common
    prefix once computes, at any depth (a system prompt, then a few-shot block, then a repeated question). In
    lexicographic order, each sequence shares with the tree exactly its longest common prefix with the one
    before it, so the tree holds the sum of lengths less those."""
    arrays, _, lcp = _sorted_lcp(sequences)
    return sum(a.size for a in arrays) - int(lcp.sum())


def _size_key(cfg: Mapping, where: str, unit: str) -> tuple[str, int]:
    """(groups or group_size, its value) of a prefix level's config, checked."""
    sizes = [k for k in ("groups", "group_size") if cfg.get(k) is not None]
    if len(sizes) != 1:
        raise ValueError(f"{where} needs exactly one of groups (how many groups) and group_size ({unit} per group), "
                         f"got {sizes or 'neither'}")
    value = cfg[sizes[0]]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{where}.{sizes[0]} must be an integer >= 1, got {value!r}")
    return sizes[0], int(value)


def _blocks(n: int, groups: int | None, group_size: int | None, where: str, count: str) -> np.ndarray:
    """Each of n items' group, members adjacent: equal blocks (the first ones one longer when n does not divide
    evenly); `count` names n in an error."""
    if group_size is not None:
        if n % group_size:
            raise ValueError(f"{count}={n} is not a multiple of {where}.group_size={group_size}: give prompts x "
                             "samples sequences")
        return np.repeat(np.arange(n // group_size, dtype=np.int64), group_size)
    if groups > n:
        raise ValueError(f"{where}.groups={groups} is more than {count}={n}: every group needs at least one member")
    sizes = np.full(groups, n // groups, dtype=np.int64)
    sizes[: n % groups] += 1
    return np.repeat(np.arange(groups, dtype=np.int64), sizes)


@dataclass(frozen=True)
class OuterSpec:
    """A validated `prefix.outer` node: an outer prefix before the groups' own (a system prompt, a few-shot block)."""

    groups: int | None = None
    group_size: int | None = None  # groups per outer group
    length: Distribution | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> OuterSpec:
        where = "workload.prefix.outer"
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{where} must be a mapping like {{groups: 1, length: {{kind: fixed, value: 2048}}}}, "
                             f"got {cfg!r}")
        unknown = sorted(set(cfg) - {"groups", "group_size", "length"})
        if unknown:
            raise ValueError(f"unknown {where} key(s) {unknown}; valid keys: groups, group_size, length")
        key, value = _size_key(cfg, where, "groups")
        if cfg.get("length") is None or cfg.get("length") == WHOLE_PROMPT:
            raise ValueError(f"{where}.length must be a length distribution, e.g. {{kind: fixed, value: 2048}}")
        try:
            length = make_distribution(cfg["length"])
        except ValueError as e:
            raise ValueError(f"{where}.length: {e}") from None
        return cls(**{key: value}, length=length)

    def draw(self, groups: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(each group's outer group, each outer group's prefix length). `groups` outer groups, or as many as the
        groups where there are fewer (a smaller run of the same workload: fewer subjects, each with its questions)."""
        outer = _blocks(groups, None if self.groups is None else min(self.groups, groups), self.group_size,
                        "workload.prefix.outer", "the groups")
        count = int(outer[-1]) + 1 if groups else 0
        return outer, self.length.sample(count, rng)


@dataclass(frozen=True)
class PrefixSpec:
    """A validated `prefix` node of a workload config."""

    groups: int | None = None
    group_size: int | None = None
    length: Distribution | None = None  # None: the whole prompt is shared
    order: str = "grouped"
    outer: OuterSpec | None = None  # an outer prefix before the groups' own (a PrefixTree of two levels)

    @classmethod
    def from_config(cls, cfg: Any) -> PrefixSpec:
        if not isinstance(cfg, Mapping):
            raise ValueError(f"workload.prefix must be a mapping like {{group_size: 16, length: prompt}}, got {cfg!r}")
        unknown = sorted(set(cfg) - set(VALID_KEYS))
        if unknown:
            raise ValueError(f"unknown workload.prefix key(s) {unknown}; valid keys: {', '.join(VALID_KEYS)}")
        key, value = _size_key(cfg, "workload.prefix", "sequences")
        length = cfg.get("length")
        if length is None:
            raise ValueError("workload.prefix.length is missing: 'prompt' (each group's whole prompt is shared) "
                             "or a length distribution, e.g. {kind: fixed, value: 2048}")
        if length != WHOLE_PROMPT:
            try:
                length = make_distribution(length)
            except ValueError as e:
                raise ValueError(f"workload.prefix.length: {e} (or 'prompt': the whole prompt is shared)") from None
        else:
            length = None
        order = cfg.get("order", "grouped")
        if order not in ORDERS:
            raise ValueError(f"workload.prefix.order must be one of {', '.join(ORDERS)}, got {order!r}")
        outer = None if cfg.get("outer") is None else OuterSpec.from_config(cfg["outer"])
        return cls(**{key: value}, length=length, order=order, outer=outer)

    def group_ids(self, n: int) -> np.ndarray:
        """Each sequence's group, members adjacent: equal blocks (the first ones one longer when n does not
        divide evenly)."""
        ids = _blocks(n, self.groups, self.group_size, "workload.prefix", "workload.num_sequences")
        if self.outer is not None and ids.size:
            self.outer.draw(int(ids[-1]) + 1, np.random.default_rng(0))  # outer blocks that do not fit fail now
        return ids

    def draw(self, n: int, input: Distribution, input_rng: np.random.Generator, prefix_rng: np.random.Generator,
             order_rng: np.random.Generator, progress=None, outer_rng: np.random.Generator | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, PrefixTree | None]:
        """(input_lens, prefix_group, prefix_len, order, tree): `order` permutes the sequences (outputs included);
        with `outer`, the outer groups come first in the tree (ids 0..), the groups after them, each prefix the
        outer one and then its own."""
        group = self.group_ids(n)
        count = int(group[-1]) + 1 if n else 0
        before, tree = np.zeros(n, np.int64), None
        if self.outer is not None:
            outer, outer_len = self.outer.draw(count, outer_rng or np.random.default_rng(0))
            before = outer_len[outer][group]
        if self.length is None:  # one prompt per group, shared whole
            inputs = before + input.sample(count, input_rng)[group]
            prefix = inputs.copy()
            if progress is not None:
                progress.update(n)
        else:
            prefix = before + self.length.sample(count, prefix_rng)[group]
            inputs = prefix + input.sample(n, input_rng, progress=progress)
        if self.outer is not None:
            first = np.unique(group, return_index=True)[1]
            tree = PrefixTree(np.concatenate([np.full(outer_len.size, NO_PARENT), outer]),
                              np.concatenate([outer_len, prefix[first]]))
            group = group + outer_len.size
        order = order_rng.permutation(n) if self.order == "shuffled" else np.arange(n)
        return inputs, group, prefix, order, tree
