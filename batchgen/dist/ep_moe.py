"""Expert parallelism: an MoE layer whose experts are spread over the ranks of one instance.

Each rank keeps its own tokens (those of the sequences whose attention it runs) and holds the router, the
shared experts (replicated) and its shard of the routed experts (`SparseMoE.expert_shard`). One forward:

1. route on this rank (the router runs where the tokens are): top-k ids and weights, fp32;
2. order the (token, expert) assignments by expert, as `SparseMoE.experts` does, then group them by owner
   rank (experts stay ascending within an owner);
3. exchange counts: a [ranks, max local experts] matrix, one all-to-all, so every rank knows how many rows
   arrive from each source for each of its experts (the split sizes of the next exchange); pipelined, it is in
   flight while the rows to send are gathered;
4. dispatch the rows (the token's hidden state once per assignment) with all_to_all_single;
5. run the local experts on what arrived, sorted by expert with the sources in rank order
   (`SparseMoE.sorted_expert_rows`: the same kernels, grouped GEMM or loop);
6. return the rows with the reverse all-to-all and combine them exactly as `SparseMoE.experts` does (weight in
   fp32, cast, index_add in expert order), then add the shared experts' output for this rank's tokens.

Overlap (`pipeline`, default `DEFAULT_PIPELINE`): steps 4-6 can be pipelined over groups of the local expert
slots (slots 0..a of every rank first, then the next block, ...). Each group's rows go out in their own
asynchronous all-to-all, all issued at once after the count exchange; the local experts of group g run as soon
as group g's rows are in, while the later groups' rows are still arriving, and group g's outputs go back
asynchronously while group g+1 computes; the combine then waits for every group and adds in expert order as
before. A layer's shared experts (DeepSeek) run while the dispatch is in flight. The sends are laid out by
(group, owner, slot) so each group's rows are one contiguous block, and the returned rows land in the same
layout. An expert lives in exactly one group, so it still runs one GEMM on all its rows in the same order: the
pipelined layer gives the synchronous one's bits (tests/distributed/test_ep_moe.py). Every rank of a group
must use the same `pipeline` (the all-to-alls must match).

What it gives with gloo on CPU: the operations run on the process group's worker threads and do progress while
the caller computes, but that thread needs a core, and with one process per core there is none to spare; an
all-to-all here is mostly CPU work of its own process, so the latency the overlap could hide is about 1% of a
step, less than the two more operations per layer cost (benchmarks/dist_scaling.py's interleaved A/B: pipeline=2
a few percent slower than synchronous; the figures are in benchmarks/results/dist_scaling.md). So the default is
synchronous; the pipeline is for machines where the exchange does not take a compute core (NCCL on GPUs, a spare
CPU core), to be measured there (`backend.ep_pipeline`).

Why the result equals the single-process layer over all ranks' tokens concatenated in rank order: an expert
sees the same rows in the same order (its tokens of rank 0, then of rank 1, ...), so its GEMMs get the same
matrix; each token's k contributions are added in the same (expert) order. Only the router and the shared
experts run on a rank's tokens instead of all of them: the same rows, but a GEMM of fewer rows may block its
work differently (tests/distributed measures whether that changes any bit here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from batchgen.dist.comm import Comm
from batchgen.dist.dp_prefill import PrefillRing, host_copy
from batchgen.dist.ep_overlap import OverlappedExchange
from batchgen.dist.errors import DistConfigError
from batchgen.dist.placement import ExpertPlacement
from batchgen.exec.models.moe import SparseMoE


# local-slot groups the all-to-alls are pipelined over when not given: 1 = synchronous, measured faster on the
# 2-core CPU machine (gloo; benchmarks/dist_scaling.py's A/B): see the module docstring
DEFAULT_PIPELINE = 1


def check_pipeline(pipeline, name: str = "pipeline") -> int:
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise DistConfigError(f"{name}={pipeline!r}: give the number of local-expert groups to pipeline the MoE "
                              "all-to-alls over, an integer >= 1 (1 = synchronous)")
    return pipeline


def slot_groups(width: int, pipeline: int) -> tuple[tuple[int, int], ...]:
    """`pipeline` contiguous blocks [lo, hi) of the `width` local slots, as even as they go (at most one group
    per slot: an expert is never split)."""
    n = min(check_pipeline(pipeline), width)
    bounds = [width * g // n for g in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def expert_parallel(model, comm: Comm, pipeline: int | None, device, dp_prefill: bool) -> PrefillRing | None:
    """Every MoE layer of `model` (a `MoEDecoder`) made expert parallel over `comm`'s group, in place; with
    `dp_prefill`, each keeping a host copy of every expert, and the process's ring (returned) for the forwards
    that prefill data parallel."""
    layers = [(i, m) for i, m in ((i, model.moe(i)) for i in range(model.num_layers)) if m is not None]
    ring = PrefillRing(layers[0][1], device) if dp_prefill and layers else None
    for i, moe in layers:
        model.layers[i].mlp = ExpertParallelMoE(moe, comm, pipeline=pipeline, ring=ring)
    return ring


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: SparseMoE, comm: Comm, placement: ExpertPlacement | None = None,
                 pipeline: int | None = None, ring: PrefillRing | None = None):
        """moe: the whole layer (every rank builds or loads it, then keeps only its shard: the full expert
        stacks can be dropped once this returns, unless `ring` is given). placement: contiguous blocks over the
        group by default. pipeline: groups of local slots the dispatch, expert compute and combine are pipelined
        over (1: one synchronous dispatch and combine; None: DEFAULT_PIPELINE); the same on every rank of the
        group. `ring`: the process's data-parallel prefill ring (batchgen.dist.dp_prefill): the layer keeps a
        host copy of every expert, and while the ring is active runs its tokens through all of them, alone."""
        super().__init__()
        placement = placement or ExpertPlacement.contiguous(moe.num_experts, comm.size)
        if placement.num_experts != moe.num_experts or placement.ranks != comm.size:
            raise DistConfigError(f"placement of {placement.num_experts} experts over {placement.ranks} ranks "
                                  f"does not fit a layer of {moe.num_experts} experts on a group of {comm.size}")
        self.comm, self.placement = comm, placement
        self.local_experts = placement.experts_of(comm.rank)
        self.width = placement.max_local
        self.groups = slot_groups(self.width, DEFAULT_PIPELINE if pipeline is None else pipeline)
        self.shard = moe.expert_shard(self.local_experts)
        owner, slot = placement.tables(moe.w_gate.device)
        group = torch.repeat_interleave(torch.arange(len(self.groups), device=slot.device),
                                        torch.tensor([hi - lo for lo, hi in self.groups], device=slot.device))
        self.register_buffer("owner", owner, persistent=False)
        self.register_buffer("slot", slot, persistent=False)
        self.register_buffer("_group_of_expert", group[slot], persistent=False)
        self.last_counts: torch.Tensor | None = None
        self.ring, self.host = ring, (host_copy(moe) if ring is not None else None)

    def agree(self, counts: list[int]) -> list[int]:
        """Each count's largest value over the group: the micro-batches every rank sends to `overlapped`'s
        exchange (the same number on every rank, or the all-to-alls would not match)."""
        n = torch.tensor(counts, dtype=torch.int64, device=self.owner.device)
        self.comm.all_reduce(n, what="micro-batch count", op=dist.ReduceOp.MAX)
        return n.tolist()

    def overlapped(self, micro_batches: int) -> OverlappedExchange:
        """This layer's all-to-all over `micro_batches` attention micro-batches (the count `agree` gave), each
        dispatched as it is sent and combined on its own (batchgen.dist.ep_overlap)."""
        return OverlappedExchange(self, micro_batches)

    @property
    def pipelined(self) -> bool:
        return len(self.groups) > 1

    @property
    def last_tokens_per_expert(self) -> list[int]:
        """Rows each local expert ran in the last forward (all ranks' tokens): this rank's expert batch sizes."""
        return [] if self.last_counts is None else self.last_counts.tolist()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]: this rank's tokens (T may be 0) -> the layer's output for them, [T, H]."""
        ids, weights = self.shard.route(hidden)
        if self.ring is not None and self.ring.active:  # data-parallel prefill: every expert here, no exchange
            layer = self.shard.over_experts(self.ring.fill(self.host, self.shard, self.local_experts))
            out, shared = layer.experts(hidden, ids, weights), self.shard.shared(hidden)
            self.last_counts = layer._last_counts[list(self.local_experts)]
        else:
            out, shared = self._exchange(hidden, ids, weights, self.shard.shared)
        return out if shared is None else out + shared

    def routed(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for this rank's tokens (what `SparseMoE.experts` returns)."""
        return self._exchange(hidden, topk_ids, topk_weights, None)[0]

    def _exchange(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, alongside):
        """(routed output, alongside(hidden) or None): `alongside` (the shared experts) runs while the dispatch
        is in flight when pipelined, after the combine otherwise."""
        P, W, H = self.comm.size, self.width, hidden.shape[-1]
        k = topk_ids.shape[1]
        order, expert, dest, send_counts = self.destinations(topk_ids)
        recv_counts = torch.empty_like(send_counts)
        counting = self.comm.start_all_to_all_single(recv_counts, send_counts, what="MoE count exchange")
        if not self.pipelined:
            self.comm.wait(counting)
        # rows sent by (slot group, owner rank, slot): a group's rows are one block, each owner's in expert order
        # (slots ascend with expert ids on a rank), each expert's in token order (stable)
        perm = torch.argsort(self._group_of_expert[expert] * (P * W) + dest, stable=True)
        rows = order[perm]  # assignment index of each row sent
        x_send = hidden[rows // k]
        if self.pipelined:  # the gather above overlapped the count exchange
            self.comm.wait(counting)
        send_c, recv_c = send_counts.view(P, W), recv_counts.view(P, W)
        self.last_counts = recv_c.sum(0)[:len(self.local_experts)]
        y_send = torch.empty_like(x_send)
        side = None
        if self.pipelined:
            side = self._pipeline(x_send, y_send, send_c, recv_c,
                                  None if alongside is None else (lambda: alongside(hidden)))
        else:
            send_splits, recv_splits = send_c.sum(1).tolist(), recv_c.sum(1).tolist()
            x_recv = hidden.new_empty(sum(recv_splits), H)
            self.comm.all_to_all_single(x_recv, x_send, recv_splits, send_splits, what="MoE dispatch")
            y_recv = self._run_local(x_recv, recv_c, 0)
            self.comm.all_to_all_single(y_send, y_recv, send_splits, recv_splits, what="MoE combine")
            if alongside is not None:
                side = alongside(hidden)
        return self.combined(y_send, perm, order, topk_weights, hidden.shape[0], hidden.dtype), side

    def destinations(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(the assignments by expert, as SparseMoE.experts orders them (stable); their experts; each one's
        destination (owner rank x local slot); the rows bound for each destination)."""
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        dest = self.owner[expert] * self.width + self.slot[expert]
        return order, expert, dest, torch.bincount(dest, minlength=self.comm.size * self.width)

    @staticmethod
    def combined(y_send: torch.Tensor, perm: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                 tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The returned rows (`y_send`, in the order sent: `perm` of the assignments by expert) weighted and added
        into their tokens, in expert order as SparseMoE.experts adds them: [tokens, H]."""
        y = torch.empty_like(y_send)
        y[perm] = y_send
        weighted = (y * topk_weights.reshape(-1)[order, None]).to(dtype)
        return y.new_zeros(tokens, y.shape[-1]).index_add_(0, order // topk_weights.shape[1], weighted)

    def _pipeline(self, x_send, y_send, send_c, recv_c, alongside):
        """Steps 4-6 over the slot groups: every group's dispatch issued at once; then per group, wait for its
        rows, run its experts, issue its combine (into its block of y_send); then wait for every combine.
        Returns alongside()'s value (None without one), computed while the dispatch is in flight."""
        splits = [(send_c[:, lo:hi].sum(1).tolist(), recv_c[:, lo:hi].sum(1).tolist()) for lo, hi in self.groups]
        dispatched, start = [], 0
        for send, recv in splits:
            block = slice(start, start + sum(send))
            x_recv = x_send.new_empty(sum(recv), x_send.shape[-1])
            dispatched.append((block, x_recv, self.comm.start_all_to_all_single(
                x_recv, x_send[block], recv, send, what="MoE dispatch")))
            start = block.stop
        side = None if alongside is None else alongside()
        combines = []
        for (lo, hi), (send, recv), (block, x_recv, pending) in zip(self.groups, splits, dispatched):
            self.comm.wait(pending)
            y_recv = self._run_local(x_recv, recv_c[:, lo:hi], lo)
            combines.append((y_recv, self.comm.start_all_to_all_single(
                y_send[block], y_recv, send, recv, what="MoE combine")))
        for _, pending in combines:  # (y_recv stays referenced until its combine is done)
            self.comm.wait(pending)
        return side

    def _run_local(self, x: torch.Tensor, counts: torch.Tensor, lo: int) -> torch.Tensor:
        """Rows arrived grouped by source, each source's by local slot (slots lo.. of counts' width): sort them by
        expert (sources in rank order within one), run the shard, and put the outputs back in arrival order."""
        if x.shape[0] == 0:
            return torch.empty_like(x)
        n_local, (P, width) = len(self.local_experts), counts.shape
        per_expert = counts.new_zeros(n_local)  # the other groups' experts get no rows here
        hi = max(lo, min(lo + width, n_local))  # slots past n_local: experts this rank does not have (no rows)
        per_expert[lo:hi] = counts.sum(0)[:hi - lo]
        if P == 1 or width == 1:  # arrival order is already expert order
            return self.shard.sorted_expert_rows(x, per_expert)
        slot_of_row = torch.arange(width, device=x.device).repeat(P).repeat_interleave(counts.reshape(-1))
        local_order = torch.argsort(slot_of_row, stable=True)
        out = torch.empty_like(x)
        out[local_order] = self.shard.sorted_expert_rows(x[local_order], per_expert)
        return out
