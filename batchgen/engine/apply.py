"""A policy's decision carried out through the coroutine primitives (`apply_decision`), and a run's outcome
folded back into the state (`record_outcome`)."""

from __future__ import annotations

import math

import numpy as np

from batchgen.core.accounts import Moves
from batchgen.core.cascade import decode_reads
from batchgen.core.ops import KVLedger, KVOps
from batchgen.core.sequences import PENDING, InvariantError
from batchgen.core.state import ClusterState
from batchgen.engine.plan import _EMPTY, FFN_SCHEDULES, StepPlan, StepResult, filled
from batchgen.engine.snapshot import InstanceProgress, tp_and_hosted
from batchgen.policy.base import Decision

_FEW_CHUNKS = 8  # chunks up to which a forward's are taken and recorded on Python scalars


def apply_decision(state: ClusterState, instance: int, d: Decision, progress: InstanceProgress,
                   now: float = 0.0, ledger: KVLedger | None = None) -> StepPlan:
    """Carry out a decision through the coroutine primitives and describe the run that follows: the KV ops they
    emitted (with the instance's finishes since its last boundary), and the bytes those ops copy, which the
    simulator prices. With a `ledger` (a backend that moves real KV, or invariant checks) the plan carries the
    ops themselves, checked against the ledger and recorded there."""
    t = state.table
    gpus = state.instance_gpus(instance)
    if d.pin_ids.size:
        state.pin(instance, d.pin_ids, gpus[d.pin_ranks])
    if d.evict_ids.size:
        state.evict(instance, d.evict_ids)
    if d.yield_ids.size:
        state.yield_(instance, d.yield_ids)
    if d.offload_ids.size:
        state.offload(instance, d.offload_ids)
    if d.move_ids.size:
        state.move_running(instance, d.move_ids, gpus[d.move_ranks])
    if d.ffn_schedule not in FFN_SCHEDULES:
        raise InvariantError(f"Decision.ffn_schedule must be one of {', '.join(FFN_SCHEDULES)}, got {d.ffn_schedule!r}")
    prefill = d.prefill_ids.size > 0
    chunked = d.chunk_ids.size > 0
    if prefill and chunked:
        raise InvariantError("a decision prefills whole prompts or chunks of them, not both")
    steps = 1 if prefill or chunked else max(int(d.steps), 1)
    for admit in d.admits:
        state.combine(instance, admit.node, admit.ids, gpus[admit.ranks], lookahead_tokens=steps,
                      host_resident=admit.host_resident, keep_host_copy=admit.keep_host_copy)
    if d.partition_ids.size:
        state.partition(instance, d.partition_ids, d.partition_degree)
    prefill_start = _EMPTY
    if prefill:
        prefill_start = _take_prefill(state, instance, d, gpus)
    decode_ids = state.active[instance]
    if prefill and not d.prefill_to_host:
        decode_ids = np.setdiff1d(decode_ids, d.prefill_ids, assume_unique=True)
    if state.num_part_prefilled:
        partial = t.prefilled[decode_ids] > 0
        if partial.any():  # part-way through a chunked prefill: no token to decode yet
            decode_ids = decode_ids[~partial]
    waiting = 0
    if chunked and d.chunks_only:
        # each rank that prefills runs its chunks alone and its running sequences wait; the other ranks decode in
        # the same forward (one scheduler per rank, as SGLang's data-parallel attention ranks)
        chunking = np.zeros(gpus.size, bool)
        chunking[np.asarray(d.chunk_ranks, np.int64)] = True
        held = chunking[state.gpu_rank[t.where[decode_ids]]]
        waiting, decode_ids = int(held.sum()), decode_ids[~held]
    chunk = {}
    if chunked:
        chunk = _take_chunks(state, instance, d, gpus)
    state.reserve(decode_ids, steps)
    _reserve_host(state, instance, d, decode_ids, steps)
    if not d.padded and progress.padding:
        progress.pad_rows[:] = 0
        progress.pad_context[:] = 0
        progress.padding = False
    pad_rows, pad_context = progress.pads()
    decode_tp, decode_hosted = tp_and_hosted(state, decode_ids)
    one_gpu = gpus.size == 1  # every running sequence of the instance is on rank 0
    ops, moves = _kv_ops(state, ledger, instance, d, gpus, chunk, decode_ids, prefill_start)
    decode_rank = filled(decode_ids.size, 0, np.int64) if one_gpu else state.gpu_rank[t.where[decode_ids]]
    cascade = _cascades(state, d, decode_ids, decode_rank, decode_tp, decode_hosted, chunk) if state.sharing else {}
    return StepPlan(
        instance=instance, gpus=gpus, decode_ids=decode_ids,
        decode_rank=decode_rank,
        decode_tp=decode_tp, prefill_ids=d.prefill_ids, prefill_rank=d.prefill_ranks,
        steps=steps, stop=d.stop, micro_batch=d.micro_batch, decode_host_resident=decode_hosted,
        cpu_attention=d.cpu_attention, pad_rows=pad_rows, pad_context=pad_context, moves=moves, host_sync=d.host_sync,
        prefill_to_host=d.prefill_to_host, padded=d.padded, start=now, ffn_schedule=d.ffn_schedule, ops=ops,
        waiting=waiting, prefill_start=prefill_start, **chunk, **cascade,
    )


