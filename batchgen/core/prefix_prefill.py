"""A prefill's side of the prefix cache: where each prompt starts on a GPU that holds some of its prefix levels, and
the levels its forward writes for the others (batchgen.core.prefix_pages holds the model and its bookkeeping).

A pending prompt takes the deepest level of its chain on its GPU (`_deepest`): its prefill starts past that level's
whole pages (and, for its own group's level, the tail tokens copied below a page). Each deeper level its chunk
passes, where the GPU has none, is created by it from its own pages past the level it holds (`_create`): the first
chunk that passes a level on a GPU creates it, and a later chunk of the same forward that reaches it takes it.
"""

from __future__ import annotations

import numpy as np

from batchgen.core.prefix_pages import GroupPrefix, PrefixPages
from batchgen.core.sequences import PENDING


class PrefixPrefill(PrefixPages):
    """Prefills that take and create shared prefixes (mixed into `ClusterState` through `PrefixFetch`)."""

    def _tail(self, sid: int, group: int, span: int, end: int, tokens: int) -> int:
        """The tail a chunk ending at `end` writes past a level of `tokens`: its own group's shared tokens below a
        page (an outer level's partial page is its inner groups' own)."""
        return min(span, end) - tokens if group == int(self.prefix_group[sid]) else 0

    def sharing_starts(self, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Where each of a forward's chunks starts with prefix caching: a pending sequence's past the deepest level of
        its chain on its GPU, whether it is there already or a chunk of this forward creates it (the first that
        passes it; the executor runs a creator's attention before the others' on its GPU, as vLLM writes a step's
        KV before attention reads it); every other chunk where it stands."""
        t, out = self.table, starts.copy()
        # levels this forward creates: (GPU, group) -> (tokens, tail its creator's chunk writes)
        made: dict[tuple[int, int], tuple[int, int]] = {}
        pending = t.where[ids] == PENDING
        span, ctx = self.share_span(ids).tolist(), t.context(ids).tolist()
        for i in np.flatnonzero(~pending).tolist():  # a prefill under way that passes levels now
            sid, g = int(ids[i]), int(gpus[i])
            s, end = int(starts[i]), int(starts[i] + lens[i])
            for a, tokens in self.prefix_levels(sid, ctx[i]):
                if tokens > self.prefix_held[sid] and s < tokens <= end and (g, a) not in self.prefixes:
                    made.setdefault((g, a), (tokens, self._tail(sid, a, span[i], end, tokens)))
        for i in np.flatnonzero(pending).tolist():
            sid, g = int(ids[i]), int(gpus[i])
            levels = self.prefix_levels(sid, ctx[i])
            if not levels:
                continue
            k, a, there = self._deepest(g, levels, made)
            start = 0
            if k >= 0:
                tail = self.prefixes[(g, a)].tail if (g, a) in self.prefixes else made[(g, a)][1]
                start = out[i] = there + (min(tail, span[i] - there) if a == int(self.prefix_group[sid]) else 0)
            end = start + min(int(lens[i]), ctx[i] - start) if start else int(lens[i])
            for b, tokens in levels[k + 1:]:  # deeper levels its first chunk passes: it creates them
                if tokens > end:
                    break
                if (g, b) not in self.prefixes:
                    made.setdefault((g, b), (tokens, self._tail(sid, b, span[i], end, tokens)))
        return out

    def ready_to_take(self, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Whether the level each pending sequence is to take at `starts` is on its GPU now (one a chunk of this
        forward creates is there once that chunk has been taken)."""
        none = np.zeros(ids.size, np.int64)
        P = self.page_tokens
        return (starts > 0) & (starts // P == self.sharing_starts(ids, gpus, none, none) // P)

    def attach(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
               whole_lookahead: int | None = None) -> None:
        """Pending sequences (already taken from their queue) start on their GPUs holding a level of their prefix by
        reference (`sharing_starts`): their prefill stands at `starts` (past the level's whole pages, and the tail
        tokens copied into their first own page), their own pages none yet; or, with `whole_lookahead`, the coming
        forward prefills the rest of each context whole (`prefilled_to_gpu` past the level, creating the deeper
        levels it passes), pages for it and that many more tokens taken now."""
        t = self.table
        self._require(ids, t.where[ids] == PENDING, "pending (a prefix is taken when a prefill starts)")
        # levels already there (a tail its creator writes in this forward may be more than the prefix keeps)
        self._require(ids, self.ready_to_take(ids, gpus, starts), "given the ready prefix of their group on that GPU")
        whole, groups = np.empty(ids.size, np.int64), np.empty(ids.size, np.int64)
        for i, (sid, g, c) in enumerate(zip(ids.tolist(), gpus.tolist(), t.context(ids).tolist())):
            _, groups[i], _ = self._deepest(g, self.prefix_levels(sid, c))
            whole[i] = self._hold(g, int(groups[i])).tokens
        self.prefix_held[ids], self.prefix_holds[ids] = whole, groups
        self.prefix_taken += int(starts.sum())
        self._log_share(instance, ids, gpus, groups, whole, np.zeros(ids.size, bool), starts - whole)
        if whole_lookahead is None:
            self._join_gpu(instance, ids, gpus, lookahead_tokens=0, reserve=False)
            t.prefilled[ids] = starts
            self.num_part_prefilled += ids.size
        else:
            ctx = t.context(ids)
            self.prefill_computed += int((ctx - starts).sum())
            self._join_gpu(instance, ids, gpus, whole_lookahead)
            if self.nested:
                self._create(instance, ids, gpus, starts, ctx)

    def share_in_forward(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """Prompts prefilled to host (`start_prefill_to_host`) share their prefix levels within their forward: on
        each GPU each prompt takes the deepest level there or written by an earlier prompt of the forward, and
        writes the deeper ones for the others; every one's KV then goes to its host copy whole, the prefix included.
        A level written stays on the GPU (no holder) while members at or below it are left to start and its pages
        fit (and its parent's stayed), else it goes after the forward. Returns where each prefill starts."""
        t = self.table
        ctx = t.context(ids).tolist()
        self.fetch_prefixes(instance, ids, gpus)  # copied from a sibling GPU where it lacks one (core.prefix_fetch)
        span = self.share_span(ids).tolist()
        grouped = self.prefix_group[ids]
        starting = np.zeros(self.group_left.size, np.int64)
        self._count_up(grouped[grouped >= 0], 1, starting)
        later = self.group_left - starting  # members still to start after this forward (`prefills_started` follows)
        at = np.zeros(ids.size, np.int64)
        made: dict[tuple[int, int], tuple[int, int]] = {}  # levels this forward writes: -> (tokens, tail)
        plans = []  # per prompt: (taken level or -1, [(level, tokens, tail, parent level)] it writes)
        for i, (sid, g) in enumerate(zip(ids.tolist(), gpus.tolist())):
            levels = self.prefix_levels(sid, ctx[i])
            k, a, there = self._deepest(g, levels, made) if levels else (-1, -1, 0)
            if k >= 0:
                tail = self.prefixes[(g, a)].tail if (g, a) in self.prefixes else made[(g, a)][1]
                at[i] = there + (min(tail, span[i] - there) if a == int(grouped[i]) else 0)
            writes, parent = [], a
            for b, tokens in levels[k + 1:]:
                if (g, b) in self.prefixes or (g, b) in made:
                    break
                made[(g, b)] = (tokens, self._tail(sid, b, span[i], ctx[i], tokens))
                writes.append((b, tokens, made[(g, b)][1], parent))
                parent = b
            plans.append((a if k >= 0 else -1, writes))
        read = {(int(gpus[i]), a) for i, (a, _) in enumerate(plans) if a >= 0}
        for i, (sid, g) in enumerate(zip(ids.tolist(), gpus.tolist())):
            taken, writes = plans[i]
            one, gpu = ids[i:i + 1], gpus[i:i + 1]
            if taken >= 0:
                whole = at[i] // self.page_tokens * self.page_tokens  # a tail is less than a page
                self._log_share(instance, one, gpu, np.array([taken]), np.array([whole]), np.zeros(1, bool),
                                np.array([at[i] - whole]))
            needed, below = [], False  # a level someone takes, now or later, or the one a needed level extends
            for b, *_ in reversed(writes):
                below = below or (g, b) in read or later[b] > 0
                needed.append(below)
            for (b, tokens, tail, parent), need in zip(writes, reversed(needed)):
                if not need:
                    break  # no one takes it, now or later: not written for others (nor any deeper one)
                kept = self._keep_written(g, b, tokens, tail, parent)
                self._log_share(instance, one, gpu, np.array([b]), np.array([tokens]), np.ones(1, bool),
                                np.array([tail if kept else 0]), parents=np.array([parent]))
                if not kept:  # kept for the forward only (its takers there copy the tail from the writer's rows)
                    self._after_forward[instance].append((g, b))
        if at.any():
            # read in the forward: kept until it has run (`sweep_prefixes`)
            self._read_in_forward[instance].append(self.pin_prefixes(ids, gpus, at))
            self.prefill_computed -= int(at.sum())
            self.prefix_taken += int(at.sum())
        return at

    def _keep_written(self, gpu: int, group: int, tokens: int, tail: int, parent: int) -> bool:
        """A level a prefill to host writes stays on its GPU, no one holding it, where its pages fit beside what the
        GPU holds and the level it extends is there (its tail's page too, where one more is left)."""
        below = self.prefixes.get((gpu, parent)) if parent >= 0 else None
        if parent >= 0 and below is None:
            return False
        pages = (tokens - (below.tokens if below is not None else 0)) // self.page_tokens
        if self.pages_used[gpu] + pages > self.gpu_pages[gpu]:
            return False
        if tail and self.pages_used[gpu] + pages < self.gpu_pages[gpu]:
            pages += 1
        else:
            tail = 0
        self._keep_unheld(gpu, group, GroupPrefix(tokens, pages, 0, tail=tail, parent=parent))
        return True

    def _create(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
                ends: np.ndarray) -> None:
        """Chunks about to be written (`prefill_chunks`, pages set): each level a chunk passes on a GPU without it
        becomes the group's, from the sequence's pages past the level it holds (its own until now: no page count
        changes), which it then holds instead."""
        t = self.table
        span, ctx = self.share_span(ids).tolist(), t.context(ids).tolist()
        for i, (sid, g, s, e) in enumerate(zip(ids.tolist(), gpus.tolist(), starts.tolist(), ends.tolist())):
            for a, tokens in self.prefix_levels(sid, ctx[i]):
                if tokens > e:
                    break
                held = int(self.prefix_held[sid])
                if tokens <= held or tokens <= s or (g, a) in self.prefixes:
                    continue
                pages = (tokens - held) // self.page_tokens
                tail = self._tail(sid, a, span[i], e, tokens)
                if tail and self.pages_used[g] < self.gpu_pages[g]:  # its tail, in a page of its own where one is left
                    self._gpu_holds(g, int(self.pages_used[g]) + 1)
                else:
                    tail = 0
                parent = int(self.prefix_holds[sid])  # its hold passes to the new level, which holds the old one
                self._keep(g, a, GroupPrefix(tokens, pages + (tail > 0), 1, tail=tail, parent=parent))
                self.prefix_held[sid], self.prefix_holds[sid] = tokens, a
                t.pages[sid] -= pages
                one = np.array([sid], np.int64)
                self._log_share(instance, one, np.array([g], np.int64), np.array([a]), np.array([tokens]),
                                np.ones(1, bool), np.array([tail]), parents=np.array([parent]))
