"""FIFO prompts split over ranks by the tokens each forward computes when prompts share prefixes.

Why. A forward's prefill budget (tokens per rank) stands for the work and activations of the tokens it computes.
With prefix caching a prompt whose group's prefix is on its rank, or is written there by an earlier prompt of
the same forward, computes only the rest (batchgen.core.prefix_pages' `sharing_starts`; vLLM's scheduler and
SGLang's prefill adder count only uncached tokens against their budgets too). Budgeting whole prompts would run
forwards that compute a fraction of what they could: on a few-shot evaluation, each a fifth of the budget, each
paying the whole forward's fixed cost (in a data-parallel prefill, every expert streamed in).
"""

from __future__ import annotations

import numpy as np

from batchgen.policy.base import PrefixView


def longest_prefixes(there: dict[tuple[int, int], tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """group -> (tokens, tail) of the longest of its prefixes on any rank (the first rank's on a tie): the one a
    rank without it copies (batchgen.core.prefix_fetch's `fetch_source`)."""
    out: dict[int, tuple[int, int]] = {}
    for (_, group), have in sorted(there.items()):
        if group not in out or have[0] > out[group][0]:
            out[group] = have
    return out


class ForwardPrefixes:
    """The prefixes a forward's prompts find on their ranks as the policy builds it, candidate by candidate: those
    there already and those its earlier chunks write (the rule of `sharing_starts`: a prompt takes the deepest level
    of its chain on its rank that it shares whole, copying as much of its own group's tail as it shares; a chunk that
    passes a level on a rank without one writes it, and the tail its chunk writes past its own group's). Where the
    cache `fetches` (batchgen.core.prefix_fetch), a rank without a level copies the longest another rank held before
    this forward, outermost level first."""

    def __init__(self, prefixes: PrefixView, ids: np.ndarray,
                 there: dict[tuple[int, int], tuple[int, int]] | None = None):
        self.group = prefixes.group(ids).tolist()
        self.levels = prefixes.levels(ids)
        self.span = prefixes.shared_span(ids).tolist()
        # (rank, group) -> (tokens, tail), `prefixes.on_ranks()` unless given (one forward's ranks share it); grows
        # with the prefixes written
        self.there = prefixes.on_ranks() if there is None else there
        # group -> the prefix a rank without one copies (None: ranks do not copy prefixes)
        self.anywhere = longest_prefixes(self.there) if getattr(prefixes, "fetches", False) else None

    def _taken(self, rank: int, i: int) -> tuple[int, int, int]:
        """(group, tokens, tail) of the level candidate i takes on `rank` (there, or copied there with every level
        outside it); (-1, 0, 0): none."""
        out = (-1, 0, 0)
        for a, tokens in self.levels[i]:
            have = self.there.get((rank, a))
            if have is None and self.anywhere is not None:
                have = self.anywhere.get(a)
                if have is None or tokens < have[0]:
                    break  # copies stop at the first level no rank holds
            if have is not None and tokens >= have[0]:
                out = (a, *have)
        return out

    def start(self, rank: int, i: int, s: int) -> int:
        """Where candidate i's chunk starts on `rank`: past the level it takes if it has not started (s == 0)."""
        if s or self.group[i] < 0:
            return s
        group, tokens, tail = self._taken(rank, i)
        if group < 0:
            return 0
        return tokens + (min(tail, self.span[i] - tokens) if group == self.group[i] else 0)

    def wrote(self, rank: int, i: int, s: int, end: int) -> None:
        """Candidate i's chunk covers [s, end) on `rank`: it writes each level of its chain it passes first there,
        and the levels it took copied there are there for the next ones."""
        for a, tokens in self.levels[i]:
            key = (rank, a)
            if key in self.there:
                continue
            if s < tokens <= end:
                self.there[key] = (tokens, min(self.span[i], end) - tokens if a == self.group[i] else 0)
            elif tokens <= s and self.anywhere and a in self.anywhere:
                self.there[key] = self.anywhere[a]


def fetched_tokens(prefixes: PrefixView, ids: np.ndarray, ranks: np.ndarray, computed: np.ndarray,
                   tokens: np.ndarray, page_tokens: int) -> np.ndarray:
    """The tokens of pages each prompt's forward copies onto its rank (batchgen.core.prefix_fetch): each copied
    level's own pages past the level it extends, and its tail's page, charged to the first prompt that takes it
    there."""
    out = np.zeros(ids.size, np.int64)
    if not getattr(prefixes, "fetches", False):
        return out
    seen = ForwardPrefixes(prefixes, ids)
    for i, r in enumerate(ranks.tolist()):
        below = 0  # tokens of the levels outside the one being copied, there already
        for a, n in seen.levels[i] if computed[i] < tokens[i] and seen.anywhere else ():  # it took levels copied here
            if (r, a) not in seen.there:
                have = seen.anywhere.get(a)
                if have is None:
                    break
                out[i] += have[0] - below + (page_tokens if have[1] else 0)
            below = n
        for a, _ in seen.levels[i]:
            seen.there.setdefault((r, a), (0, 0))  # copied, or written by this prompt: there for the next ones
    return out


def computed_whole(prefixes: PrefixView, ids: np.ndarray, context: list[int], rank: int,
                   there: dict[tuple[int, int], int]) -> list[int]:
    """The tokens each FIFO prompt computes on `rank` if every one before it is prefilled whole there (what
    SGLang's admission charges a prompt: its tokens past the cached prefix)."""
    seen = ForwardPrefixes(prefixes, ids, there)
    out = []
    for i, c in enumerate(context):
        s = seen.start(rank, i, 0)
        seen.wrote(rank, i, s, c)
        out.append(c - s)
    return out


def split_sharing(ids: np.ndarray, tokens: np.ndarray, budget_per_rank: np.ndarray,
                  prefixes: PrefixView, wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`common.split_by_budget` over the tokens each prompt computes: FIFO prompts (`tokens` each, whole) go to
    ranks in order, each rank with budget taking at least one and keeping its computed tokens within its budget
    (`ForwardPrefixes` says what each takes), except that a prompt whose group's prefix a rank holds, or is
    writing in this forward, goes to the first such rank with budget left for it: sharers meet where their prefix
    is (its deepest level's first). Where ranks copy each other's prefixes (`prefixes.fetches`) and `wait`, a prompt
    that would write again on another rank its group's level, which this forward writes first, waits for the next
    forward, which copies it there (rank -1): each shared token of it is computed once, while ranks that only such
    prompts would fill idle a forward.
    Returns (rank, computed tokens) of each prompt placed or waiting (a FIFO prefix of `ids`)."""
    seen = ForwardPrefixes(prefixes, ids)
    first_written: set[int] = set()  # levels whose first copy this forward writes (where ranks copy prefixes)
    budgets = np.asarray(budget_per_rank).tolist()
    used, count = [0] * len(budgets), [0] * len(budgets)
    homes: dict[int, list[int]] = {}  # level -> ranks with it, in the order they got it
    for r, g in sorted(seen.there):
        homes.setdefault(g, []).append(r)
    ranks: list[int] = []
    computed: list[int] = []
    r = 0  # the rank being filled in order
    for i in range(ids.size):
        levels, at = seen.levels[i], None
        for a, _ in reversed(levels):  # a rank with its deepest level first
            for h in homes.get(a, ()):
                c = int(tokens[i]) - seen.start(h, i, 0)
                if used[h] + c <= budgets[h]:
                    at = h
                    break
            if at is not None:
                break
        if at is None:
            while r < len(budgets) and (budgets[r] <= 0 or (count[r] and used[r] + int(tokens[i])
                                                             - seen.start(r, i, 0) > budgets[r])):
                r += 1  # this rank is full (or has no budget): the next one takes it
            if r == len(budgets):
                break
            at, c = r, int(tokens[i]) - seen.start(r, i, 0)
            if wait and any(a in first_written and n > int(tokens[i]) - c for a, n in levels[-1:]):
                # it would write its own group's level again, which this forward writes first: it waits (an outer
                # level is written again: waiting for it idled ranks longer than the copy saved; results file)
                ranks.append(-1)
                computed.append(0)
                continue
        ranks.append(at)
        computed.append(c)
        used[at] += c
        count[at] += 1
        new = [a for a, _ in levels if (at, a) not in seen.there]
        if new:
            seen.wrote(at, i, int(tokens[i]) - c, int(tokens[i]))
            for a in new:
                if (at, a) in seen.there:
                    homes.setdefault(a, []).append(at)
                    if seen.anywhere is not None and a not in seen.anywhere:
                        first_written.add(a)  # none held it before: a second rank copies it next forward
    return np.array(ranks, np.int64), np.array(computed, np.int64)


def spread_sharing(ids: np.ndarray, tokens: np.ndarray, chunk: int, num_ranks: int,
                   prefixes: PrefixView, tries: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """`split_sharing` with `chunk` computed tokens per rank; where that takes every prompt, none waiting (fewer
    prompt tokens than the ranks' chunks: the queue's end), the same prompts spread over the ranks as evenly as the
    prefixes allow: the smallest equal budget found (in `tries` halvings from an even split of the computed tokens)
    under which every prompt is still taken, writing a prefix again where the even spread needs it (at the queue's
    end, a prompt waiting for a copy would only end the batch later). A budget split evenly over the ranks would
    make more of them write a group's prefix and take fewer prompts."""
    ranks, computed = split_sharing(ids, tokens, np.full(num_ranks, chunk), prefixes)
    if ranks.size < ids.size or num_ranks == 1 or (ranks < 0).any():  # (some wait for a prefix: no spreading)
        return ranks, computed
    lo, hi = -(-int(computed.sum()) // num_ranks), chunk  # hi: every prompt is taken
    for k in range(tries):
        if lo >= hi:
            break
        mid = lo if k == 0 else (lo + hi) // 2  # the even split first
        r, c = split_sharing(ids, tokens, np.full(num_ranks, mid), prefixes, wait=False)
        if r.size == ids.size:
            ranks, computed, hi = r, c, mid
        else:
            lo = mid + 1
    return ranks, computed


class RestoreTakes:
    """The pages a restore takes by reference on a rank other than its home (the state's `attach_restored` with
    `resume_anywhere`, on a rank of the candidates' node): its group's prefix there, if it shares as much; where
    ranks copy prefixes (`fetches`), one another rank holds, copied there first, its pages charged to the first
    restore that takes it there (the prefix's whole pages and its tail's page)."""

    def __init__(self, prefixes: PrefixView, ids: np.ndarray, page_tokens: int, on_node: np.ndarray):
        self.group = prefixes.group(ids).tolist()
        self.share = prefixes.shared_tokens(ids).tolist()
        self.page_tokens, self.on_node = page_tokens, on_node.tolist()
        on_ranks = prefixes.on_ranks()
        self.there = {key: have[0] for key, have in on_ranks.items()}  # (rank, group) -> tokens
        # group -> (tokens, pages) of the prefix a rank without one would copy
        self.copied = {group: (tokens, tokens // page_tokens + (tail > 0))
                       for group, (tokens, tail) in longest_prefixes(on_ranks).items()} \
            if getattr(prefixes, "fetches", False) else {}

    def pages(self, i: int, rank: int, need: int) -> int:
        """Pages candidate i (`need` pages whole) takes of rank's free ones if restored there."""
        g = self.group[i]
        if g < 0 or not self.on_node[rank]:
            return need
        tokens = self.there.get((rank, g))
        if tokens is not None:
            return need - tokens // self.page_tokens if self.share[i] >= tokens else need
        copy = self._copy(i)
        return need if copy is None else need - copy[0] // self.page_tokens + copy[1]

    def restored(self, i: int, rank: int) -> None:
        """Candidate i goes to `rank`: a prefix it has copied there is there for the next ones."""
        g = self.group[i]
        if g >= 0 and self.on_node[rank] and (rank, g) not in self.there and (copy := self._copy(i)) is not None:
            self.there[(rank, g)] = copy[0]

    def _copy(self, i: int) -> tuple[int, int] | None:
        """(tokens, pages) of the copy of its group's prefix candidate i can take (None: none it shares)."""
        copy = self.copied.get(self.group[i])
        return copy if copy is not None and 0 < copy[0] <= self.share[i] else None


def fill_homes(need: np.ndarray, shared_pages: np.ndarray, home: np.ndarray, slots: np.ndarray, caps: np.ndarray,
               free: np.ndarray, order: np.ndarray,
               takes: RestoreTakes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`common.fill_ranks` for restores that may take a shared prefix: FIFO candidates (`need` pages each, whole)
    go to their home rank (the one whose cache holds their host copy; -1: none open) while it has a slot left
    (`slots`) and room for their own pages (`need` less the `shared_pages` of the prefix they take there), else to
    the first rank of `order` within its `caps` (the even spread) with room for what they take there (`takes`:
    less the prefix they take on another rank too; None: all of it); the run is cut at the first that fits nowhere
    (FIFO). Returns (rank, pages) of each assigned candidate."""
    slots, caps = np.asarray(slots, np.int64).tolist(), np.asarray(caps, np.int64).tolist()
    free, order = np.asarray(free, np.int64).tolist(), [int(r) for r in order]
    ranks: list[int] = []
    pages: list[int] = []
    for i, (whole, own, h) in enumerate(zip(need.tolist(), (need - shared_pages).tolist(), home.tolist())):
        if h >= 0 and slots[h] > 0 and own <= free[h]:
            r, n = h, own
        else:
            r, n = next(((q, n) for q in order if caps[q] > 0 and slots[q] > 0
                         and (n := whole if takes is None else takes.pages(i, q, whole)) <= free[q]), (-1, 0))
            if r < 0:
                break
            if takes is not None:
                takes.restored(i, r)
        slots[r] -= 1
        caps[r] -= 1
        free[r] -= n
        ranks.append(r)
        pages.append(n)
    return np.array(ranks, np.int64), np.array(pages, np.int64)