def _cascades(state: ClusterState, d: Decision, ids: np.ndarray, rank: np.ndarray, tp: np.ndarray,
              hosted: np.ndarray, chunk: dict) -> dict[str, np.ndarray]:
    """The plan's cascade fields: which decodes read their group's prefix once per call (the state's rule)."""
    if state.cascade.mode == "off" or not ids.size:
        return {}
    held = state.prefix_held[ids]
    group = np.full(ids.size, -1, np.int64)
    if held.any():
        other_ids = np.concatenate([d.prefill_ids, chunk.get("chunk_ids", _EMPTY)]).astype(np.int64)
        other_rank = np.concatenate([d.prefill_ranks, chunk.get("chunk_rank", _EMPTY)]).astype(np.int64)
        other_group = np.where(state.prefix_held[other_ids] > 0, state.prefix_holds[other_ids], -1)
        group = state.cascade.groups(rank, state.prefix_holds[ids], held, state.table.context(ids),
                                     ~hosted & (tp <= 1), d.micro_batch, other_rank, other_group)
    if hosted.any() and not d.cpu_attention:  # host copies restored into staging: each begins with its prefix
        tokens = np.where(hosted, state.share_tokens(ids), 0)
        staged = state.cascade.staged_groups(rank, state.prefix_group[ids], tokens, hosted)
        group, held = np.where(staged >= 0, staged, group), np.where(staged >= 0, tokens, held)
    if not (group >= 0).any():
        return {}
    return dict(decode_cascade=group, decode_shared=np.where(group >= 0, held, 0))


def _kv_ops(state: ClusterState, ledger: KVLedger | None, instance: int, d: Decision, gpus: np.ndarray,
            chunk: dict, decode_ids: np.ndarray, prefill_start: np.ndarray) -> tuple[KVOps | None, Moves]:
    """The boundary's KV ops, as the primitives emitted them, and the bytes they copy. With a ledger, every op is
    checked against where the ledger has the KV and recorded there (and the running sequences' KV against where
    the state runs them); without one, ops that move no byte (frees, evictions) are dropped unbuilt (None)."""
    log = state.oplogs[instance]
    num_gpus = state.topo.num_gpus
    if ledger is None:
        if not log.moves_anything():
            log.clear()
            return None, Moves.none(num_gpus)
        return None, state.take_ops(instance).moves(num_gpus)
    ops = state.take_ops(instance)
    fresh_ids, fresh_gpu = d.prefill_ids, gpus[d.prefill_ranks]
    if prefill_start.size and not d.prefill_to_host:  # a prefill that takes a shared prefix starts on it (its
        fresh_ids, fresh_gpu = fresh_ids[prefill_start == 0], fresh_gpu[prefill_start == 0]  # share op)
    to_host = np.full(fresh_ids.size, bool(d.prefill_to_host))
    if chunk:
        first = chunk["chunk_start"] == 0
        fresh_ids = np.concatenate([fresh_ids, chunk["chunk_ids"][first]])
        fresh_gpu = np.concatenate([fresh_gpu, gpus[chunk["chunk_rank"][first]]])
        to_host = np.concatenate([to_host, np.zeros(int(first.sum()), bool)])
    ledger.apply(ops, fresh_ids, fresh_gpu, to_host)
    t = state.table
    ledger.check_running(decode_ids, t.where[decode_ids], ~t.host_resident[decode_ids], t.tp[decode_ids])
    return ops, ops.moves(num_gpus)


