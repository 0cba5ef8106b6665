"""Continuous batching as serving engines do it today (vLLM, SGLang with DP attention + EP).

Each sequence is pinned to one rank when the job starts (round-robin, like a data-parallel router at
arrival) and never leaves it. Its running batch is also the expert batch: one batch size for attention and
experts. When KV runs out, the newest sequences are preempted and later recomputed.

Chunked prefill (`chunked_prefill`, the default, as vLLM and SGLang run): every forward is built from a token
budget per rank (`token_budget`): one token for each running sequence first, then as much of the waiting prompts
as fits, FIFO; a prompt longer than what is left is split over several forwards (its KV written chunk by chunk,
its pages allocated as chunks land), so decode never stalls while prompts wait. A sequence part-way through its
prefill continues first in the next forward; preempted, it frees its pages and restarts. With prompts waiting
a decision is taken at every forward; with none, once per page of decode.

Admission (`admission`, chunked prefill only): `greedy` (vLLM V1's rule, the default) starts a waiting prompt
whenever its chunk's pages are free and preempts the newest sequences when running decodes run short. A chunk is
what is left of the prompt or of the budget; beside running decodes it goes whole or waits for finishes to free its
pages, as vLLM V1 allocates a chunk's slots (on a rank where nothing decodes, nothing would free them: it is cut to
the free pages). `conservative` is SGLang's rule: a rank starts a new prompt only if the whole prompt plus its own
clipped output reserve, min(max_tokens, clip_max_new_tokens), fits the free KV left after reserving, for every
sequence already running there, min(max_tokens - generated, clip_max_new_tokens) x new_token_ratio tokens. Each rank
(one SGLang scheduler per DP-attention rank) keeps its own new_token_ratio: it starts at `init_new_token_ratio`,
falls by `new_token_ratio_decay` per decode forward to `min_new_token_ratio`, returns to the start when the rank
runs empty, and after a preemption on the rank is set to (generated + 20 per sequence) / max_tokens summed over the
sequences kept (at most 1), as SGLang's retract does. A policy never sees true output lengths: max_tokens is
`reserve_max_tokens` per request, or (0) the model's context (`model_context`) minus the prompt; with neither known
only the clip bounds the reserve. A part-prefilled prompt continues without the check (as SGLang's chunked request
does) but is reserved for like a running sequence, with what is left of its prompt on top.

Attention parallelism (`attention_tp`): with t > 1 a rank of this policy is a group of t GPUs running attention
tensor-parallel (SGLang / vLLM without DP attention): the caps (max_running, token_budget) are per group, as
they are per scheduler there, and the group holds one KV pool (batchgen.latency.tp_attention). The decisions
are the same code; only what a rank is changes.

Without it (`chunked_prefill: false`, the older engines' rule): a rank with waiting prompts and free KV pages
prefills whole prompts first (up to `max_prefill_tokens` per forward) while decode waits; otherwise it decodes.
Decisions are taken at every sequence finish (iteration granularity) while prompts wait.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import numpy as np

from batchgen.core.cascade import cascade_mode
from batchgen.memory import BatchShape
from batchgen.policy.base import EMPTY, Decision, PolicyDefaults, Snapshot
from batchgen.policy.common import check_attention_tp, pages_for, shed_to_fit
from batchgen.policy.engine_defaults import vllm_offline_caps
from batchgen.policy.prefix_budget import ForwardPrefixes, computed_whole


@dataclass(frozen=True)
class ContinuousPolicy(PolicyDefaults):
    max_running: int | str = "auto"  # per rank (scheduler / CUDA-graph cap); auto: the engine's default for the
    #                                  GPU (`engine_defaults`; vLLM's offline caps here)
    max_prefill_tokens: int = 16384  # per rank per forward
    admit_watermark: float = 0.01    # keep this share of KV pages free when admitting
    page_lookahead: int = 64         # decode iterations between memory checks when nothing waits
    chunked_prefill: bool = True     # forwards from a token budget: decodes first, then prompt chunks
    token_budget: int | str = "auto" # chunked prefill: tokens per rank per forward (decodes + prompt chunks); auto:
    #                                  the engine's default for the GPU
    mixed_chunks: bool = True        # chunked prefill: chunks ride in a forward with every decode (vLLM; SGLang with
    #                                  --enable-mixed-chunk); false: a rank's chunks alone, its decodes waiting for
    #                                  them, the whole budget theirs (SGLang's default); other ranks decode meanwhile
    admission: str = "greedy"        # chunked prefill: greedy (vLLM V1) | conservative (SGLang's reserve)
    prefix_cache: bool = True        # chunked prefill: a prompt whose group's prefix is on its rank takes its pages
    #                                  and prefills the rest (vLLM's automatic prefix caching, SGLang's radix cache:
    #                                  both on by default; batchgen.core.prefix_pages)
    prefix_tail: bool = False        # the shared tokens of the page where members diverge copied, not recomputed
    #                                  (off: vLLM's prefix cache hashes whole blocks only)
    cascade_attention: str = "batch"  # decodes that hold one prefix read it once per call (batchgen.core.cascade):
    #                                   batch (vLLM's rule, on by default), groups, off
    init_new_token_ratio: float = 0.7     # conservative: SGLang's defaults (SGLANG_INIT_NEW_TOKEN_RATIO) ...
    min_new_token_ratio: float = 0.1      # ... floor (SGLang: 0.7 x SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14 = 0.098) ...
    new_token_ratio_decay: float = 0.001  # ... per decode forward: (0.7 - 0.1) over SGLang's 600 decay steps
    clip_max_new_tokens: int = 4096       # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: reserve at most this per request
    reserve_max_tokens: int = 0           # max_tokens of every request; 0: model_context minus the prompt
    model_context: int = 0                # the model's context (conf: model.max_context); 0: unknown
    attention_tp: int | str = 1           # GPUs per attention group: 1 = data-parallel attention (replicated
    #                                       attention weights), t > 1 = tensor-parallel attention (heads and
    #                                       weights sharded over t GPUs, one rank here = one group), "auto":
    #                                       1 if it fits, else the smallest t that does (batchgen.job)
    name: str = "continuous"
    can_stream_weights: bool = False
    uses_host_kv: bool = False

    engine_knobs = ("max_running", "token_budget")  # knobs that take "auto": the engine's own default (for_gpu)

    def __post_init__(self):
        for key in self.engine_knobs:
            value = getattr(self, key)
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"policy.{key} must be a whole number or auto, got {value!r}")
        for key in ("max_running", "max_prefill_tokens", "page_lookahead", "token_budget", "clip_max_new_tokens"):
            if key in self.engine_knobs and getattr(self, key) == "auto":
                continue
            if getattr(self, key) < 1:
                raise ValueError(f"policy.{key} must be >= 1, got {getattr(self, key)}")
        if not isinstance(self.prefix_tail, bool):
            raise ValueError(f"policy.prefix_tail must be true or false, got {self.prefix_tail!r}")
        if self.admission not in ("greedy", "conservative"):
            raise ValueError(f"policy.admission must be greedy or conservative, got {self.admission!r}")
        if self.admission == "conservative" and not self.chunked_prefill:
            raise ValueError("policy.admission=conservative needs policy.chunked_prefill=true")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("policy: need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                             f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")
        if not 0 <= self.admit_watermark < 1:  # at 1 no prompt is ever admitted: the run could not progress
            raise ValueError(f"policy.admit_watermark must be a share of the KV pages in [0, 1), got "
                             f"{self.admit_watermark}")
        check_attention_tp(self.attention_tp)
        object.__setattr__(self, "cascade_attention", cascade_mode(self.cascade_attention))
        for key in ("new_token_ratio_decay", "reserve_max_tokens", "model_context"):
            if getattr(self, key) < 0:
                raise ValueError(f"policy.{key} must be >= 0, got {getattr(self, key)}")

    def engine_defaults(self, gpu) -> dict:
        """What the engine this policy stands for picks on `gpu` for each of `engine_knobs`: vLLM's offline caps."""
        seqs, tokens = vllm_offline_caps(gpu)
        return {"max_running": seqs, "token_budget": tokens}

    def for_gpu(self, gpu) -> "ContinuousPolicy":
        """This policy with its "auto" knobs set to the engine's defaults on `gpu` (batchgen.job.Job does it)."""
        auto = {k: v for k, v in self.engine_defaults(gpu).items() if getattr(self, k) == "auto"}
        return dataclasses.replace(self, **auto) if auto else self

    def batch_shape(self, max_context: int) -> BatchShape:
        """One batch for attention and experts: max_running sequences, or a prefill forward's token budget."""
        unresolved = [k for k in self.engine_knobs if getattr(self, k) == "auto"]
        if unresolved:
            raise ValueError(f"policy.{unresolved[0]}=auto is the engine's default for the cluster's GPU: build a "
                             "batchgen.job.Job (it resolves it) or call policy.for_gpu(gpu)")
        prefill = self.token_budget if self.chunked_prefill else self.max_prefill_tokens
        return BatchShape(gate_tokens=max(self.max_running, prefill), attn_seqs=self.max_running,
                          prefill_tokens=prefill)

    def decide(self, snap: Snapshot) -> Decision:
        if self.chunked_prefill:
            return self._decide_chunked(snap)
        P = snap.page_tokens
        d, waiting = self._pin(snap)
        drop, count, free = self._preempt(snap, d, snap.active_prefilled.nonzero()[0])
        prefill_ids, prefill_ranks = [], []
        for r in range(snap.num_ranks):
            if not waiting[r] or count[r] >= self.max_running:
                continue
            queue = snap.pinned[r]
            fresh = d.pin_ids[d.pin_ranks == r] if d.pin_ids.size else np.empty(0, np.int64)
            evicted_here = d.evict_ids[snap.active_rank[drop] == r]
            cand = np.concatenate([evicted_here, queue.peek(self.max_running), fresh])[: self.max_running - count[r]]
            if evicted_here.size:
                continue  # memory is short on this rank: decode to make room before admitting again
            ctx = snap.lengths.context(cand)
            fit_mem = np.cumsum(pages_for(ctx + 1, P)) <= free[r]
            fit_tok = np.cumsum(ctx) <= self.max_prefill_tokens
            fit_tok[0] = True  # a long prompt still goes through alone
            n = int(np.argmin(fit_mem & fit_tok)) if not (fit_mem & fit_tok).all() else cand.size
            if n:
                prefill_ids.append(cand[:n])
                prefill_ranks.append(np.full(n, r))
        if prefill_ids:
            d.prefill_ids, d.prefill_ranks = np.concatenate(prefill_ids), np.concatenate(prefill_ranks)
            d.prefill_pinned = True
        if not (sum(waiting) - d.prefill_ids.size) and not drop.size:
            d.stop = "none"  # nothing to admit at a finish: run a whole page
        return d

    def _pin(self, snap: Snapshot) -> tuple[Decision, list[int]]:
        """A decision with every pending prompt pinned once, round-robin over ranks; prompts waiting per rank."""
        R = snap.num_ranks
        d = Decision(micro_batch=0, stop="first_finish", steps=self.page_lookahead)
        waiting = [len(q) for q in snap.pinned]
        if len(snap.pending):
            ids = snap.pending.peek(len(snap.pending))
            d.pin_ids, d.pin_ranks = ids, np.arange(ids.size) % R
            waiting = [w + n for w, n in zip(waiting, np.bincount(d.pin_ranks, minlength=R).tolist())]
        return d, waiting

    def _preempt(self, snap: Snapshot, d: Decision, going_at: np.ndarray) -> tuple[np.ndarray, list[int], list[float]]:
        """Preempt (recompute) the newest sequences when the running ones' next page of tokens would not fit (a
        part-prefilled prompt, `going_at`, needs the pages of what it has written). Returns the dropped indices,
        sequences kept per rank and the pages left per rank for admissions (per-rank numbers are Python lists
        here: a rank's few numbers cost less as floats than as arrays of one element)."""
        R, P = snap.num_ranks, snap.page_tokens
        rank, capacity = snap.active_rank, snap.pages_capacity
        need = (snap.active_context + (self.page_lookahead + P - 1)) // P  # pages_for(context + lookahead, P)
        if going_at.size:
            need[going_at] = pages_for(snap.active_prefilled[going_at], P)
        if snap.prefixes is not None:  # a shared prefix's pages are not the holder's own
            need -= snap.active_shared // P
        used = np.bincount(rank, weights=need, minlength=R).tolist()  # whole numbers, exact as floats
        capacity = capacity.tolist()
        if any(u > c for u, c in zip(used, capacity)):
            drop = shed_to_fit(rank, need, -snap.active_decoded.astype(float), snap.pages_capacity)
            keep = np.ones(rank.size, bool)
            keep[drop] = False
            d.evict_ids = snap.active_ids[drop]
            rank, used = rank[keep], np.bincount(rank[keep], weights=need[keep], minlength=R).tolist()
        else:
            drop = EMPTY
        share = 1 - self.admit_watermark
        return drop, np.bincount(rank, minlength=R).tolist(), [c * share - u for c, u in zip(capacity, used)]

    def _decide_chunked(self, snap: Snapshot) -> Decision:
        R = snap.num_ranks
        d, waiting = self._pin(snap)
        going_at = snap.active_prefilled.nonzero()[0]  # part-way through a chunked prefill: they continue first
        any_partial = going_at.size > 0
        drop, count, free = self._preempt(snap, d, going_at)
        if drop.size:
            going_at = np.setdiff1d(going_at, drop, assume_unique=True)
        going: list[list[int]] = [[] for _ in range(R)]  # per rank, the rows part-way through
        for i, r in zip(going_at.tolist(), snap.active_rank[going_at].tolist()):
            going[r].append(i)
        room = None
        if self.admission == "conservative":
            room, d.carry = self._admit_room(snap, waiting, drop, going_at, free, count)
        ids_out, ranks_out, lens_out = [], [], []
        evicted = set(snap.active_rank[drop].tolist()) if drop.size else ()
        prefixes = None if snap.prefixes is None else snap.prefixes.on_ranks()  # chunks budget what they compute
        for r in range(R):
            decoding = count[r] - len(going[r])
            budget = self.token_budget - decoding if self.mixed_chunks else self.token_budget
            if budget <= 0 or not (waiting[r] or going[r]) or r in evicted:
                continue  # (evicted: memory is short on this rank: decode to make room before prefilling again)
            fresh = d.pin_ids[d.pin_ranks == r] if d.pin_ids.size else EMPTY
            ids, lens = self._rank_chunks(
                snap, snap.pinned[r], fresh, going[r], max(self.max_running - count[r], 0),
                None if room is None else room[r], not count[r], budget, free[r],
                self.admission == "greedy" and decoding > 0, r, prefixes)
            if ids:
                ids_out += ids
                ranks_out += [r] * len(ids)
                lens_out += lens
        if ids_out:
            d.chunk_ids, d.chunk_lens = np.array(ids_out, np.int64), np.array(lens_out, np.int64)
            d.chunk_ranks = np.array(ranks_out, np.int64)
            d.prefill_pinned, d.chunks_only = True, not self.mixed_chunks
        if not any(waiting) and not any_partial and not drop.size:
            d.stop = "none"  # nothing to admit at a finish: run a whole page
        return d

    def _rank_chunks(self, snap: Snapshot, queue, fresh: np.ndarray, going_at: list[int], slots: int,
                     room: float | None, first_always: bool, budget: int, free: float, whole: bool, rank: int = 0,
                     prefixes: dict | None = None) -> tuple[list[int], list[int]]:
        """One rank's chunks: the sequences part-way through (`going_at`, indices into the snapshot's running
        ones) continue first, then up to `slots` prompts of its queue and then of the prompts pinned to it now
        (`fresh`), FIFO; SGLang's check keeps a prompt out unless it and its clipped output fit the `room`.
        Only the head of the queue that can move is looked at: a FIFO cut never depends on what follows it, so
        the rest is read only where the whole head moves. With `prefixes` (the instance's, `PrefixView.on_ranks`)
        a prompt starts past the prefix it takes on this `rank` (batchgen.policy.prefix_budget)."""
        going, going_start, going_context = [], [], []
        if going_at:
            going = snap.active_ids[going_at].tolist()
            going_start = snap.active_prefilled[going_at].tolist()
            going_context = snap.active_context[going_at].tolist()
        look = min(slots, len(queue) + fresh.size)
        head = min(look, _HEAD)
        while True:
            queued = queue.peek(head)
            if queued.size < head:  # the queue ends inside the head: prompts pinned now follow it
                queued = np.concatenate([queued, fresh[: head - queued.size]])
            final = head == look  # every candidate is looked at (else a head of them)
            queued_context = snap.lengths.context(queued).tolist()
            if room is not None and queued.size:
                fit = queued_context if prefixes is None else computed_whole(
                    snap.prefixes, queued, queued_context, rank, dict(prefixes))
                n = _fitting(fit, self._max_tokens(snap, queued).tolist(), self.clip_max_new_tokens,
                             room, first_always)
                if n < queued.size:  # a cut inside the head: the whole queue is cut at the same place
                    queued, queued_context, final = queued[:n], queued_context[:n], True
            cand = going + queued.tolist()
            seen = None
            if prefixes is not None:
                seen = ForwardPrefixes(snap.prefixes, np.array(cand, np.int64), dict(prefixes))
            ids, lens = _fill(cand, going_start + [0] * queued.size, going_context + queued_context, budget, free,
                              snap.page_tokens, whole, seen, rank)
            if len(ids) < len(cand) or final:
                return ids, lens
            head = look  # every candidate looked at moved: the rest of the queue may too

    def _max_tokens(self, snap: Snapshot, ids: np.ndarray) -> np.ndarray:
        """max_tokens of each request as the engine knows it (never the true output length): the configured
        cap, else the model's context minus the prompt; unknown (a huge number) when neither is set."""
        if self.reserve_max_tokens:
            return np.full(ids.size, self.reserve_max_tokens, np.int64)
        if self.model_context:  # read from a column computed once
            return self._context_caps(snap.lengths.input_len)[ids]
        return np.full(ids.size, _UNKNOWN, np.int64)

    def _context_caps(self, input_len: np.ndarray) -> np.ndarray:
        """The model's context minus the prompt, at least 1, for every sequence of the job: computed once per
        prompt-length column (the snapshots of a run share one read-only view of it), not at every decision."""
        cached = _CONTEXT_CAPS.get(id(input_len))
        if cached is None or cached[0]() is not input_len or cached[1] != self.model_context:
            if len(_CONTEXT_CAPS) >= 8:
                _CONTEXT_CAPS.clear()
            cached = _CONTEXT_CAPS[id(input_len)] = (weakref.ref(input_len), self.model_context, np.maximum(
                self.model_context - input_len, 1).astype(np.int64))
        return cached[2]

    def _ratios(self, snap: Snapshot, waiting: list[int], drop: np.ndarray, count: list[int]
                ) -> tuple[list[float], dict]:
        """new_token_ratio of each rank at this decision (SGLang keeps one per scheduler, i.e. per DP-attention
        rank): decayed per decode forward run since the last decision, back to its start on a rank that ran
        empty, re-estimated on a rank that preempts now. The ratios and where decoding stood come back as the
        decision's `carry`, which the engine hands to the next snapshot of this instance."""
        R = snap.num_ranks
        st = snap.carry
        init = self.init_new_token_ratio
        if st is None or st["ratio"].size != R or not snap.active_ids.size:
            # the job's first decision (or an idle instance, where SGLang resets too) starts at the top
            ratio = [init] * R
        elif st["ids"].size:  # forwards run since: the most tokens any sequence of the rank decoded since
            since = snap.lengths.decoded[st["ids"]] - st["dec"]
            if R == 1:  # the scatter's maximum over one rank (from 0)
                ran = [max(int(since.max()), 0)]
            else:
                ran = np.zeros(R, np.int64)
                np.maximum.at(ran, st["rank"], since)
                ran = ran.tolist()
            ratio = [max(x - self.new_token_ratio_decay * n, self.min_new_token_ratio)
                     for x, n in zip(st["ratio"].tolist(), ran)]
        else:
            ratio = st["ratio"].tolist()
        busy = np.bincount(snap.active_rank, minlength=R).tolist() if drop.size else count
        ratio = [init if b + w == 0 else x for x, b, w in zip(ratio, busy, waiting)]
        if drop.size:
            self._retract(snap, drop, ratio)
        return ratio, {"ratio": np.array(ratio), "ids": snap.active_ids.copy(), "rank": snap.active_rank,
                       "dec": snap.active_decoded}

    def _retract(self, snap: Snapshot, drop: np.ndarray, ratio: list[float]) -> None:
        """SGLang's retract on each rank that preempts: its ratio becomes (generated + 20 each) / max_tokens over
        the decoding sequences it keeps."""
        decoding = snap.active_prefilled == 0
        decoding[drop] = False
        for r in np.unique(snap.active_rank[drop]).tolist():
            mine = decoding & (snap.active_rank == r)
            cap = self._max_tokens(snap, snap.active_ids[mine])
            if not mine.any() or (cap >= _UNKNOWN).any():
                ratio[r] = self.init_new_token_ratio
            else:
                done = snap.active_decoded[mine].sum() + _RETRACT_DECODE_STEPS * int(mine.sum())
                ratio[r] = min(1.0, float(done / (cap.sum() + 1)))

    def _admit_room(self, snap: Snapshot, waiting: list[int], drop: np.ndarray, going_at: np.ndarray,
                    free: list[float], count: list[int]) -> tuple[list[float], dict]:
        """Tokens per rank a new prompt and its output reserve may take (SGLang's rem_total_tokens): the free
        pages (already net of the running sequences' next page) less, for each running sequence, its estimated
        remaining decode beyond that page, min(max_tokens - generated, clip) x new_token_ratio; a part-prefilled
        prompt (`going_at`) also reserves what is left of its prompt and its clipped max_tokens x the ratio.
        Preempted sequences (`drop`) reserve nothing."""
        R, P = snap.num_ranks, snap.page_tokens
        ratio, carry = self._ratios(snap, waiting, drop, count)
        ids, rank = snap.active_ids, snap.active_rank
        left = np.minimum(np.maximum(self._max_tokens(snap, ids) - snap.active_decoded, 0), self.clip_max_new_tokens)
        est = left * (ratio[0] if R == 1 else np.array(ratio)[rank])  # each row times its rank's ratio
        reserve = np.maximum(est - self.page_lookahead, 0)
        if going_at.size:
            reserve[going_at] = (snap.active_context[going_at] - snap.active_prefilled[going_at]) + est[going_at]
        if drop.size:
            reserve[drop] = 0.0
        taken = np.bincount(rank, weights=reserve, minlength=R).tolist()
        return [f * P - t for f, t in zip(free, taken)], carry


