"""`DistBackend`: the engine's backend on rank 0 of a `backend=dist` run; the runs happen in every process.

It is the single-process executor (`ExecBackend`: building each rank's batch from the sequences' tokens,
stopping rules, recording produced tokens and finishes) with the three places that touch tensors sent to the
ranks instead: KV ops (`move_kv`: each rank's `GpuOps` from `StepPlan`'s `KVOps.for_gpu`, and the migrations
in plan order), forwards (`_forward_once`: each rank's `ForwardPart`; every rank runs its own and samples its
own sequences; the tokens come back with a gather) and the host copies (`_prefills_to_host`, `_sync`).
Rank 0 is a worker too: it executes each command it broadcasts on its own rank (`RankWorker.handle`).

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
from batchgen.core.state import ClusterState
from batchgen.dist.worker import Command, ForwardPart, ForwardReply, RankWorker, Totals
from batchgen.engine import StepPlan
from batchgen.exec.backend import ExecBackend
from batchgen.exec.runner import ForwardStats, RankBatch
from batchgen.exec.sequences import SequenceTokens


class DistBackend(ExecBackend):
    def __init__(self, state: ClusterState, worker: RankWorker, tokens: SequenceTokens, procs: int,
                 is_moe: bool, job_seed: int = 0):
        if state.topo.num_instances != 1 or state.topo.num_gpus != procs:
            raise ValueError(f"backend=dist runs one instance over its {procs} processes; the state has "
                             f"{state.topo.num_instances} instances of {state.topo.num_gpus} GPUs in all")
        # the caches live in the workers: rank 0 holds none of the others' (a placeholder per rank)
        super().__init__(state, [worker.runner], [None] * procs, tokens, job_seed=job_seed)
        self.worker, self.procs = worker, procs
        self._is_moe = is_moe  # the runner's MoE layers are ExpertParallelMoE now, not SparseMoE
        # not built across processes: two-batch overlap, TP attention (declared so that the engine refuses a
        # policy that needs them before the run). PARTITION: over at most the instance's processes (dist/partition)
        degrees = tuple(d for d in self.capabilities.partition_degrees if d <= procs)
        self.capabilities = dataclasses.replace(self.capabilities, partition_degrees=degrees,
                                                two_batch_overlap=False, attention_tp=False)
        self._busy = np.zeros(procs)
        self._comm = np.zeros(procs)
        self.totals: list[Totals] | None = None

    # ---- the control channel -------------------------------------------------------------------------
    def _run(self, cmd: Command):
        """Broadcast `cmd`, execute rank 0's part here; for a forward, every rank's reply."""
        self.worker.receive(cmd)
        mine = self.worker.handle(cmd)
        if cmd.kind in ("forward", "stop"):
            return self.worker.reply(mine)
        return None

    def shutdown(self) -> list[Totals]:
        """The workers leave their loops; every rank's totals (wall, busy, comm, idle seconds)."""
        self.totals = self._run(Command("stop"))
        for t in self.totals:  # the ranks' own counts of PARTITION's bytes (split, join, per-layer exchange)
            self.traffic.update(t.traffic)
        return self.totals

    def abort(self) -> None:
        self.worker.receive(Command("abort"))

    # ---- Backend protocol ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan):
        if plan.ffn_schedule != "combined":
            raise ValueError(f"backend=dist runs one expert batch per layer (ffn_schedule=combined); the policy "
                             f"asked for {plan.ffn_schedule!r}, which would give the ranks different numbers of "
                             "all-to-alls: use a policy without per-micro-batch FFNs")
        self._busy[:] = 0.0
        self._comm[:] = 0.0
        return (yield from super().execute(plan))

    def move_kv(self, ops: KVOps) -> None:
        if ops.empty():
            return
        bad = sorted(set(ops.split_degree.tolist()) - set(self.capabilities.partition_degrees))
        if bad:
            raise ValueError(f"a plan partitions sequences over {bad[0]} ranks; backend=dist declares degrees "
                             f"{self.capabilities.partition_degrees} for this model over {self.procs} processes")
        parts = [ops.for_gpu(g) for g in range(self.procs)]
        migrations = list(zip(ops.migrate_ids.tolist(), ops.migrate_src.tolist(), ops.migrate_dst.tolist(),
                              ops.migrate_to_device.tolist()))
        self._run(Command("kv", parts, migrations))
        self.moves["evict"] += int(ops.evict_ids.size)
        self.moves["yield"] += int(ops.yield_ids.size)
        self.moves["offload"] += int(ops.offload_ids.size)
        self.moves["migrate"] += int(ops.migrate_ids.size)
        self.moves["restore"] += int(ops.restore_ids.size)
        self.moves["partition"] += int(ops.split_ids.size)

    def check_placement(self, plan: StepPlan) -> None:
        """The caches are in other processes; the engine's ledger checks every op against where the KV is."""

    # ---- runs: the forward in every process ---------------------------------------------------------------
    def _forward_once(self, plan: StepPlan, batches: list[RankBatch]):
        generated = self.tokens.generated
        parts = []
        for b in batches:
            sampled = [s for s, keep in zip(b.seq_ids, b.sample or [True] * len(b.seq_ids)) if keep]
            parts.append(ForwardPart(b.seq_ids, b.token_ids, b.new_counts, b.start_positions, b.host_resident,
                                     b.tp, b.sample, [len(generated[s]) for s in sampled]))
        replies: list[ForwardReply] = self._run(Command("forward", parts, micro_batch=plan.micro_batch,
                                                        cpu_attention=plan.cpu_attention,
                                                        ffn_schedule=plan.ffn_schedule))
        stats = ForwardStats(rank_attention_s=[r.attention_s for r in replies],
                             ffn_s=max(r.ffn_s for r in replies), head_s=max(r.head_s for r in replies),
                             gate_tokens=sum(r.gate_tokens for r in replies),
                             host_resident=sum(r.host_resident for r in replies),
                             restored_bytes=sum(r.restored_bytes for r in replies),
                             appended_bytes=sum(r.appended_bytes for r in replies))
        self._busy += [r.busy_s for r in replies]
        self._comm += [r.comm_s for r in replies]
        t = self.traffic
        t["restored_bytes"] += stats.restored_bytes
        t["appended_bytes"] += stats.appended_bytes
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
        parts = [plan.prefill_ids[(plan.prefill_rank == r) & ~pre_finished].tolist() for r in range(self.procs)]
        if any(parts):
            self._run(Command("to_host", parts))

    def _sync(self, plan: StepPlan, ids: np.ndarray) -> None:
        where = self.state.table.where[ids]
        parts = [ids[where == g].tolist() for g in range(self.procs)]
        if any(parts):
            self._run(Command("sync", parts))

    def _result(self, *args, **kw):
        """The single-process result, with each rank's busy and communication seconds as it measured them."""
        res = super()._result(*args, **kw)
        res.rank_busy = self._busy.copy()
        res.rank_comm = self._comm.copy()
        return res