def _reserve_host(state: ClusterState, instance: int, d: Decision, decode_ids: np.ndarray, steps: int) -> None:
    """What this run will add to host memory, so that instances sharing a node do not overfill it together."""
    t, node = state.table, state.topo.gpu_node
    if not (d.prefill_to_host and d.prefill_ids.size) and not state.has_host_copies():
        state.reserve_host(instance, _EMPTY, _EMPTY)  # no host copy to grow, no prefill to host
        return
    parts_nodes, parts_tokens = [], []
    if decode_ids.size:  # copies kept in sync grow: all of them with host_sync, host-resident ones always
        synced = decode_ids[(t.host_node[decode_ids] >= 0) & (d.host_sync | t.host_resident[decode_ids])]
        parts_nodes.append(t.host_node[synced])
        parts_tokens.append(np.full(synced.size, steps))
    if d.prefill_to_host and d.prefill_ids.size:
        gpus = state.instance_gpus(instance)
        parts_nodes.append(node[gpus[d.prefill_ranks]])
        parts_tokens.append(t.context(d.prefill_ids) + 1)
    empty = np.empty(0, np.int64)
    state.reserve_host(instance, np.concatenate(parts_nodes) if parts_nodes else empty,
                       np.concatenate(parts_tokens) if parts_tokens else empty)


def _take_prefill(state: ClusterState, instance: int, d: Decision, gpus: np.ndarray) -> np.ndarray:
    """Prompts leave their queue and start. Returns where each prefill starts (empty: every one at its first
    token): past its group's prefix where it takes one (batchgen.core.prefix_pages)."""
    ids, ranks = d.prefill_ids, d.prefill_ranks
    if d.prefill_pinned:
        for r in _distinct(ranks):
            state.take_pending(instance, ids[ranks == r], int(gpus[r]))
    else:
        state.take_pending(instance, ids)
    if d.prefill_to_host:
        state.start_prefill_to_host(instance, ids, gpus[ranks])
        if state.sharing:
            at = state.share_in_forward(instance, ids, gpus[ranks])
            state.prefills_started(ids)
            return at if at.any() else _EMPTY
        return _EMPTY
    # Running from the prefill on: pages for the prompt (and the first token) are allocated now.
    if not state.sharing:
        state.prefilled_to_gpu(instance, ids, gpus[ranks], lookahead_tokens=1)
        return _EMPTY
    at = state.sharing_starts(ids, gpus[ranks], np.zeros(ids.size, np.int64), state.table.context(ids))
    hit = at > 0
    pinned = state.pin_prefixes(ids[hit], gpus[ranks[hit]], at[hit])  # the others must not drop what is taken
    state.prefilled_to_gpu(instance, ids[~hit], gpus[ranks[~hit]], lookahead_tokens=1)  # creators among them
    for take in _rounds(state, ids, gpus[ranks], at, hit):
        state.attach(instance, ids[take], gpus[ranks[take]], at[take], whole_lookahead=1)
    state.unpin(pinned)
    state.prefills_started(ids)
    return at if hit.any() else _EMPTY