# id of a prompt-length column -> (a weak reference to it, model_context, the caps): outside the policy, which
# stays a plain picklable value
_CONTEXT_CAPS: dict[int, tuple] = {}
_HEAD = 16                     # queue entries a rank's chunks look at first
_UNKNOWN = 2**62               # max_tokens when neither a cap nor the model's context is known
_RETRACT_DECODE_STEPS = 20     # SGLang's SGLANG_RETRACT_DECODE_STEPS


def _fitting(context: list[int], max_tokens: list[int], clip: int, room: float, first_always: bool) -> int:
    """How many FIFO candidates SGLang's conservative check admits: the running sum of each prompt plus its
    clipped max_tokens stays below the room (the first always fits on an empty rank). Python integers compared
    with a float exactly, as numpy's cumsum of int64 is below 2^53 here."""
    total = n = 0
    for c, m in zip(context, max_tokens):
        total += c + min(m, clip)
        if not (total < room or (n == 0 and first_always)):
            break
        n += 1
    return n


def _fill(cand: list[int], start: list[int], context: list[int], budget: int, free_pages: float, page_tokens: int,
          whole: bool, seen: ForwardPrefixes | None = None, rank: int = 0) -> tuple[list[int], list[int]]:
    """Chunks for FIFO candidates (those part-way through first) within a rank's token budget and free pages:
    each takes what is left of its context or of the budget (a chunk that completes its context also needs room
    for the first token). With `whole` (vLLM V1: a chunk's slots are allocated whole or not at all) a chunk whose
    pages are not all free waits; otherwise it is cut to the pages it can still get (SGLang's chunked request,
    and a rank where nothing decodes, so that nothing would free pages). Stops at the first candidate that cannot
    move, so FIFO order holds. With `seen` a prompt that takes a prefix on `rank` starts past it, holding its pages
    by reference, and a chunk that passes its prefix writes it for the ones after it. Returns (ids, chunk
    lengths)."""
    ids, lens = [], []
    for i, (sid, s, c) in enumerate(zip(cand, start, context)):
        if budget <= 0:
            break
        taken = s if seen is None else seen.start(rank, i, s)
        # a prefix taken: its whole pages held (a tail is copied into a page of its own); else the pages written
        held = taken // page_tokens if taken != s else -(-s // page_tokens)
        s = taken
        end = min(c, s + budget)
        if whole and -(-(end + (end == c)) // page_tokens) - held > free_pages:
            break  # its pages are not free: it waits for finishes to free them
        if end == c and -(-(c + 1) // page_tokens) - held > free_pages:
            end = c - 1  # the whole rest does not fit with its first token: write what fits, finish later
        end = min(end, int((held + max(free_pages, 0)) // 1) * page_tokens)
        if end <= s:
            break
        if seen is not None:
            seen.wrote(rank, i, s, end)
        ids.append(sid)
        lens.append(end - s)
        budget -= end - s
        free_pages -= -(-(end + (end == c)) // page_tokens) - held
    return ids, lens
