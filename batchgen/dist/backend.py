"""`DistBackend`: the engine's backend on rank 0 of a `backend=dist` run; the runs happen in every process.

It is the single-process executor (`ExecBackend`: building each rank's batch from the sequences' tokens,
stopping rules, recording produced tokens and finishes) with the three places that touch tensors sent to the
ranks instead: KV ops (`move_kv`: each rank's `GpuOps` from `StepPlan`'s `KVOps.for_gpu`, and the migrations
in plan order, each straight from the source's device pages or host copy into the destination's), forwards
(`_forward_once`: each rank's `ForwardPart`; every rank runs its own and samples its own sequences; the tokens
come back with a gather on the instance's reply group) and the host copies (`_prefills_to_host`, `_sync`).
Rank 0 is a worker too (of instance 0): it executes its share of each command on its own rank
(`RankWorker.handle`, run by the `CommandChannel` in posting order).

Instances run concurrently: every command goes to the instances it concerns (control.py), and a forward is
posted, then `_forward_once` yields (back to `Engine.run_in_turn`, whose next instance's loop posts its own
forward), then collects the replies. A KV command that names another instance's GPU (a migration of a sequence
that instance yielded on a shared node) first collects that instance's open forward, then goes to both.

Rank 0 keeps every sequence's tokens (`SequenceTokens`), so the workers hold no token state: a forward part
carries each sequence's new tokens and positions. Every decode iteration is one round (broadcast, forward,
gather), so the stopping rules (first_finish, rank_drains) and end-of-sequence are decided in one place.

Per-rank busy and communication seconds in each `StepResult` are the workers' own measurements (see
worker.py), not an estimate from rank 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from batchgen.core.ops import KVOps
from batchgen.core.sequences import InvariantError
from batchgen.core.state import ClusterState
from batchgen.dist.control import CommandChannel
from batchgen.dist.worker import Command, ForwardPart, ForwardReply, RankWorker, Totals
from batchgen.engine import StepPlan
from batchgen.exec.backend import ExecBackend
from batchgen.exec.runner import ForwardStats, RankBatch
from batchgen.exec.sequences import SequenceTokens


class DistBackend(ExecBackend):
    def __init__(self, state: ClusterState, worker: RankWorker, tokens: SequenceTokens, procs: int,
                 is_moe: bool, job_seed: int = 0, channel: CommandChannel | None = None, comm_overlap: bool = False,
                 dp_prefill: bool = False):
        """channel: rank 0's command channel to every instance (control.py); by default over the worker's
        (`RankWorker.channels`, or its own control groups for one instance). `comm_overlap`: the policy's; every
        forward then overlaps each micro-batch's expert all-to-all with the next one's attention. `dp_prefill`:
        the policy's prefill_parallel=dp; every forward that prefills then runs data parallel in each process
        (batchgen.dist.dp_prefill), without the all-to-all and so without its overlap."""
        topo = state.topo
        if topo.num_gpus != procs:
            raise ValueError(f"backend=dist runs one process per GPU: {procs} processes, but the state has "
                             f"{topo.num_gpus} GPUs")
        # one process per GPU: GPU g is rank g, and instance i's GPUs are its process group's ranks
        self.instance_ranks = [tuple(state.instance_gpus(i).tolist()) for i in range(topo.num_instances)]
        start = 0
        for i, ranks in enumerate(self.instance_ranks):
            if ranks != tuple(range(start, start + len(ranks))):
                raise InvariantError(f"instance {i} has GPUs {ranks}: backend=dist needs each instance's GPUs "
                                     "consecutive, in instance order (its process group, groups.instance_ranks)")
            start += len(ranks)
        # the caches live in the workers: rank 0 holds none of the others' (a placeholder per rank); one model
        # per process, so every instance's "runner" here is rank 0's (only its config is read)
        super().__init__(state, [worker.runner] * topo.num_instances, [None] * procs, tokens, job_seed=job_seed)
        self.worker, self.procs = worker, procs
        if channel is None:  # the worker's: every instance's command and reply groups, or its own for one
            pairs = worker.channels or [(worker.control, worker.replies)]
            if len(pairs) != topo.num_instances:
                raise ValueError(f"{topo.num_instances} instances need a command channel to each "
                                 f"(control.CommandChannel); the worker has {len(pairs)}")
            channel = CommandChannel(worker, [c for c, _ in pairs], [r for _, r in pairs], self.instance_ranks)
        self.channel = channel
        self._instance_of = np.repeat(np.arange(topo.num_instances), [len(r) for r in self.instance_ranks])
        self._is_moe = is_moe  # the runner's MoE layers are ExpertParallelMoE now, not SparseMoE
        self.comm_overlap = bool(comm_overlap)
        self.dp_prefill = bool(dp_prefill)
        # not built across processes: two-batch overlap, TP attention, an FFN per micro-batch (declared so that
        # the engine refuses a policy that needs them before the run; check_dist refuses them before the processes
        # start). PARTITION: over at most the instance's processes (dist/partition). The all-to-all overlapped
        # across micro-batches, and data-parallel prefill: with expert-parallel layers (exec/overlap_layers,
        # dist/dp_prefill)
        size = min(len(r) for r in self.instance_ranks)
        degrees = tuple(d for d in self.capabilities.partition_degrees if d <= size)
        self.capabilities = dataclasses.replace(self.capabilities, partition_degrees=degrees,
                                                two_batch_overlap=False, comm_overlap=is_moe, attention_tp=False,
                                                micro_batch_ffn=False, dp_prefill=is_moe,
                                                host_prefixes=False)  # each process's host copies stay whole
        # per instance (its loop's current run), per rank of the instance: the workers' own measurements
        self._busy = [np.zeros(len(r)) for r in self.instance_ranks]
        self._comm = [np.zeros(len(r)) for r in self.instance_ranks]
        self.totals: list[Totals] | None = None

    # ---- the control channel -------------------------------------------------------------------------
    def shutdown(self) -> list[Totals]:
        """The workers leave their loops; every rank's totals (wall, busy, comm, idle seconds)."""
        every = range(len(self.instance_ranks))
        self.channel.quiesce(every)
        self.totals = self.channel.collect(self.channel.post(Command("stop"), every))
        self.channel.finish_sends()
        for t in self.totals:  # the ranks' own counts of PARTITION's bytes (split, join, per-layer exchange)
            self.traffic.update(t.traffic)
            for kind, tiers in t.kv_bytes.items():  # and of every KV byte they copied
                for tier, (nbytes, seqs) in tiers.items():
                    self.account.add(kind, tier, t.rank, nbytes, seqs)
        return self.totals

    def abort(self) -> None:
        """Rank 0 failed: the workers leave their loops instead of waiting for a command that never comes."""
        self.channel.abort(Command("abort"))

    # ---- Backend protocol ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan):
        if plan.ffn_schedule != "combined":
            raise ValueError(f"backend=dist runs one expert batch per layer (ffn_schedule=combined); the policy "
                             f"asked for {plan.ffn_schedule!r}, which would give the ranks different numbers of "
                             "all-to-alls: use a policy without per-micro-batch FFNs")
        self._busy[plan.instance][:] = 0.0
        self._comm[plan.instance][:] = 0.0
        return (yield from super().execute(plan))

    def move_kv(self, ops: KVOps) -> None:
        """Posted to the instance and to every instance whose GPUs the ops name (the source of a migration of a
        sequence another instance yielded): one ordered step on all of them, once those have no forward open
        (control.py)."""
        if ops.empty():
            return
        bad = sorted(set(ops.reshard_to_degree.tolist()) - set(self.capabilities.partition_degrees))
        if bad:
            raise ValueError(f"a plan partitions sequences over {bad[0]} ranks; backend=dist declares degrees "
                             f"{self.capabilities.partition_degrees} for this model over instances of "
                             f"{min(len(r) for r in self.instance_ranks)} processes")
        named = np.concatenate([ops.gpus, ops.free_gpu, ops.evict_gpu, ops.yield_gpu, ops.offload_gpu,
                                ops.migrate_src, ops.migrate_dst, ops.restore_gpu])
        ranks = sorted(set(named.tolist()))
        parts = {g: ops.for_gpu(g) for g in ranks}
        migrations = ops.migrations()
        instances = sorted(set(self._instance_of[ranks].tolist()))
        if len(instances) > 1:
            self.channel.quiesce(instances)
        self.channel.post(Command("kv", parts, migrations, copies=ops.prefix_copies(), resumed=ops.resume_prefixes()),
                          instances)
        self.moves["evict"] += int(ops.evict_ids.size)
        self.moves["yield"] += int(ops.yield_ids.size + ops.join_to_host.sum())  # a partitioned one: its join
        self.moves["offload"] += int(ops.offload_ids.size)
        self.moves["migrate"] += int(ops.migrate_ids.size)
        self.moves["restore"] += int(ops.restore_ids.size)
        self.moves["partition"] += int((ops.reshard_to_degree > 1).sum())
        inst = set(ops.gpus.tolist())
        self.traffic["cross_instance_migrations"] += sum(
            1 for s, d in zip(ops.migrate_src.tolist(), ops.migrate_dst.tolist()) if s not in inst or d not in inst)

    def check_placement(self, plan: StepPlan) -> None:
        """The caches are in other processes; the engine's ledger checks every op against where the KV is."""

    # ---- runs: the forward in every process ---------------------------------------------------------------
    def _forward_once(self, plan: StepPlan, batches: list[RankBatch]):
        """Post the forward to the instance's processes, yield (the other instances' loops post theirs: the
        instances compute at the same time), then collect the replies (rank 0 runs its own part first when it
        belongs to this instance)."""
        generated = self.tokens.generated
        parts = {}
        for g, b in zip(plan.gpus.tolist(), batches):
            sampled = [s for s, keep in zip(b.seq_ids, b.sample or [True] * len(b.seq_ids)) if keep]
            parts[g] = ForwardPart(b.seq_ids, b.token_ids, b.new_counts, b.start_positions, b.host_resident,
                                   b.tp, b.sample, [len(generated[s]) for s in sampled], b.cascade, b.shared)
        dp = self.dp_prefill and bool(plan.prefill_ids.size)  # as the simulator prices it (sim/backend.py)
        ticket = self.channel.post(Command("forward", parts, micro_batch=plan.micro_batch,
                                           cpu_attention=plan.cpu_attention, ffn_schedule=plan.ffn_schedule,
                                           comm_overlap=self.comm_overlap and not dp, dp_prefill=dp),
                                   [plan.instance])
        yield None
        replies: list[ForwardReply] = self.channel.collect(ticket)  # in rank order: the instance's ranks
        stats = ForwardStats(rank_attention_s=[r.attention_s for r in replies],
                             ffn_s=max(r.ffn_s for r in replies), head_s=max(r.head_s for r in replies),
                             gate_tokens=sum(r.gate_tokens for r in replies),
                             host_resident=sum(r.host_resident for r in replies),
                             restored_bytes=sum(r.restored_bytes for r in replies),
                             appended_bytes=sum(r.appended_bytes for r in replies),
                             prefix_reads=sum(r.prefix_reads for r in replies))
        self._busy[plan.instance] += [r.busy_s for r in replies]
        self._comm[plan.instance] += [r.comm_s for r in replies]
        t = self.traffic
        t["restored_bytes"] += stats.restored_bytes
        t["appended_bytes"] += stats.appended_bytes
        t["cascade_prefix_reads"] += stats.prefix_reads
        t["host_resident_seq_steps"] += stats.host_resident
        t["seq_steps"] += sum(len(b.seq_ids) for b in batches)
        t["peak_rank_running"] = max(t["peak_rank_running"], max(len(b.seq_ids) for b in batches))
        if plan.cpu_attention:
            t["cpu_attention_seq_steps"] += stats.host_resident
        order = [s for r in replies for s in r.ids]
        sampled = torch.tensor([tok for r in replies for tok in r.tokens], dtype=torch.long)
        return order, sampled, stats

    def _sample(self, ids: list[int], logits: torch.Tensor) -> list[int]:
        """The workers sampled already (`_forward_once` returns their tokens in place of logits)."""
        return logits.tolist()

    def _prefills_to_host(self, plan: StepPlan, pre_finished: np.ndarray) -> None:
        parts = {g: plan.prefill_ids[(plan.prefill_rank == r) & ~pre_finished].tolist()
                 for r, g in enumerate(plan.gpus.tolist())}
        self._post_nonempty("to_host", parts)

    def _sync(self, plan: StepPlan, ids: np.ndarray) -> None:
        """Each rank syncs its own sequences' host copies; a partitioned sequence's lead gathers its new tokens
        from its group first, every rank of the instance walking the same list (`Command.gathers`)."""
        tp = self.state.table.tp
        synced = self._synced(plan, ids)
        gathers = [(s, self.state.group_of(g, int(tp[s]))) for g, mine in synced for s in mine if tp[s] > 1]
        parts = {g: [s for s in mine if tp[s] == 1] for g, mine in synced}
        if not gathers:
            self._post_nonempty("sync", parts)
            return
        nodes = dict(zip(plan.gpus.tolist(), self.state.topo.gpu_node[plan.gpus].tolist()))
        self.channel.post(Command("sync", {g: p for g, p in parts.items() if p}, gathers=gathers, nodes=nodes),
                          [plan.instance])

    def _post_nonempty(self, kind: str, parts: dict) -> None:
        parts = {g: p for g, p in parts.items() if p}
        if parts:
            self.channel.post(Command(kind, parts), sorted(set(self._instance_of[list(parts)].tolist())))

    def _result(self, plan: StepPlan, *args, **kw):
        """The single-process result, with each rank's busy and communication seconds as it measured them."""
        res = super()._result(plan, *args, **kw)
        res.rank_busy = self._busy[plan.instance].copy()
        res.rank_comm = self._comm[plan.instance].copy()
        return res
