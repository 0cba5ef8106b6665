"""Prompt prefixes shared by reference on a GPU: the state's side of a prefix cache (vLLM's automatic prefix
caching, SGLang's radix cache, at one level: a workload's `prefix_group`).

Why. Sequences of one group (n samples of a prompt, one system prompt or few-shot block before many questions)
begin with the same tokens, so their KV for those tokens is the same. On a GPU that holds a group's prefix, a new
member takes its pages by reference and prefills only the rest of its prompt.

The model, kept exact by every primitive:
- A group's prefix on a GPU is the whole pages of its shared tokens, `prefix_tokens` (at most the member's context
  less one token, so that the member's own prefill computes its last token's logits), held by reference. The partial
  page where the members diverge is each member's own. With `tails` (copy-on-write below a page), its shared tokens,
  the prefix's `tail`, are copied into a taker's first own page instead of recomputed (`share_span`): from the
  creator's rows in the forward that writes them (the executor writes them to every taker's page beside the
  creator's), or later from one more page the prefix keeps (where it has room), a device-local copy of that many
  tokens' KV that the `share` op carries and the simulator prices. Without `tails` the partial page is recomputed
  (vLLM's prefix cache hashes whole blocks only).
- The prefix is created by the first member whose prefill passes it on that GPU: the chunk that writes its last
  token turns the member's first pages into the group's (`_create`; nothing moves). A member whose prefill starts
  on that GPU in that forward or later takes it (`attach`): it holds the prefix pages by reference and its
  prefill stands at `prefix_tokens` (`sharing_starts`; in the creating forward the executor runs the creator's
  attention first, so the prefix's KV is written before a taker reads it).
- The prefix's pages are counted once on the GPU (`pages_used`), beside each holder's own pages (`table.pages`:
  the pages past the prefix). A holder lets go whenever its device pages go (finish, evict, YIELD, OFFLOAD,
  MIGRATE: its KV moves whole, the prefix included, and arrives as its own pages). Nothing moves when a prefix is
  shared or let go, so the ops that say so (`share`, `unshare`) carry no bytes.
- A prefix with no holder stays on its GPU (its pages still counted) while members of its group have not started
  their prefill, or wait in a host pool (`_parked`); once none is left, the last holder's going drops it
  (`unshare`), and one that no one holds then is dropped after the instance's next run (`sweep_prefixes`). A batch
  job knows what is still to come: the prefix is kept as long as it can be taken, unless the GPU needs its pages: a
  primitive that would overfill it drops unheld prefixes first, the longest unheld first (`_make_room`), as a
  prefix cache evicts on demand. The policies see every prefix's pages as taken (`Snapshot.pages_capacity` is less
  by them, `Snapshot.active_shared` says what each holder holds of them), so their admissions leave them room; an
  instance whose policy runs nothing drops its unheld prefixes (`drop_unheld`).
- Prompts prefilled to host share within their forward (`share_in_forward`): the first of a group on a GPU writes
  the prefix, kept there as above when its pages fit beside what the GPU holds; a later prefill takes it.
- A suspended member restored onto the GPU whose cache holds its host copy, or (`resume_anywhere`) resumed onto
  another GPU of its node, takes the prefix there (`attach_restored`): the restore copies only the rest of its KV
  (its host copy stays whole).
- PARTITION refuses a holder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.core.cascade import CascadeRule
from batchgen.core.sequences import PENDING, SUSPENDED, InvariantError


@dataclass
class GroupPrefix:
    """One group's prefix on one GPU."""

    tokens: int       # shared tokens: whole pages
    pages: int        # pages it holds, counted once on its GPU (its whole pages, and its tail's page)
    holders: int      # sequences that hold it by reference (the creator included while it does)
    pins: int = 0     # prefills about to take it or reading it in their forward: not dropped meanwhile
    tail: int = 0     # shared tokens past `tokens`, in one more page of its own: copied into each taker's first page