def _distinct(ranks: np.ndarray) -> list[int]:
    """np.unique of a boundary's few ranks (ascending), without its sort machinery."""
    return sorted(set(ranks.tolist()))


def _take_chunks(state: ClusterState, instance: int, d: Decision, gpus: np.ndarray) -> dict[str, np.ndarray]:
    """First chunks leave their queue (in order: each rank's are the head of its queue); every chunk's pages are
    allocated. Returns the plan's chunk fields."""
    t = state.table
    ids, ranks = np.asarray(d.chunk_ids, np.int64), np.asarray(d.chunk_ranks, np.int64)
    lens = np.asarray(d.chunk_lens, np.int64)
    distinct = len(set(ids.tolist()))
    if not (ids.size == ranks.size == lens.size) or distinct != ids.size:
        raise InvariantError("chunks need one rank and one length per sequence, each sequence once")
    starts = t.prefilled[ids]  # a copy: where each chunk starts (prefill_chunks moves it on)
    if ids.size <= _FEW_CHUNKS:  # the few chunks of a forward: their flags as Python lists
        start, first = starts.tolist(), [w == PENDING for w in t.where[ids].tolist()]
        if any(f and s0 != 0 for f, s0 in zip(first, start)):
            raise InvariantError("a pending sequence has no prefill under way")
        if any(first):
            new = [(i, r) for i, r, f in zip(ids.tolist(), ranks.tolist(), first) if f]
            if d.prefill_pinned:
                for r in sorted({r for _, r in new}):
                    state.take_pending(instance, np.array([i for i, q in new if q == r], np.int64), int(gpus[r]))
            else:
                state.take_pending(instance, np.array([i for i, _ in new], np.int64))
        completes = np.array([s0 + n == int(t.input_len[i]) + int(t.decoded[i])  # the chunk ends its context
                              for i, s0, n in zip(ids.tolist(), start, lens.tolist())], bool)
    else:
        first = t.where[ids] == PENDING
        if (first & (starts != 0)).any():
            raise InvariantError("a pending sequence has no prefill under way")
        if first.any():
            new, new_ranks = ids[first], ranks[first]
            if d.prefill_pinned:
                for r in _distinct(new_ranks):
                    state.take_pending(instance, new[new_ranks == r], int(gpus[r]))
            else:
                state.take_pending(instance, new)
        completes = starts + lens == t.context(ids)
    if state.sharing:
        starts, lens, completes = _take_prefixes(state, instance, ids, gpus[ranks], starts, lens)
    else:
        state.prefill_chunks(instance, ids, gpus[ranks], starts, lens)
    return dict(chunk_ids=ids, chunk_rank=ranks, chunk_start=starts, chunk_len=lens, chunk_completes=completes)


