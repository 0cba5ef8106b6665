"""Expert parallelism: an MoE layer whose experts are spread over the ranks of one instance.

Each rank keeps its own tokens (those of the sequences whose attention it runs) and holds the router, the
shared experts (replicated) and its shard of the routed experts (`SparseMoE.expert_shard`). One forward:

1. route on this rank (the router runs where the tokens are): top-k ids and weights, fp32;
2. order the (token, expert) assignments by expert, as `SparseMoE.experts` does, then group them by owner
   rank (experts stay ascending within an owner);
3. exchange counts: a [ranks, max local experts] matrix, one all-to-all, so every rank knows how many rows
   arrive from each source for each of its experts (the split sizes of the next exchange);
4. dispatch the rows (the token's hidden state once per assignment) with all_to_all_single;
5. run the local experts on what arrived, sorted by expert with the sources in rank order
   (`SparseMoE.sorted_expert_rows`: the same kernels, grouped GEMM or loop);
6. return the rows with the reverse all-to-all and combine them exactly as `SparseMoE.experts` does (weight in
   fp32, cast, index_add in expert order), then add the shared experts' output for this rank's tokens.

Why the result equals the single-process layer over all ranks' tokens concatenated in rank order: an expert
sees the same rows in the same order (its tokens of rank 0, then of rank 1, ...), so its GEMMs get the same
matrix; each token's k contributions are added in the same (expert) order. Only the router and the shared
experts run on a rank's tokens instead of all of them: the same rows, but a GEMM of fewer rows may block its
work differently (tests/distributed measures whether that changes any bit here).
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.dist.comm import Comm
from batchgen.dist.errors import DistConfigError
from batchgen.dist.placement import ExpertPlacement
from batchgen.exec.models.moe import SparseMoE


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: SparseMoE, comm: Comm, placement: ExpertPlacement | None = None):
        """moe: the whole layer (every rank builds or loads it, then keeps only its shard: the full expert
        stacks can be dropped once this returns). placement: contiguous blocks over the group by default."""
        super().__init__()
        placement = placement or ExpertPlacement.contiguous(moe.num_experts, comm.size)
        if placement.num_experts != moe.num_experts or placement.ranks != comm.size:
            raise DistConfigError(f"placement of {placement.num_experts} experts over {placement.ranks} ranks "
                                  f"does not fit a layer of {moe.num_experts} experts on a group of {comm.size}")
        self.comm, self.placement = comm, placement
        self.local_experts = placement.experts_of(comm.rank)
        self.shard = moe.expert_shard(self.local_experts)
        owner, slot = placement.tables(moe.w_gate.device)
        self.register_buffer("_owner", owner, persistent=False)
        self.register_buffer("_slot", slot, persistent=False)
        self._width = placement.max_local
        self._last_counts: torch.Tensor | None = None

    @property
    def last_tokens_per_expert(self) -> list[int]:
        """Rows each local expert ran in the last forward (all ranks' tokens): this rank's expert batch sizes."""
        return [] if self._last_counts is None else self._last_counts.tolist()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]: this rank's tokens (T may be 0) -> the layer's output for them, [T, H]."""
        ids, weights = self.shard.route(hidden)
        out = self.routed(hidden, ids, weights)
        shared = self.shard.shared(hidden)
        return out if shared is None else out + shared

    def routed(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for this rank's tokens (what `SparseMoE.experts` returns)."""
        P, W, H = self.comm.size, self._width, hidden.shape[-1]
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments by expert, as SparseMoE.experts
        expert = flat[order]
        owner = self._owner[expert]
        by_owner = torch.argsort(owner, stable=True)  # then by owner rank, experts ascending within one
        rows = order[by_owner]  # assignment index of each row sent
        x_send = hidden[rows // k]
        dest = self._owner[flat[rows]] * W + self._slot[flat[rows]]
        send_counts = torch.bincount(dest, minlength=P * W)
        recv_counts = torch.empty_like(send_counts)
        self.comm.all_to_all_single(recv_counts, send_counts, what="MoE count exchange")
        send_splits = send_counts.view(P, W).sum(1).tolist()
        recv_splits = recv_counts.view(P, W).sum(1).tolist()
        x_recv = hidden.new_empty(sum(recv_splits), H)
        self.comm.all_to_all_single(x_recv, x_send, recv_splits, send_splits, what="MoE dispatch")
        y_recv = self._run_local(x_recv, recv_counts.view(P, W))
        y_send = torch.empty_like(x_send)
        self.comm.all_to_all_single(y_send, y_recv, send_splits, recv_splits, what="MoE combine")
        y = torch.empty_like(y_send)
        y[by_owner] = y_send  # back to expert order
        weighted = (y * topk_weights.reshape(-1)[order, None]).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, order // k, weighted)

    def _run_local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows arrived grouped by source, each source's by local expert: sort them by expert (sources in rank
        order within one), run the shard, and put the outputs back in arrival order."""
        n_local = len(self.local_experts)
        slot_of_row = torch.arange(self._width, device=x.device).repeat(counts.shape[0]).repeat_interleave(
            counts.reshape(-1))
        local_order = torch.argsort(slot_of_row, stable=True)
        per_expert = self._last_counts = counts.sum(0)[:n_local]
        out = torch.empty_like(x)
        out[local_order] = self.shard.sorted_expert_rows(x[local_order], per_expert)
        return out
