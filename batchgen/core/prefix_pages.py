"""Prompt prefixes shared by reference on a GPU: the state's side of a prefix cache (vLLM's automatic prefix
caching, SGLang's radix cache: a workload's `prefix_group`, nested by its `PrefixTree`).

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
- Nested groups (batchgen.workload.prefix_tree): a sequence's prefix is a chain of levels, its group's ancestors
  outermost first, each level the whole pages of that group's prefix (`prefix_levels`; a level that adds no whole
  page is left out). A GPU holds one entry per level, whose pages are its own segment past the entry it extends
  (`parent`, on the same GPU), which it holds like a sequence does: a system prompt's pages once, whatever the
  number of groups after it. A sequence holds one entry, the deepest it took or created (`prefix_holds`). A prefill
  takes the deepest level there and creates each deeper level its chunk passes (`batchgen.core.prefix_prefill`); an
  entry dropped lets go of its parent, which the same rules then keep or drop. Counts of members still to start or
  parked are kept for each group and every ancestor (`group_left`, `group_parked`). Host copies share their own
  group's level only (batchgen.core.host_prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.core.cascade import CascadeRule
from batchgen.core.sequences import SUSPENDED, InvariantError
from batchgen.workload.prefix_tree import PrefixTree


@dataclass
class GroupPrefix:
    """One group's prefix on one GPU."""

    tokens: int       # shared tokens: whole pages
    pages: int        # pages it holds, counted once on its GPU (its whole pages, and its tail's page)
    holders: int      # sequences that hold it by reference (the creator included while it does)
    pins: int = 0     # prefills about to take it or reading it in their forward: not dropped meanwhile
    tail: int = 0     # shared tokens past `tokens`, in one more page of its own: copied into each taker's first page
    parent: int = -1  # the group whose entry on this GPU it extends and holds (-1: its pages are all of its tokens)


