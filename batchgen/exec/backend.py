"""The exec backend: the engine's runs executed on real tensors, timed by the executor's clock (the wall clock, or
the working thread's CPU time: batchgen.exec.clock).

Placement decisions are already applied to the `ClusterState` when a run starts, and the plan carries them as
explicit KV ops per GPU (batchgen.core.ops): `move_kv` carries them out, cache by cache (YIELD to the host copy,
OFFLOAD to run host-resident, MIGRATE from the source's device pages (or its host copy) straight into the
destination's device pages (or host copy), COMBINE by restoring the host copy, evict and free, PARTITION by
resharding a sequence's KV device to device between the GPUs of its groups, as batchgen.core.reshard lists the
parts, a partitioned sequence's host copy kept up to date from its shards). It reads no global view of the state to
find what to do, so a backend with one process per rank can do the same from the ops alone. Every byte those
ops and the runs copy is counted per kind, GPU and tier (`account`, batchgen.exec.account), as the state prices
them (`StepPlan.moves`). Then the run itself: one forward with prefills, or up to `steps` decode iterations,
each a module-batched forward over every rank, in which host-resident sequences restore their KV layer by layer
into staging buffers (or attend on the host CPU with `plan.cpu_attention`); or, with chunked prefill, one
forward of prompt chunks (each written into the paged cache after the KV its earlier chunks wrote) beside every
decode, sampling only for the decodes and for the chunks that end their context.

Every forward runs whole (one process has no all-to-all for a second micro-batch to hide): the executor declares
no two-batch overlap (`exec_capabilities`), and the engine refuses a policy that asks for it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Generator

import numpy as np
import torch

from batchgen.core.ops import KVOps
from batchgen.core.reshard import Part
from batchgen.core.sequences import SUSPENDED, InvariantError
from batchgen.core.state import ClusterState
from batchgen.engine import StepPlan, StepResult
from batchgen.policy.base import Capabilities
from batchgen.exec import clock
from batchgen.exec.account import KVAccount
from batchgen.exec.kv_cache import Migrated, PagedKVCache, migrate
from batchgen.exec.kv_prefixes import share_host_prefixes
from batchgen.exec.runner import InstanceRunner, RankBatch
from batchgen.exec.sampling import sample
from batchgen.exec.share_ops import ShareOps
from batchgen.exec.sequences import SequenceTokens
from batchgen.exec.shards import drop, gather_to_host, reshard, shards_of


def _by_gpu(ids: np.ndarray, gpus: np.ndarray) -> list[tuple[int, list[int]]]:
    """(GPU, its ids) for each GPU that has any, in GPU order."""
    if not ids.size:
        return []
    return [(int(g), ids[gpus == g].tolist()) for g in np.unique(gpus)]


def exec_capabilities(config) -> Capabilities:
    """What the executor performs for a model (`ExecModelConfig`): host-resident decode; attention on the host CPU
    for GQA/MHA models (MLA expands its latents on the device); PARTITION over degrees that divide the heads;
    tensor-parallel attention and an FFN per micro-batch. Not: layer-by-layer prefill offload (prefill KV needs
    device pages, which policies budget for), padded batches, two-batch overlap (every forward runs whole),
    data-parallel prefill (no expert weights are streamed in)."""
    heads = (config.num_heads,) if config.is_mla else (config.num_heads, config.num_kv_heads)
    return Capabilities(layerwise_offload=False, host_resident_decode=True, padded_batches=False,
                        cpu_attention=not config.is_mla, two_batch_overlap=False, comm_overlap=False, dp_prefill=False,
                        host_prefixes=True,
                        partition_degrees=tuple(d for d in range(1, 9) if all(h % d == 0 for h in heads)))


def migration_tiers(moved: Migrated, cross: bool) -> list[tuple[str, str, int]]:
    """(kind, tier, bytes) of what a migration copied, charged to the GPU that receives it: the transfer
    ("migrate": over the network to another node, or within the node: device -> device is peer, a host copy onto
    the device h2d, ...), then the host copy the destination keeps, when it had to be made again from the arrival
    ("migrate_host_copy", device -> host: the source's was in another host pool)."""
    within = {("device", "device"): "peer", ("host", "device"): "h2d", ("device", "host"): "d2h",
              ("host", "host"): "host"}[(moved.source, moved.target)]
    return [("migrate", "network" if cross else within, moved.transfer_bytes),
            ("migrate_host_copy", "d2h", moved.local_bytes)]


class ExecBackend:
    kv_ops = True  # executes each plan's explicit KV ops (batchgen.core.ops)

    def __init__(self, state: ClusterState, runners: list[InstanceRunner], caches: list[PagedKVCache],
                 tokens: SequenceTokens, job_seed: int = 0, check: bool = False):
        """One runner per instance (its device's copy of the model), one KV cache per GPU rank.
        `check`: after each plan's KV ops, check the caches against the state (`check_placement`)."""
        if len(caches) != state.topo.num_gpus:
            raise ValueError(f"one KV cache per GPU rank: {state.topo.num_gpus} ranks, {len(caches)} caches")
        if len(runners) != state.topo.num_instances:
            raise ValueError(f"one runner per instance: {state.topo.num_instances} instances, {len(runners)}")
        self.state, self.runners, self.caches, self.tokens = state, runners, caches, tokens
        self.job_seed, self.check, self.events = job_seed, check, 0
        self.moves = Counter()  # KV operations carried out: yield, offload, restore, migrate, evict, partition
        self.account = KVAccount(state.topo.num_gpus)  # the bytes they (and the runs' checkpoints) copied
        self._t0 = clock.now()
        model = runners[0].model
        self._is_moe = any(model.moe(l) is not None for l in range(model.num_layers))
        self.capabilities = exec_capabilities(model.config)
        # what host-resident decode moved and ran: staged restores and appends (bytes), sequence-steps
        self.traffic = Counter()

    # ---- Backend protocol ---------------------------------------------------------------------------
    def now(self) -> float:
        return clock.now() - self._t0

    def execute(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        if plan.ops is None:
            raise InvariantError("the executor runs plans with their KV ops (the engine builds them when "
                                 "Backend.kv_ops is True)")
        self.move_kv(plan.ops)
        if self.check:
            self.check_placement(plan)
        if plan.prefill_ids.size:
            result = yield from self._prefill(plan)
        elif plan.chunk_ids.size:
            result = yield from self._chunked(plan)
        else:
            result = yield from self._decode(plan)
        self.events += 1
        yield None  # one step done: the driver may run another instance now
        return result

    def idle(self) -> Generator[Any, Any, None]:
        yield None  # one round: the driver runs the other instances, then this one looks again

    def wake(self) -> None:
        pass  # every instance's loop is resumed round-robin anyway

    # ---- KV ops: the tensors follow the plan ------------------------------------------------------------
    def move_kv(self, ops: KVOps) -> None:
        """A boundary's KV ops, in their order (batchgen.core.ops); each names the GPU whose cache it touches.
        Partition groups that end first: a yielded sequence's lead gathers what its host copy lacks from the
        group's shards and writes it down, then every GPU drops its shard (with a finished or evicted sequence,
        the lead its host copy too). A migration goes from the source's device pages (or, with none, its host
        copy) straight into the destination's device pages (or host copy), which keeps a host copy exactly when
        the op says (`kv_cache.migrate`); within a node the host copy changes hands in the node's host pool.
        Reshards last (`shards.reshard`): device to device, a new lead taking the host copy as a migration
        would. Shared prefixes dropped first and created or taken last (`kv_prefixes`; tails, and prefixes from other
        GPUs, copied then), but taken before a restore or resume that takes one (it then copies only the rest;
        `share_ops`)."""
        caches, account = self.caches, self.account
        for group, g in zip(ops.unshare_group.tolist(), ops.unshare_gpu.tolist()):
            caches[g].unshare_prefix(group)
        for sid, lead, degree, to_host in zip(ops.join_ids.tolist(), ops.join_lead.tolist(),
                                              ops.join_degree.tolist(), ops.join_to_host.tolist()):
            group = tuple(ops.group(lead, degree))
            if to_host:
                account.add("yield", "d2h", lead, gather_to_host(caches, sid, group, self._parts("join")))
                self.moves["yield"] += 1
            drop(caches, sid, group, keep_host_copy=to_host)
        for g, ids in _by_gpu(ops.free_ids, ops.free_gpu):
            caches[g].release(ids)
        for g, ids in _by_gpu(ops.evict_ids, ops.evict_gpu):  # recomputed later from prompt + generated tokens
            caches[g].release(ids)
            self.moves["evict"] += len(ids)
        share_host_prefixes(self.state, caches, np.concatenate([ops.yield_ids, ops.offload_ids]),
                            np.concatenate([ops.yield_gpu, ops.offload_gpu]))
        for kind, ids_, gpus in (("yield", ops.yield_ids, ops.yield_gpu), ("offload", ops.offload_ids,
                                                                          ops.offload_gpu)):
            for g, ids in _by_gpu(ids_, gpus):  # checkpoint to the host copy, pages freed
                self._counted(kind, "d2h", g, caches[g].yield_to_host, ids)
                self.moves[kind] += len(ids)
        shares, migrations = ShareOps(ops, caches, account, self.state.topo.gpu_node), ops.migrations()
        shares.before({m[0] for m in migrations}, resuming=True)  # a resume that takes its prefix copies the rest
        for sid, src, dst, to_device, host_copy, cross in migrations:
            moved = migrate(caches[src], caches[dst], sid, to_device=to_device, host_copy=host_copy)
            for kind, tier, nbytes in migration_tiers(moved, cross):
                account.add(kind, tier, dst, nbytes)  # one sequence's KV each
            self.moves["migrate"] += 1
        shares.before(set(ops.restore_ids.tolist()))  # and so does a restore
        for g, ids in _by_gpu(ops.restore_ids, ops.restore_gpu):
            self._counted("restore", "h2d", g, caches[g].restore, ids)
            self.moves["restore"] += len(ids)
        node = self.state.topo.gpu_node
        for sid, old, new, host_copy in ops.reshards():
            reshard(caches, sid, old, new, self._parts("reshard"))
            if host_copy and old[0] != new[0]:  # the lead's host copy follows it
                moved = migrate(caches[old[0]], caches[new[0]], sid, to_device=False, host_copy=True)
                for _, tier, nbytes in migration_tiers(moved, bool(node[old[0]] != node[new[0]])):
                    account.add("reshard_host_copy", tier, new[0], nbytes)
            self.moves["partition"] += int(len(new) > 1)
        shares.rest()
        for group, g in zip(ops.untail_group.tolist(), ops.untail_gpu.tolist()):  # tail pages freed, last
            caches[g].untail_prefix(group)

    def _parts(self, kind: str):
        """A `shards.Count` that charges each part of a reshard or gather to the GPU that receives it, as `kind`:
        peer from a GPU of its node, network from another."""
        node = self.state.topo.gpu_node

        def count(part: Part, nbytes: int) -> None:
            self.account.add(kind, "peer" if node[part.src] == node[part.dst] else "network", part.dst, nbytes)
            if kind == "reshard":
                self.traffic["reshard_bytes"] += nbytes
        return count

    def _counted(self, kind: str, tier: str, gpu: int, copy, ids: list[int]) -> None:
        """copy(ids) on GPU `gpu`'s cache, its bytes (as the cache measured them) counted as `kind` there."""
        cache = self.caches[gpu]
        before = cache.copied.copy()
        copy(ids)
        self.account.add(kind, tier, gpu, cache.copied[tier] - before[tier],
                         cache.copied[f"{tier}_seqs"] - before[f"{tier}_seqs"])

    def check_placement(self, plan: StepPlan) -> None:
        """The caches checked against the state (with `check_invariants`): after the plan's ops, every cache of
        the instance holds exactly what the state says it runs or keeps there, and each
        sequence about to decode is on device exactly when it runs device-resident."""
        t = self.state.table
        for g in plan.gpus.tolist():
            cache = self.caches[g]
            cache.check()  # its own pages: none lost, a shared one held exactly as often as it is counted
            held = np.array(cache.seq_ids(), np.int64)
            if not held.size:
                continue
            host_only = np.array([not cache.on_device(s) for s in held.tolist()], bool)
            ok = (t.where[held] == g) | ((t.where[held] == SUSPENDED) & host_only)
            if plan.prefill_to_host:  # prompts that write or take a shared prefix in their forward (share ops)
                ok |= np.isin(held, plan.prefill_ids)
            if not ok.all():
                sid = int(held[~ok][0])
                raise InvariantError(f"GPU {g}'s cache holds sequence {sid}, which the state has at "
                                     f"{int(t.where[sid])} (a KV op is missing from the plan)")
        gpus = plan.gpus[plan.decode_rank]
        for sid, g, host, tp in zip(plan.decode_ids.tolist(), gpus.tolist(), plan.decode_host_resident.tolist(),
                                    plan.decode_tp.tolist()):
            cache = self.caches[g]
            if tp > 1:  # its shard on every GPU of its group; on its lead at most a host copy beside it
                group = self.state.group_of(g, tp)
                if any(sid not in shards_of(self.caches[m]) for m in group) or (sid in cache
                                                                                 and cache.on_device(sid)):
                    raise InvariantError(f"sequence {sid} decodes partitioned over GPUs {group} without its shards "
                                         "there (or with device pages on its lead)")
            elif sid not in cache or cache.on_device(sid) != (not host):
                raise InvariantError(f"sequence {sid} decodes on GPU {g} " + ("host-resident" if host
                                     else "device-resident") + " but its cache does not hold it so")

    # ---- runs ----------------------------------------------------------------------------------------
    def _rank_batches(self, plan: StepPlan, ids: np.ndarray, ranks: np.ndarray, *, whole: bool,
                      host: np.ndarray | None = None, cascade: np.ndarray | None = None,
                      shared: np.ndarray | None = None) -> list[RankBatch]:
        """Per rank: each sequence's new tokens (the whole context when `whole`, from the plan's `prefill_start`
        where a prefill takes a shared prefix; else its last token), whether it runs host-resident (`host`, per
        id), and the group whose prefix it reads in a cascaded call and its tokens (`cascade`, `shared`, per id: the
        plan's)."""
        out = []
        t = self.state.table
        for r, g in enumerate(plan.gpus):
            on_rank = ranks == r
            mine = ids[on_rank].tolist()
            batch = RankBatch(self.caches[g], mine, [], [], [], [] if host is None else host[on_rank].tolist(),
                              [] if whole else t.tp[ids[on_rank]].tolist())
            if cascade is not None and cascade.size:
                batch.cascade, batch.shared = cascade[on_rank].tolist(), shared[on_rank].tolist()
            starts = plan.prefill_start[on_rank].tolist() if whole and plan.prefill_start.size else None
            for i, sid in enumerate(mine):
                if whole:
                    ctx = self.tokens.context(sid)
                    start = starts[i] if starts else 0
                    batch.token_ids.extend(ctx[start:])
                    batch.new_counts.append(len(ctx) - start)
                    batch.start_positions.append(start)
                else:
                    batch.token_ids.append(self.tokens.last_token(sid))
                    batch.new_counts.append(1)
                    batch.start_positions.append(self.tokens.context_len(sid) - 1)
            out.append(batch)
        return out

    def _sample(self, ids: list[int], logits: torch.Tensor) -> list[int]:
        if not ids:  # a forward of prompt chunks none of which ends its prompt
            return []
        steps = [len(self.tokens.generated[s]) for s in ids]
        params = [self.tokens.params[s] for s in ids]
        return sample(logits, params, ids, steps, job_seed=self.job_seed).tolist()

    def _forward(self, plan: StepPlan, batches: list[RankBatch]) -> Generator[Any, Any, tuple]:
        """One forward over every rank of the instance, as a generator the run methods `yield from`: here it runs
        at once and yields nothing; backend=dist posts it to the instance's processes, yields (the next
        instance's loop posts its own, so instances run concurrently), then collects the replies."""
        return (yield from self._forward_once(plan, batches))

    def _forward_once(self, plan: StepPlan, batches: list[RankBatch]) -> Generator[Any, Any, tuple]:
        """(sampled ids, their logits, ForwardStats)."""
        yield from ()  # runs here and now (a generator only for backend=dist's post, yield, collect)
        logits, stats = self.runners[plan.instance].forward(batches, plan.micro_batch, plan.cpu_attention,
                                                            plan.ffn_schedule)
        self.traffic["weight_bytes"] += stats.weight_bytes
        self.traffic["ffn_calls"] += stats.ffn_calls
        self.traffic["restored_bytes"] += stats.restored_bytes
        self.traffic["appended_bytes"] += stats.appended_bytes
        self.traffic["cascade_prefix_reads"] += stats.prefix_reads
        self.traffic["host_resident_seq_steps"] += stats.host_resident
        self.traffic["seq_steps"] += sum(len(b.seq_ids) for b in batches)
        self.traffic["peak_rank_running"] = max(self.traffic["peak_rank_running"],
                                                max(len(b.seq_ids) for b in batches))
        if plan.cpu_attention:
            self.traffic["cpu_attention_seq_steps"] += stats.host_resident
        ids = [s for b in batches for s, keep in zip(b.seq_ids, b.sample or [True] * len(b.seq_ids)) if keep]
        rows = [l for l in logits if l.numel()]
        return ids, (torch.cat(rows) if rows else torch.empty(0)), stats

    def _decode(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        ids, ranks = plan.decode_ids, plan.decode_rank
        n, R = ids.size, plan.gpus.size
        produced = np.zeros(n, np.int64)
        finished = np.zeros(n, bool)
        offsets = np.full(n, np.nan)
        busy, expert_tokens, calls, it = np.zeros(R), 0.0, 0, 0
        modules: Counter = Counter()
        index = {int(s): i for i, s in enumerate(ids.tolist())}
        for it in range(1, plan.steps + 1):
            live = ~finished
            batches = self._rank_batches(plan, ids[live], ranks[live], whole=False,
                                         host=plan.decode_host_resident[live],
                                         cascade=plan.decode_cascade[live] if plan.decode_cascade.size else None,
                                         shared=plan.decode_shared[live] if plan.decode_cascade.size else None)
            order, logits, stats = yield from self._forward(plan, batches)
            busy += np.array(stats.rank_attention_s) + stats.ffn_s
            expert_tokens += stats.gate_tokens
            calls += 1
            sampled = self._timed_sample(order, logits, stats, modules)
            now = self.now() - plan.start
            for sid, tok in zip(order, sampled):
                i = index[sid]
                produced[i] += 1
                if self.tokens.append(sid, tok):
                    finished[i], offsets[i] = True, now
            if finished.all() or self._stop(plan.stop, finished, live, ranks, R):
                break
        self._true_lengths(ids, produced, finished)
        if plan.host_sync:
            self._sync(plan, ids[~finished])
        return self._result(plan, it, produced, finished, offsets, np.zeros(0, bool), busy, expert_tokens, calls,
                            modules)

    @staticmethod
    def _stop(rule: str, finished: np.ndarray, was_live: np.ndarray, ranks: np.ndarray, R: int) -> bool:
        if rule == "first_finish":
            return bool((finished & was_live).any())
        if rule == "rank_drains":
            left = np.bincount(ranks[~finished], minlength=R)
            had = np.bincount(ranks, minlength=R)
            return bool(np.any((had > 0) & (left == 0)))
        return False

    def _prefill(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        """One forward: prompts (or prompt + generated tokens, for a recompute) and one token for each running
        sequence. Prefills bound for host are yielded right after it; their KV needs device pages during the
        forward, which the policy budgets for (this backend has no layer-by-layer offload)."""
        dec_ids, dec_ranks, pre_ids = plan.decode_ids, plan.decode_rank, plan.prefill_ids
        batches = self._rank_batches(plan, pre_ids, plan.prefill_rank, whole=True)
        decodes = self._rank_batches(plan, dec_ids, dec_ranks, whole=False, host=plan.decode_host_resident,
                                     cascade=plan.decode_cascade, shared=plan.decode_shared)
        for b, d in zip(batches, decodes):
            b.host_resident = [False] * len(b.seq_ids) + d.host_resident
            b.tp = [1] * len(b.seq_ids) + d.tp
            b.cascade, b.shared = d.cascade, d.shared
            b.lead_with(len(b.seq_ids))
            b.seq_ids += d.seq_ids
            b.token_ids += d.token_ids
            b.new_counts += d.new_counts
            b.start_positions += d.start_positions
        order, logits, stats = yield from self._forward(plan, batches)
        modules: Counter = Counter()
        sampled = self._timed_sample(order, logits, stats, modules)
        now = self.now() - plan.start
        done = dict(zip(order, (self.tokens.append(sid, tok) for sid, tok in zip(order, sampled))))
        pre_finished = np.array([done[int(s)] for s in pre_ids], bool)
        finished = np.array([done[int(s)] for s in dec_ids], bool)
        produced = np.ones(dec_ids.size, np.int64)
        held = self._prefills_to_host(plan, pre_finished) if plan.prefill_to_host else None
        self._true_lengths(pre_ids, np.ones(pre_ids.size, np.int64), pre_finished)
        self._true_lengths(dec_ids, produced, finished)
        if plan.host_sync:
            self._sync(plan, dec_ids[~finished])
        busy = np.array(stats.rank_attention_s) + stats.ffn_s
        offsets = np.where(finished, now, np.nan)
        res = self._result(plan, 1, produced, finished, offsets, pre_finished, busy, stats.gate_tokens, 1, modules)
        if held is not None:
            res.prefill_host_held = held
        return res

    def _prefills_to_host(self, plan: StepPlan, pre_finished: np.ndarray) -> np.ndarray:
        """Prefills bound for host (and not finished at once): yielded to their host copies after the forward, each
        past its node's host prefix of its group where it takes one (the state's rule, decided now and returned
        for `prefilled_to_host`: the tokens each holds there)."""
        state, held = self.state, np.zeros(plan.prefill_ids.size, np.int64)
        live = ~pre_finished
        if state.host_sharing and live.any():
            ids, gpus = plan.prefill_ids[live], plan.gpus[plan.prefill_rank[live]]
            tokens, creates = state.host_plan(ids, state.topo.gpu_node[gpus])
            held[live] = tokens
            for sid, g, n, c in zip(ids.tolist(), gpus.tolist(), tokens.tolist(), creates.tolist()):
                if n:
                    self.caches[g].share_host_prefix(sid, int(state.prefix_group[sid]), n, c)
        for r, g in enumerate(plan.gpus.tolist()):
            self._counted("to_host", "d2h", g, self.caches[g].yield_to_host,
                          plan.prefill_ids[(plan.prefill_rank == r) & ~pre_finished].tolist())
        return held

    def _chunked(self, plan: StepPlan) -> Generator[Any, Any, StepResult]:
        """One forward of chunked prefill: per rank, each chunk's tokens at their positions (attending over the
        KV its earlier chunks left in the paged cache, and writing its own there), then one token for every
        running sequence. Only decodes and chunks that end their context reach the LM head and sample."""
        dec_ids, dec_ranks = plan.decode_ids, plan.decode_rank
        decodes = self._rank_batches(plan, dec_ids, dec_ranks, whole=False, host=plan.decode_host_resident,
                                     cascade=plan.decode_cascade, shared=plan.decode_shared)
        for r, (g, batch) in enumerate(zip(plan.gpus, decodes)):
            on_rank = np.flatnonzero(plan.chunk_rank == r)
            ids = plan.chunk_ids[on_rank].tolist()
            starts, lens = plan.chunk_start[on_rank].tolist(), plan.chunk_len[on_rank].tolist()
            tokens: list[int] = []
            for sid, start, n in zip(ids, starts, lens):
                tokens.extend(self.tokens.context(sid)[start:start + n])
            batch.sample = plan.chunk_completes[on_rank].tolist() + [True] * len(batch.seq_ids)
            batch.host_resident = [False] * len(ids) + (batch.host_resident or [False] * len(batch.seq_ids))
            batch.tp = [1] * len(ids) + (batch.tp or [1] * len(batch.seq_ids))
            batch.lead_with(len(ids))
            batch.seq_ids = ids + batch.seq_ids
            batch.token_ids = tokens + batch.token_ids
            batch.new_counts = lens + batch.new_counts
            batch.start_positions = starts + batch.start_positions
        order, logits, stats = yield from self._forward(plan, decodes)
        modules: Counter = Counter()
        sampled = self._timed_sample(order, logits, stats, modules)
        now = self.now() - plan.start
        done = dict(zip(order, (self.tokens.append(sid, tok) for sid, tok in zip(order, sampled))))
        chunk_finished = np.array([done.get(int(s), False) for s in plan.chunk_ids], bool)
        finished = np.array([done[int(s)] for s in dec_ids], bool)
        produced = np.ones(dec_ids.size, np.int64)
        self._true_lengths(plan.chunk_ids, np.ones(plan.chunk_ids.size, np.int64), chunk_finished)
        self._true_lengths(dec_ids, produced, finished)
        if plan.host_sync:
            self._sync(plan, dec_ids[~finished])
        busy = np.array(stats.rank_attention_s) + stats.ffn_s
        offsets = np.where(finished, now, np.nan)
        result = self._result(plan, 1, produced, finished, offsets, np.zeros(0, bool), busy, stats.gate_tokens, 1,
                              modules)
        result.chunk_finished = chunk_finished
        result.tokens = int(produced.sum() + plan.chunk_len.sum())
        return result

    def _true_lengths(self, ids: np.ndarray, produced: np.ndarray, finished: np.ndarray) -> None:
        """A sequence that stopped before its max_tokens (EOS, stop string) has found its output length."""
        t = self.state.table
        done = ids[finished]
        t.output_len[done] = t.decoded[done] + produced[finished]

    def _sync(self, plan: StepPlan, ids: np.ndarray) -> None:
        """host_sync: the new tokens of running device-resident sequences into the host copies the state counts
        (a sequence without one, in the state, gets none here either); a partitioned one's lead gathers them from
        its group's shards first (`shards.gather_to_host`)."""
        tp = self.state.table.tp
        for g, mine in self._synced(plan, ids):
            cache = self.caches[g]
            self._counted("sync", "d2h", g, cache.sync_to_host, [s for s in mine if tp[s] == 1 and cache.on_device(s)])
            for sid in (s for s in mine if tp[s] > 1):
                group = self.state.group_of(g, int(tp[sid]))
                self.account.add("sync", "d2h", g, gather_to_host(self.caches, sid, group, self._parts("sync")))

    def _synced(self, plan: StepPlan, ids: np.ndarray) -> list[tuple[int, list[int]]]:
        """(GPU, its sequences among `ids` whose host copy the state counts), for each GPU of the plan."""
        t = self.state.table
        ids = ids[t.host_node[ids] >= 0]
        return [(g, ids[t.where[ids] == g].tolist()) for g in plan.gpus.tolist()]

    def _timed_sample(self, order: list[int], logits: torch.Tensor, stats, modules: Counter) -> list[int]:
        """Sample, and add the forward's module seconds to `modules`: attention (all ranks: they share one
        device here), ffn, and head = LM head + sampling (what validation compares per module)."""
        start = clock.now()
        sampled = self._sample(order, logits)
        modules["attention"] += float(sum(stats.rank_attention_s))
        modules["ffn"] += stats.ffn_s
        modules["head"] += stats.head_s + clock.now() - start
        return sampled

    def _result(self, plan, iterations, produced, finished, offsets, pre_finished, busy, expert_tokens, calls,
                modules=None):
        duration = self.now() - plan.start
        return StepResult(duration=duration, iterations=iterations, produced=produced, finished=finished,
                          finish_offset=np.where(finished, offsets, np.nan), prefill_finished=pre_finished,
                          rank_busy=busy, rank_comm=np.zeros(plan.gpus.size), expert_tokens=float(expert_tokens),
                          expert_calls=calls if self._is_moe else 0,
                          tokens=int(produced.sum() + sum(self.tokens.context_len(int(s)) - 1
                                                          for s in plan.prefill_ids)),
                          modules=dict(modules or {}))