def _take_prefixes(state: ClusterState, instance: int, ids: np.ndarray, gpus: np.ndarray, starts: np.ndarray,
                   lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`prefill_chunks` with prefix caching (batchgen.core.prefix_pages): a first chunk whose group's prefix is on
    its GPU, or is created there by another chunk of this forward, takes it and starts past it, its length cut to
    what is left of its context; the creating chunks are taken first. Returns the chunks' starts, lengths and
    whether each completes its context."""
    first = state.table.where[ids] == PENDING
    at = state.sharing_starts(ids, gpus, starts, lens)
    hit = at != starts
    if not hit.any():
        state.prefill_chunks(instance, ids, gpus, starts, lens)
        state.prefills_started(ids[first])
        return starts, lens, starts + lens == state.table.context(ids)
    pinned = state.pin_prefixes(ids[hit], gpus[hit], at[hit])  # the creators' pages must not drop what is taken
    if not hit.all():
        state.prefill_chunks(instance, ids[~hit], gpus[~hit], starts[~hit], lens[~hit])
    ctx = state.table.context(ids)
    lens = np.where(hit, np.minimum(lens, ctx - at), lens)
    for take in _rounds(state, ids, gpus, at, hit):
        state.attach(instance, ids[take], gpus[take], at[take])
        state.prefill_chunks(instance, ids[take], gpus[take], at[take], lens[take])
    state.unpin(pinned)
    state.prefills_started(ids[first])
    return at, lens, at + lens == ctx


def _rounds(state: ClusterState, ids: np.ndarray, gpus: np.ndarray, at: np.ndarray, hit: np.ndarray):
    """The prompts that take a prefix, in rounds: each round those whose level is on its GPU now, taken (and
    prefilled, creating the deeper levels they pass) before the next; a nested level one of them creates is taken
    in a later round (one round without nested prefixes)."""
    left = hit.copy()
    while left.any():
        ready = left & state.ready_to_take(ids, gpus, at) if state.nested else left
        if not ready.any():
            raise InvariantError("prompts wait for a shared prefix that no prompt of the forward creates")
        yield ready
        left &= ~ready


def record_outcome(state: ClusterState, plan: StepPlan, res: StepResult, start: float,
                   progress: InstanceProgress, padded: bool) -> None:
    """Fold what the run produced back into the state: tokens, finishes, prefilled sequences."""
    t = state.table
    inst = plan.instance
    if plan.decode_ids.size:
        ids = plan.decode_ids
        read, prefix = decode_reads(t.input_len[ids] + t.decoded[ids], res.produced, plan.decode_rank,
                                    plan.decode_cascade, plan.decode_shared, plan.micro_batch)
        state.decode_kv_read += read
        state.cascade_prefix_read += prefix
        state.decode_forwards += int(res.produced.max(initial=0))
        state.advance(ids, res.produced, plan.host_sync)
        done = ids[res.finished]
        if done.size:
            if padded:
                ranks = plan.decode_rank[res.finished]
                np.add.at(progress.pad_rows, ranks, 1)
                np.add.at(progress.pad_context, ranks, t.context(done))
                progress.padding = True
            state.finish(inst, done, start + res.finish_offset[res.finished])
    if plan.prefill_ids.size:
        ids = plan.prefill_ids
        gpus = plan.gpus[plan.prefill_rank]
        state.advance(ids, np.ones(ids.size, np.int64), host_sync=False)  # prefill makes the first token
        # the first token's time, unless an earlier prefill made it (the clock never goes back: fmin keeps that)
        t.first_token_time[ids] = np.fmin(t.first_token_time[ids], start + res.duration)
        done = ids[res.prefill_finished]
        if plan.prefill_to_host:
            live = ~res.prefill_finished
            held = res.prefill_host_held[live] if res.prefill_host_held.size else None
            state.prefilled_to_host(inst, ids[live], gpus[live], held)
        if done.size:
            state.finish(inst, done, np.full(done.size, start + res.duration))
    if plan.chunk_ids.size:
        ids = plan.chunk_ids
        done_prompt = ids[plan.chunk_completes]
        if 0 < done_prompt.size <= _FEW_CHUNKS and not state.has_host_copies():
            at = start + res.duration  # `advance` of one token each and the first-token times, on scalars
            for sid in done_prompt.tolist():
                t.decoded[sid] += 1
                if math.isnan(t.first_token_time[sid]):
                    t.first_token_time[sid] = at
        elif done_prompt.size:
            state.advance(done_prompt, np.ones(done_prompt.size, np.int64), host_sync=False)  # the first token
            t.first_token_time[done_prompt] = np.fmin(t.first_token_time[done_prompt], start + res.duration)
        done = ids[res.chunk_finished]
        if done.size:
            state.finish(inst, done, np.full(done.size, start + res.duration))
    if state.sharing:  # prefixes no one can take any more (prompts prefilled to host parked by now), and those a
        state.sweep_prefixes(inst)  # forward wrote for itself, go
    state.reserve_host(inst, _EMPTY, _EMPTY)  # the run's additions are real now
    if padded:
        running = state.gpu_rank[t.where[state.active[inst]]]
        drained = np.bincount(running, minlength=plan.gpus.size) == 0
        progress.pad_rows[drained] = 0
        progress.pad_context[drained] = 0