class PrefixPages:
    """Shared prefixes of `ClusterState` (mixed in; it owns the table, `pages_used` and the op logs)."""

    sharing = False  # set by `share_prefixes`; off, none of this runs
    tails = False    # copy-on-write below a page: the shared tokens of the partial page are copied, not recomputed
    resume_anywhere = False  # a resume onto another GPU of its node takes the prefix there (`attach_restored`)
    cascade = CascadeRule()  # which holders decoding together read their prefix once (batchgen.core.cascade)

    def share_prefixes(self, group: np.ndarray, prefix_len: np.ndarray, cascade: CascadeRule | None = None,
                       host: bool = False, tails: bool = False, fetch: bool = False,
                       resume_anywhere: bool = False, tree: PrefixTree | None = None) -> None:
        """Let the sequences of each group share their prefix's pages on a GPU (a job with prefix caching on), and
        those decoding together read them by `cascade`; `host`: their host copies share it on a node too
        (batchgen.core.host_prefixes); `tails`: the shared tokens of the page where members diverge are copied;
        `fetch`: a prefix another GPU of the instance holds is copied from there (batchgen.core.prefix_fetch);
        `resume_anywhere`: a host copy resumed onto another GPU of its node takes the prefix there too, not only on
        the GPU whose cache holds it (`attach_restored`); `tree`: groups nested in groups (None: one level)."""
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
        self.prefix_holds = np.full(len(self.table), -1, np.int64)  # the group whose entry it holds (-1: none)
        tree = tree or PrefixTree.flat(group, prefix_len)
        self.group_len = tree.length
        self._chain = tree.chains()  # group -> its groups, outermost first
        self.nested = bool((tree.parent >= 0).any())
        self.prefix_taken = 0  # prompt tokens whose KV a prefill took by reference instead of computing it
        self.prefix_restored = 0  # tokens whose KV a restore took by reference instead of copying it from host
        self.prefix_resumed = 0  # of those, taken by resumes from another GPU's host copy (`resume_anywhere`)
        self.prefixes: dict[tuple[int, int], GroupPrefix] = {}  # (GPU, group) -> its prefix there
        # members of each group (at it or below) that have not started their prefill (a preempted one starts again)
        self.group_left = np.zeros(len(tree), np.int64)
        self._count_up(group[group >= 0], 1, self.group_left)
        self._gpus_of_group: dict[int, set[int]] = {}  # group -> GPUs with its prefix
        self._exhausted: set[int] = set()  # groups none of whose members is left to start, with prefixes to drop
        self._after_forward: list[list[tuple[int, int]]] = [[] for _ in range(self.topo.num_instances)]
        self._read_in_forward: list[list] = [[] for _ in range(self.topo.num_instances)]  # pinned till swept
        self.unheld_pages = np.zeros(self.topo.num_gpus, np.int64)  # pages of kept prefixes no one holds, per GPU
        self.prefix_pages = np.zeros(self.topo.num_gpus, np.int64)  # pages of every prefix, per GPU
        self.group_parked = np.zeros(self.group_left.size, np.int64)  # members (at it or below) in a host pool
        if host:
            self._host_prefixes_init()

    def share_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The whole pages of each sequence's shared prefix that leave its last context token to compute (0 where a
        sequence is in no group)."""
        t = self.table
        tokens = np.minimum(self.prefix_len[ids], t.context(ids) - 1) // self.page_tokens * self.page_tokens
        return np.where(self.prefix_group[ids] >= 0, np.maximum(tokens, 0), 0)

    def _count_up(self, groups: np.ndarray, delta: int, counts: np.ndarray) -> None:
        """Add `delta` to each group's count and to every ancestor's."""
        if not self.nested:
            np.add.at(counts, groups, delta)
            return
        for g in groups.tolist():
            for a in self._chain[g]:
                counts[a] += delta

    def prefix_levels(self, sid: int, ctx: int) -> list[tuple[int, int]]:
        """(group, tokens) of each prefix level the sequence can take, outermost first: each group's whole pages on
        its chain that leave its last context token to compute; a level that adds no whole page is left out."""
        g = int(self.prefix_group[sid])
        if g < 0:
            return []
        P, cap, out, last = self.page_tokens, ctx - 1, [], 0
        for a in self._chain[g]:
            tokens = min(int(self.group_len[a]), cap) // P * P
            if tokens > last:
                out.append((a, tokens))
                last = tokens
        return out

    def _deepest(self, gpu: int, levels: list[tuple[int, int]],
                 made: dict | None = None) -> tuple[int, int, int]:
        """(index in `levels`, group, tokens) of the deepest level on `gpu` (or in `made`: (GPU, group) -> (tokens,
        tail)) that the sequence shares whole; (-1, -1, 0): none."""
        for k in range(len(levels) - 1, -1, -1):
            a, tokens = levels[k]
            entry = self.prefixes.get((gpu, a))
            there = entry.tokens if entry is not None else made[(gpu, a)][0] if made and (gpu, a) in made else None
            if there is not None and tokens >= there:
                return k, a, there
        return -1, -1, 0

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
        """The prefix each sequence would take restored onto its GPU: the deepest level of its chain there that it
        shares whole (`_deepest`)."""
        out: list[GroupPrefix | None] = []
        for sid, g, c in zip(ids.tolist(), gpus.tolist(), self.table.context(ids).tolist()):
            _, group, _ = self._deepest(g, self.prefix_levels(sid, c))
            out.append(self.prefixes[(g, group)] if group >= 0 else None)
        return out

    def pin_prefixes(self, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray) -> list[GroupPrefix]:
        """Keep the prefixes there that these prefills take (those with a start) from being dropped to make room
        while they are being taken; returns them, for `unpin`."""
        pinned = []
        take = starts > 0
        for sid, g, c in zip(ids[take].tolist(), gpus[take].tolist(), self.table.context(ids[take]).tolist()):
            _, group, _ = self._deepest(g, self.prefix_levels(sid, c))
            if group >= 0:  # (one this forward creates has its creator as a holder)
                entry = self.prefixes[(g, group)]
                entry.pins += 1
                pinned.append(entry)
        return pinned

    @staticmethod
    def unpin(pinned: list[GroupPrefix]) -> None:
        for entry in pinned:
            entry.pins -= 1

    def prefills_started(self, ids: np.ndarray) -> None:
        """Pending sequences started their prefill (after the boundary's shares): their groups, and the groups above
        them, have fewer left."""
        grouped = self.prefix_group[ids]
        for leaf in grouped[grouped >= 0].tolist():
            for group in self._chain[leaf]:
                self.group_left[group] -= 1
                if not self.group_left[group] and group in self._gpus_of_group:
                    self._exhausted.add(group)

    def back_to_pending(self, ids: np.ndarray) -> None:
        """Evicted sequences will start their prefill again."""
        grouped = self.prefix_group[ids]
        grouped = grouped[grouped >= 0]
        self._count_up(grouped, 1, self.group_left)
        self._exhausted.difference_update(a for g in grouped.tolist() for a in self._chain[g])

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
            self._count_up(grouped, delta, self.group_parked)

    def attach_restored(self, instance: int, ids: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """Suspended sequences about to be restored onto `gpus` (the GPU whose cache holds their host copy, or with
        `resume_anywhere` another of its node): each whose group's prefix is there takes it by reference, so its
        restore copies only the rest of its KV and its own pages are those past the prefix. Returns the tokens each
        takes (0: none). A GPU without the prefix may have it copied from another first (`fetch_prefixes`)."""
        at = np.zeros(ids.size, np.int64)
        if not self.prefixes:
            return at
        self.fetch_prefixes(instance, ids, gpus, resuming=True)
        groups = np.full(ids.size, -1, np.int64)
        for i, (sid, g, c) in enumerate(zip(ids.tolist(), gpus.tolist(), self.table.context(ids).tolist())):
            _, groups[i], at[i] = self._deepest(g, self.prefix_levels(sid, c))
            if groups[i] >= 0:
                self._hold(g, int(groups[i]))
        take = np.flatnonzero(at)
        if take.size:
            self.prefix_held[ids[take]], self.prefix_holds[ids[take]] = at[take], groups[take]
            self.prefix_restored += int(at.sum())
            self.prefix_resumed += int(at[self.table.kv_gpu[ids] != gpus].sum())
            self._log_share(instance, ids[take], gpus[take], groups[take], at[take], np.zeros(take.size, bool),
                            np.zeros(take.size, np.int64))
        return at

    def _hold(self, gpu: int, group: int) -> GroupPrefix:
        """One more holder of the group's entry on the GPU (a kept entry no one held is held again)."""
        entry = self.prefixes[(gpu, group)]
        if not entry.holders:
            self.unheld_pages[gpu] -= entry.pages
        entry.holders += 1
        return entry

    def _log_share(self, instance: int, ids: np.ndarray, gpus: np.ndarray, groups: np.ndarray, tokens: np.ndarray,
                   creates: np.ndarray, tail: np.ndarray, src: int = -1, parents: np.ndarray | None = None) -> None:
        """The `share` ops of prefixes created or taken (the entry of `groups` on `gpus`): whole pages by reference,
        and `tail` tokens copied on the GPU (a taker's, into its first own page; a creator's, into its prefix's tail
        page); or (`src`, a created one) the prefix copied from that GPU's, past its parent's entry here (`parents`,
        whose tokens are not copied; -1: none)."""
        tail = np.asarray(tail, np.int64)
        parents = np.full(ids.size, -1, np.int64) if parents is None else np.asarray(parents, np.int64)
        below = np.array([self.prefixes[(int(g), int(p))].tokens if p >= 0 else 0
                          for g, p in zip(gpus.tolist(), parents.tolist())], np.int64) if src >= 0 else 0
        copied = tail if src < 0 else tail + tokens - below
        self.oplogs[instance].add("share", ids, gpus.astype(np.int64), np.asarray(groups, np.int64), tokens, creates,
                                  tail, copied * float(self.kv_bytes_per_token), np.full(ids.size, src, np.int64),
                                  parents)

    def _keep(self, gpu: int, group: int, entry: GroupPrefix) -> None:
        self.prefixes[(gpu, group)] = entry
        self.prefix_pages[gpu] += entry.pages
        self._gpus_of_group.setdefault(group, set()).add(gpu)

    def _keep_unheld(self, gpu: int, group: int, entry: GroupPrefix) -> None:
        """A level no one holds yet lands on the GPU (written there for later members, or copied in): it holds the
        level it extends, and its pages are counted there as a kept prefix's."""
        if entry.parent >= 0:
            self._hold(gpu, entry.parent)
        self._keep(gpu, group, entry)
        self._gpu_holds(gpu, int(self.pages_used[gpu]) + entry.pages)
        self.unheld_pages[gpu] += entry.pages

    def _drop(self, instance: int, gpu: int, group: int, unheld: bool = True) -> None:
        """A prefix no one holds leaves its GPU (its pages freed there by the `unshare` op); `unheld`: it was kept
        unheld (counted in `unheld_pages`), not let go just now. It lets go of the entry it extends."""
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
        if entry.parent >= 0:
            self._release(gpu, entry.parent)

    def _release(self, gpu: int, group: int) -> None:
        """One holder lets go of the group's entry on the GPU: the last one drops it unless a member of its group
        (or below) is still to start, or parked; else it is kept, the newest unheld (dropped last to make room)."""
        entry = self.prefixes[(gpu, group)]
        entry.holders -= 1
        if entry.holders:
            return
        if not self.group_left[group] and not entry.pins and not self._parked(group):
            self._drop(int(self.topo.gpu_instance[gpu]), gpu, group, unheld=False)
        else:
            self.prefixes[(gpu, group)] = self.prefixes.pop((gpu, group))
            self.unheld_pages[gpu] += entry.pages

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
        for group in sorted(self._exhausted, reverse=True):  # deepest first: a child's going frees its parent
            for gpu in sorted(self._gpus_of_group.get(group, set()) & mine):
                entry = self.prefixes.get((gpu, group))
                if entry is not None and not entry.holders and not entry.pins and not self._parked(group):
                    self._drop(instance, gpu, group)

    def _make_room(self, gpu: int) -> int:
        """GPU `gpu` holds more pages than it has: drop the prefixes there that no one holds, the longest unheld
        first, then the tails' pages of those held, until it fits (or none is left). Returns the pages it holds
        then."""
        for tails in (False, True):
            progress = True
            while progress:  # again while drops go on: a child's going leaves its parent unheld
                progress = False
                for (g, group), entry in list(self.prefixes.items()):  # in the order they were last let go
                    if self.pages_used[gpu] <= self.gpu_pages[gpu]:
                        return int(self.pages_used[gpu])
                    if g != gpu or entry.pins or self.prefixes.get((g, group)) is not entry:
                        continue
                    if not tails and not entry.holders:
                        self._drop(int(self.topo.gpu_instance[gpu]), gpu, group)
                        progress = True
                    elif tails and entry.tail:
                        self._drop_tail(int(self.topo.gpu_instance[gpu]), gpu, group)
        return int(self.pages_used[gpu])

    def drop_unheld(self, instance: int) -> bool:
        """An instance's policy runs nothing: the prefixes on its GPUs that no one holds (kept for members still to
        start, their pages taken from what the policy may admit) go, so that those members can start, and the
        tails' pages of those held (the holders may need them to grow). Returns whether any went."""
        went = False
        while True:  # again while drops go on: a child's going leaves its parent unheld
            mine = [(gpu, group, e) for (gpu, group), e in self.prefixes.items()
                    if not e.pins and self.topo.gpu_instance[gpu] == instance and (e.tail or not e.holders)]
            if not mine:
                return went
            for gpu, group, e in mine:
                if self.prefixes.get((gpu, group)) is not e:
                    continue
                if e.holders:
                    self._drop_tail(instance, gpu, group)
                else:
                    self._drop(instance, gpu, group)
            went = True

    def _let_go(self, ids: np.ndarray) -> None:
        """The sequences' device pages go: each lets go of the prefix it holds; the last holder drops it unless a
        member of its group is still to start."""
        held = ids[self.prefix_held[ids] > 0]
        for sid in held.tolist():
            self._release(int(self.table.where[sid]), int(self.prefix_holds[sid]))
        self.prefix_held[held] = 0
        self.prefix_holds[held] = -1

    def prefix_pages_needed(self, ids: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """A holder's own pages: those of its tokens less the prefix's."""
        return np.maximum(pages - self.prefix_held[ids] // self.page_tokens, 0)

    def forget_prefixes(self) -> None:
        """No prefix on any GPU and no holder: a recovery's output state, once every sequence has finished (its
        counters stay)."""
        if not self.sharing:
            return
        self.prefix_held[:] = 0
        self.prefix_holds[:] = -1
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
            key = (int(t.where[sid]), int(self.prefix_holds[sid]))
            count[key] = count.get(key, 0) + 1
            entry = self.prefixes.get(key)
            if entry is None or entry.tokens != self.prefix_held[sid]:
                raise InvariantError(f"sequence {sid} holds a prefix GPU {key[0]} does not have for group {key[1]}")
            if key[1] not in self._chain[int(self.prefix_group[sid])]:
                raise InvariantError(f"sequence {sid} holds group {key[1]}'s prefix, not on its group's chain")
        for (g, group), entry in self.prefixes.items():  # an entry holds the one it extends
            if entry.parent >= 0:
                parent = self.prefixes.get((g, entry.parent))
                if parent is None or parent.tokens >= entry.tokens:
                    raise InvariantError(f"group {group}'s prefix on GPU {g} extends group {entry.parent}'s, which is "
                                         "not there or not shorter")
                count[(g, entry.parent)] = count.get((g, entry.parent), 0) + 1
        unheld = np.zeros(self.topo.num_gpus, np.int64)
        for (g, group), entry in self.prefixes.items():
            if count.get((g, group), 0) != entry.holders:
                raise InvariantError(f"group {group}'s prefix on GPU {g} counts {entry.holders} holders, "
                                     f"{count.get((g, group), 0)} hold it")
            pages[g] += entry.pages
            unheld[g] += 0 if entry.holders else entry.pages
        if not np.array_equal(unheld, self.unheld_pages) or not np.array_equal(pages, self.prefix_pages):
            raise InvariantError("the pages of prefixes (or of those no one holds) drifted from their count")
        parked = np.zeros(self.group_parked.size, np.int64)
        self._count_up(self.prefix_group[(t.where == SUSPENDED) & (self.prefix_group >= 0)], 1, parked)
        if not np.array_equal(parked, self.group_parked):
            raise InvariantError("the members of groups waiting in host pools drifted from their count")
        return pages