class PrefixPages:
    """Shared prefixes of `ClusterState` (mixed in; it owns the table, `pages_used` and the op logs)."""

    sharing = False  # set by `share_prefixes`; off, none of this runs
    tails = False    # copy-on-write below a page: the shared tokens of the partial page are copied, not recomputed
    resume_anywhere = False  # a resume onto another GPU of its node takes the prefix there (`attach_restored`)
    cascade = CascadeRule()  # which holders decoding together read their prefix once (batchgen.core.cascade)

    def share_prefixes(self, group: np.ndarray, prefix_len: np.ndarray, cascade: CascadeRule | None = None,
                       host: bool = False, tails: bool = False, fetch: bool = False,
                       resume_anywhere: bool = False) -> None:
        """Let the sequences of each group share their prefix's pages on a GPU (a job with prefix caching on), and
        those decoding together read them by `cascade`; `host`: their host copies share it on a node too
        (batchgen.core.host_prefixes); `tails`: the shared tokens of the page where members diverge are copied;
        `fetch`: a prefix another GPU of the instance holds is copied from there (batchgen.core.prefix_fetch);
        `resume_anywhere`: a host copy resumed onto another GPU of its node takes the prefix there too, not only on
        the GPU whose cache holds it (`attach_restored`)."""
        group, prefix_len = np.asarray(group, np.int64), np.asarray(prefix_len, np.int64)
        if group.size != len(self.table) or prefix_len.size != len(self.table):
            raise ValueError("share_prefixes needs one group and one prefix length per sequence")
        self.sharing, self.tails, self.fetch = True, bool(tails), bool(fetch)
        self.resume_anywhere = bool(resume_anywhere)
        self.prefix_fetched = 0  # prefix tokens copied from another GPU instead of computed there
        self.cascade = cascade or CascadeRule()
        self.prefix_group = group
        self.prefix_len = prefix_len
        self.prefix_held = np.zeros(len(self.table), np.int64)  # shared tokens each sequence holds by reference
        self.prefix_taken = 0  # prompt tokens whose KV a prefill took by reference instead of computing it
        self.prefix_restored = 0  # tokens whose KV a restore took by reference instead of copying it from host
        self.prefix_resumed = 0  # of those, taken by resumes from another GPU's host copy (`resume_anywhere`)
        self.prefixes: dict[tuple[int, int], GroupPrefix] = {}  # (GPU, group) -> its prefix there
        grouped = group[group >= 0]
        # members of each group that have not started their prefill (a preempted one starts again)
        self.group_left = np.bincount(grouped, minlength=int(grouped.max()) + 1 if grouped.size else 0)
        self._gpus_of_group: dict[int, set[int]] = {}  # group -> GPUs with its prefix
        self._exhausted: set[int] = set()  # groups none of whose members is left to start, with prefixes to drop
        self._after_forward: list[list[tuple[int, int]]] = [[] for _ in range(self.topo.num_instances)]
        self._read_in_forward: list[list] = [[] for _ in range(self.topo.num_instances)]  # pinned till swept
        self.unheld_pages = np.zeros(self.topo.num_gpus, np.int64)  # pages of kept prefixes no one holds, per GPU
        self.prefix_pages = np.zeros(self.topo.num_gpus, np.int64)  # pages of every prefix, per GPU
        self.group_parked = np.zeros(self.group_left.size, np.int64)  # members waiting in a host pool
        if host:
            self._host_prefixes_init()

    def share_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The whole pages of each sequence's shared prefix that leave its last context token to compute (0 where a
        sequence is in no group)."""
        t = self.table
        tokens = np.minimum(self.prefix_len[ids], t.context(ids) - 1) // self.page_tokens * self.page_tokens
        return np.where(self.prefix_group[ids] >= 0, np.maximum(tokens, 0), 0)

    def share_span(self, ids: np.ndarray) -> np.ndarray:
        """The shared tokens each sequence can take: its whole pages (`share_tokens`) and, with `tails`, the shared
        tokens past them that leave its last context token to compute (0 where it takes no whole page)."""
        whole = self.share_tokens(ids)
        if not self.tails:
            return whole
        span = np.minimum(self.prefix_len[ids], self.table.context(ids) - 1)
        return np.where(whole > 0, span, 0)

    def prefixes_on(self, gpus: np.ndarray) -> dict[tuple[int, int], tuple[int, int]]:
        """(rank, group) -> (tokens, tail) of each prefix on these GPUs (rank: the GPU's index in `gpus`)."""
        rank = {int(g): r for r, g in enumerate(gpus.tolist())}
        return {(rank[g], group): (e.tokens, e.tail) for (g, group), e in self.prefixes.items() if g in rank}

    def restore_shares(self, ids: np.ndarray, gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Suspended sequences' home ranks among `gpus` (the GPU whose cache holds their host copy; -1: none of
        them) and the prefix tokens each would take restored there (`attach_restored`'s rule; 0: none)."""
        rank_of = {int(g): r for r, g in enumerate(gpus.tolist())}
        home = np.array([rank_of.get(g, -1) for g in self.table.kv_gpu[ids].tolist()], np.int64)
        tokens = np.zeros(ids.size, np.int64)
        here = np.flatnonzero(home >= 0)
        tokens[here] = [0 if e is None else e.tokens for e in self._restore_takes(ids[here], gpus[home[here]])]
        return home, tokens

    def _restore_takes(self, ids: np.ndarray, gpus: np.ndarray) -> list[GroupPrefix | None]:
        """The prefix each sequence would take restored onto its GPU: its group's there, if it shares as much."""
        share = self.share_tokens(ids).tolist()
        out: list[GroupPrefix | None] = []
        for sid, g, n in zip(ids.tolist(), gpus.tolist(), share):
            entry = self.prefixes.get((int(g), int(self.prefix_group[sid])))  # (none for group -1)
            out.append(entry if entry is not None and n >= entry.tokens else None)
        return out

    def sharing_starts(self, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Where each of a forward's chunks starts with prefix caching: a pending sequence's past its group's prefix
        on its GPU, whether the prefix is there already or a chunk of this forward creates it (the first that
        passes it; the executor runs a creator's attention before the others' on its GPU, as vLLM writes a step's
        KV before attention reads it); every other chunk where it stands."""
        t, out = self.table, starts.copy()
        # prefixes this forward creates: (GPU, group) -> (tokens, tail its creator's chunk writes)
        made: dict[tuple[int, int], tuple[int, int]] = {}
        pending = t.where[ids] == PENDING
        shared, span = self.share_tokens(ids).tolist(), self.share_span(ids).tolist()
        for i in np.flatnonzero(~pending).tolist():  # a prefill under way that passes its prefix now
            sid, key = int(ids[i]), (int(gpus[i]), int(self.prefix_group[ids[i]]))
            tokens, end = shared[i], int(starts[i] + lens[i])
            if (tokens > 0 and starts[i] < tokens <= end and not self.prefix_held[sid]
                    and key not in self.prefixes and key not in made):
                made[key] = (tokens, min(span[i], end) - tokens)
        for i in np.flatnonzero(pending).tolist():
            key = (int(gpus[i]), int(self.prefix_group[ids[i]]))
            tokens = shared[i]
            if tokens <= 0:
                continue
            there = (self.prefixes[key].tokens, self.prefixes[key].tail) if key in self.prefixes else made.get(key)
            if there is not None:
                if tokens >= there[0]:
                    out[i] = there[0] + min(there[1], span[i] - there[0])
            elif lens[i] >= tokens:  # its first chunk passes the prefix: it creates it
                made[key] = (tokens, min(span[i], int(lens[i])) - tokens)
        return out

    def attach(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
               whole_lookahead: int | None = None) -> None:
        """Pending sequences (already taken from their queue) start on their GPUs holding their group's prefix by
        reference (`sharing_starts`): their prefill stands at `starts` (past the prefix's whole pages, and the tail
        tokens copied into their first own page), their own pages none yet; or, with `whole_lookahead`, the coming
        forward prefills the rest of each context whole (`prefilled_to_gpu` past the prefix), pages for it and that
        many more tokens taken now."""
        t = self.table
        self._require(ids, t.where[ids] == PENDING, "pending (a prefix is taken when a prefill starts)")
        none = np.zeros(ids.size, np.int64)
        # prefixes already there (a tail its creator writes in this forward may be more than the prefix keeps)
        P = self.page_tokens
        ok = (starts > 0) & (starts // P == self.sharing_starts(ids, gpus, none, none) // P)
        self._require(ids, ok, "given the ready prefix of their group on that GPU")
        whole = np.empty(ids.size, np.int64)
        for i, (sid, g) in enumerate(zip(ids.tolist(), gpus.tolist())):
            entry = self.prefixes[(g, int(self.prefix_group[sid]))]
            if not entry.holders:  # a kept prefix taken again
                self.unheld_pages[g] -= entry.pages
            entry.holders += 1
            whole[i] = entry.tokens
        self.prefix_held[ids] = whole
        self.prefix_taken += int(starts.sum())
        if whole_lookahead is None:
            self._join_gpu(instance, ids, gpus, lookahead_tokens=0, reserve=False)
            t.prefilled[ids] = starts
            self.num_part_prefilled += ids.size
        else:
            self.prefill_computed += int((t.context(ids) - starts).sum())
            self._join_gpu(instance, ids, gpus, whole_lookahead)
        self._log_share(instance, ids, gpus, whole, np.zeros(ids.size, bool), starts - whole)

    def _log_share(self, instance: int, ids: np.ndarray, gpus: np.ndarray, tokens: np.ndarray, creates: np.ndarray,
                   tail: np.ndarray, src: int = -1) -> None:
        """The `share` ops of prefixes created or taken: whole pages by reference, and `tail` tokens copied on the
        GPU (a taker's, into its first own page; a creator's, into its prefix's tail page); or (`src`, a created
        one) the prefix copied whole from that GPU's."""
        tail = np.asarray(tail, np.int64)
        copied = tail if src < 0 else tail + tokens
        self.oplogs[instance].add("share", ids, gpus.astype(np.int64), self.prefix_group[ids], tokens, creates, tail,
                                  copied * float(self.kv_bytes_per_token), np.full(ids.size, src, np.int64))

    def share_in_forward(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """Prompts prefilled to host (`start_prefill_to_host`) share their group's prefix within their forward: on
        each GPU the first of a group without a prefix there writes it and the others take it and compute only the
        rest; every one's KV then goes to its host copy whole, the prefix included. The prefix stays on the GPU
        (no holder) while members of its group are left to start and its pages fit, else it goes after the forward.
        Returns where each prefill starts."""
        t = self.table
        ctx = t.context(ids)
        self.fetch_prefixes(instance, ids, gpus)  # copied from a sibling GPU where it lacks one (core.prefix_fetch)
        at = self.sharing_starts(ids, gpus, np.zeros(ids.size, np.int64), ctx)
        take = at > 0
        taken = {(int(g), int(self.prefix_group[sid])) for sid, g in zip(ids[take].tolist(), gpus[take].tolist())}
        grouped = self.prefix_group[ids]
        starting = np.bincount(grouped[grouped >= 0], minlength=self.group_left.size)
        later = self.group_left - starting  # members still to start after this forward (`prefills_started` follows)
        shared = self.share_tokens(ids)
        writes: dict[tuple[int, int], int] = {}  # (GPU, group) -> the prompt that writes it for the others
        for i in np.flatnonzero(~take & (shared > 0)).tolist():
            key = (int(gpus[i]), int(grouped[i]))
            if (key in taken or later[key[1]] > 0) and key not in self.prefixes and key not in writes:
                writes[key] = i
        if writes:
            made = np.array(sorted(writes.values()), np.int64)
            tokens = shared[made]
            kept_tail = np.zeros(made.size, np.int64)  # tokens of a kept prefix's tail page
            tails = self.share_span(ids[made]) - tokens
            for j, (i, n, tail) in enumerate(zip(made.tolist(), tokens.tolist(), tails.tolist())):
                g, group, pages = int(gpus[i]), int(self.prefix_group[ids[i]]), n // self.page_tokens
                if self.pages_used[g] + pages <= self.gpu_pages[g]:  # its members park here: kept for them too
                    if tail and self.pages_used[g] + pages < self.gpu_pages[g]:  # and its tail, where a page is left
                        kept_tail[j], pages = tail, pages + 1
                    self._keep(g, group, GroupPrefix(n, pages, 0, tail=int(kept_tail[j])))
                    self._gpu_holds(g, int(self.pages_used[g]) + pages)
                    self.unheld_pages[g] += pages
                else:  # kept for the forward only (its takers there copy the tail from the writer's rows)
                    self._after_forward[instance].append((g, group))
            self._log_share(instance, ids[made], gpus[made], tokens, np.ones(made.size, bool), kept_tail)
        if take.any():
            whole = at[take] // self.page_tokens * self.page_tokens  # a tail is less than a page
            self._log_share(instance, ids[take], gpus[take], whole, np.zeros(whole.size, bool), at[take] - whole)
            # read in the forward: kept until it has run (`sweep_prefixes`)
            self._read_in_forward[instance].append(self.pin_prefixes(ids, gpus, at))
            self.prefill_computed -= int(at.sum())
            self.prefix_taken += int(at.sum())
        return at

    def _create(self, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
                ends: np.ndarray) -> None:
        """Chunks about to be written (`prefill_chunks`, pages set): the first that passes its group's prefix on a
        GPU without one creates it from the sequence's first pages (its own until now: no page count changes)."""
        t, made, kept_tail = self.table, [], []
        shared, span = self.share_tokens(ids).tolist(), self.share_span(ids).tolist()
        for i, (sid, g, s, e) in enumerate(zip(ids.tolist(), gpus.tolist(), starts.tolist(), ends.tolist())):
            group = int(self.prefix_group[sid])
            tokens = shared[i]
            if tokens <= 0 or not s < tokens <= e or self.prefix_held[sid] or (g, group) in self.prefixes:
                continue
            pages = tokens // self.page_tokens
            tail = min(span[i], e) - tokens  # the tail this chunk writes, kept in a page of its own where one is left
            if tail and self.pages_used[g] < self.gpu_pages[g]:
                self._gpu_holds(g, int(self.pages_used[g]) + 1)
            else:
                tail = 0
            self._keep(g, group, GroupPrefix(tokens, pages + (tail > 0), 1, tail=tail))
            self.prefix_held[sid] = tokens
            t.pages[sid] -= pages
            made.append(i)
            kept_tail.append(tail)
        if made:
            made = np.array(made, np.int64)
            self._log_share(instance, ids[made], gpus[made], self.prefix_held[ids[made]], np.ones(made.size, bool),
                            np.array(kept_tail, np.int64))

    def pin_prefixes(self, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray) -> list[GroupPrefix]:
        """Keep the prefixes there that these prefills take (those with a start) from being dropped to make room
        while they are being taken; returns them, for `unpin`."""
        pinned = []
        for sid, g in zip(ids[starts > 0].tolist(), gpus[starts > 0].tolist()):
            entry = self.prefixes.get((g, int(self.prefix_group[sid])))
            if entry is not None:  # (one this forward creates has its creator as a holder)
                entry.pins += 1
                pinned.append(entry)
        return pinned

    @staticmethod
    def unpin(pinned: list[GroupPrefix]) -> None:
        for entry in pinned:
            entry.pins -= 1

    def prefills_started(self, ids: np.ndarray) -> None:
        """Pending sequences started their prefill (after the boundary's shares): their groups have fewer left."""
        grouped = self.prefix_group[ids]
        for group in grouped[grouped >= 0].tolist():
            self.group_left[group] -= 1
            if not self.group_left[group] and group in self._gpus_of_group:
                self._exhausted.add(group)

    def back_to_pending(self, ids: np.ndarray) -> None:
        """Evicted sequences will start their prefill again."""
        grouped = self.prefix_group[ids]
        np.add.at(self.group_left, grouped[grouped >= 0], 1)
        self._exhausted.difference_update(grouped[grouped >= 0].tolist())

    def _parked(self, group: int) -> bool:
        """Whether members of the group wait in a host pool: restored onto the GPU whose cache holds their host copy,
        they take its prefix there (`attach_restored`). (Counted per group, not per GPU: a prefix may stay on a GPU
        none of them returns to, until it is needed for room.)"""
        return bool(self.group_parked[group])

    def parked(self, ids: np.ndarray, delta: int) -> None:
        """Sequences joined (+1) or left (-1) a host pool."""
        grouped = self.prefix_group[ids]
        grouped = grouped[grouped >= 0]
        if grouped.size:
            np.add.at(self.group_parked, grouped, delta)

    def attach_restored(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """Suspended sequences about to be restored onto `gpus` (the GPU whose cache holds their host copy, or with
        `resume_anywhere` another of its node): each whose group's prefix is there takes it by reference, so its
        restore copies only the rest of its KV and its own pages are those past the prefix. Returns the tokens each
        takes (0: none). A GPU without the prefix may have it copied from another first (`fetch_prefixes`)."""
        at = np.zeros(ids.size, np.int64)
        if not self.prefixes:
            return at
        self.fetch_prefixes(instance, ids, gpus, resuming=True)
        for i, (g, entry) in enumerate(zip(gpus.tolist(), self._restore_takes(ids, gpus))):
            if entry is None:
                continue
            if not entry.holders:
                self.unheld_pages[g] -= entry.pages
            entry.holders += 1
            at[i] = entry.tokens
        take = np.flatnonzero(at)
        if take.size:
            self.prefix_held[ids[take]] = at[take]
            self.prefix_restored += int(at.sum())
            self.prefix_resumed += int(at[self.table.kv_gpu[ids] != gpus].sum())
            self._log_share(instance, ids[take], gpus[take], at[take], np.zeros(take.size, bool),
                            np.zeros(take.size, np.int64))
        return at

    def _keep(self, gpu: int, group: int, entry: GroupPrefix) -> None:
        self.prefixes[(gpu, group)] = entry
        self.prefix_pages[gpu] += entry.pages
        self._gpus_of_group.setdefault(group, set()).add(gpu)

    def _drop(self, instance: int, gpu: int, group: int, unheld: bool = True) -> None:
        """A prefix no one holds leaves its GPU (its pages freed there by the `unshare` op); `unheld`: it was kept
        unheld (counted in `unheld_pages`), not let go just now."""
        entry = self.prefixes.pop((gpu, group))
        self.pages_used[gpu] -= entry.pages
        self.prefix_pages[gpu] -= entry.pages
        if unheld:
            self.unheld_pages[gpu] -= entry.pages
        gpus = self._gpus_of_group[group]
        gpus.discard(gpu)
        if not gpus:
            del self._gpus_of_group[group]
            self._exhausted.discard(group)
        self.oplogs[instance].add("unshare", np.array([group], np.int64), np.array([gpu], np.int64))

    def _drop_tail(self, instance: int, gpu: int, group: int) -> None:
        """A prefix lets its tail's page go, the GPU needing it: later takers compute those tokens (`untail`)."""
        entry = self.prefixes[(gpu, group)]
        entry.tail, entry.pages = 0, entry.pages - 1
        self.pages_used[gpu] -= 1
        self.prefix_pages[gpu] -= 1
        self.unheld_pages[gpu] -= 0 if entry.holders else 1
        self.oplogs[instance].add("untail", np.array([group], np.int64), np.array([gpu], np.int64))

    def sweep_prefixes(self, instance: int) -> None:
        """After an instance's run: its prefixes that no one holds and no member is left to take are dropped, and
        those its forward wrote only for itself (`share_in_forward`) too."""
        for gpu, group in self._after_forward[instance]:
            self.oplogs[instance].add("unshare", np.array([group], np.int64), np.array([gpu], np.int64))
        self._after_forward[instance].clear()
        for pinned in self._read_in_forward[instance]:
            self.unpin(pinned)
        self._read_in_forward[instance].clear()
        if not self._exhausted:
            return
        mine = set(self._instance_gpus[instance].tolist())
        for group in list(self._exhausted):
            for gpu in sorted(self._gpus_of_group.get(group, set()) & mine):
                entry = self.prefixes[(gpu, group)]
                if not entry.holders and not entry.pins and not self._parked(group):
                    self._drop(instance, gpu, group)

    def _make_room(self, gpu: int) -> int:
        """GPU `gpu` holds more pages than it has: drop the prefixes there that no one holds, the longest unheld
        first, then the tails' pages of those held, until it fits (or none is left). Returns the pages it holds
        then."""
        for tails in (False, True):
            for (g, group), entry in list(self.prefixes.items()):  # in the order they were last let go
                if self.pages_used[gpu] <= self.gpu_pages[gpu]:
                    return int(self.pages_used[gpu])
                if g != gpu or entry.pins:
                    continue
                if not tails and not entry.holders:
                    self._drop(int(self.topo.gpu_instance[gpu]), gpu, group)
                elif tails and entry.tail:
                    self._drop_tail(int(self.topo.gpu_instance[gpu]), gpu, group)
        return int(self.pages_used[gpu])

    def drop_unheld(self, instance: int) -> bool:
        """An instance's policy runs nothing: the prefixes on its GPUs that no one holds (kept for members still to
        start, their pages taken from what the policy may admit) go, so that those members can start, and the
        tails' pages of those held (the holders may need them to grow). Returns whether any went."""
        mine = [(gpu, group, e) for (gpu, group), e in self.prefixes.items()
                if not e.pins and self.topo.gpu_instance[gpu] == instance and (e.tail or not e.holders)]
        for gpu, group, e in mine:
            if e.holders:
                self._drop_tail(instance, gpu, group)
            else:
                self._drop(instance, gpu, group)
        return bool(mine)

    def _let_go(self, ids: np.ndarray) -> None:
        """The sequences' device pages go: each lets go of the prefix it holds; the last holder drops it unless a
        member of its group is still to start."""
        held = ids[self.prefix_held[ids] > 0]
        for sid in held.tolist():
            g, group = int(self.table.where[sid]), int(self.prefix_group[sid])
            entry = self.prefixes[(g, group)]
            entry.holders -= 1
            if entry.holders == 0:
                if not self.group_left[group] and not entry.pins and not self._parked(group):
                    self._drop(int(self.topo.gpu_instance[g]), g, group, unheld=False)
                else:  # kept for the members still to start: the newest unheld, dropped last to make room
                    self.prefixes[(g, group)] = self.prefixes.pop((g, group))
                    self.unheld_pages[g] += entry.pages
        self.prefix_held[held] = 0

    def prefix_pages_needed(self, ids: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """A holder's own pages: those of its tokens less the prefix's."""
        return np.maximum(pages - self.prefix_held[ids] // self.page_tokens, 0)

    def forget_prefixes(self) -> None:
        """No prefix on any GPU and no holder: a recovery's output state, once every sequence has finished (its
        counters stay)."""
        if not self.sharing:
            return
        self.prefix_held[:] = 0
        self.prefixes.clear()
        self._gpus_of_group.clear()
        self._exhausted.clear()
        self._after_forward = [[] for _ in self._after_forward]
        self._read_in_forward = [[] for _ in self._read_in_forward]
        for counts in (self.unheld_pages, self.prefix_pages, self.group_left, self.group_parked):
            counts[:] = 0

    def check_prefixes(self) -> np.ndarray:
        """Recount the prefixes from their holders; returns the pages they hold per GPU (for the page check)."""
        pages = np.zeros(self.topo.num_gpus, np.int64)
        if not self.sharing:
            return pages
        t = self.table
        holders = np.flatnonzero(self.prefix_held)
        if np.any(t.where[holders] < 0) or np.any(t.host_resident[holders]) or np.any(t.tp[holders] != 1):
            raise InvariantError("a sequence holds a shared prefix while not running device-resident on one GPU")
        count: dict[tuple[int, int], int] = {}
        for sid in holders.tolist():
            key = (int(t.where[sid]), int(self.prefix_group[sid]))
            count[key] = count.get(key, 0) + 1
            entry = self.prefixes.get(key)
            if entry is None or entry.tokens != self.prefix_held[sid]:
                raise InvariantError(f"sequence {sid} holds a prefix GPU {key[0]} does not have for group {key[1]}")
        unheld = np.zeros(self.topo.num_gpus, np.int64)
        for (g, group), entry in self.prefixes.items():
            if count.get((g, group), 0) != entry.holders:
                raise InvariantError(f"group {group}'s prefix on GPU {g} counts {entry.holders} holders, "
                                     f"{count.get((g, group), 0)} hold it")
            pages[g] += entry.pages
            unheld[g] += 0 if entry.holders else entry.pages
        if not np.array_equal(unheld, self.unheld_pages) or not np.array_equal(pages, self.prefix_pages):
            raise InvariantError("the pages of prefixes (or of those no one holds) drifted from their count")
        waiting = self.prefix_group[(t.where == SUSPENDED) & (self.prefix_group >= 0)]
        if not np.array_equal(np.bincount(waiting, minlength=self.group_parked.size), self.group_parked):
            raise InvariantError("the members of groups waiting in host pools drifted from their count")
        return pages
