"""One MoE layer's all-to-all overlapped across attention micro-batches: a policy's `comm_overlap`, performed as
the simulator prices it (`plan.decode.overlapped_all_to_all`).

Each micro-batch's rows are dispatched as soon as its attention is done (`send`), while the next micro-batch's
attention runs; the local experts run once on every micro-batch's rows (`run`: the expert batch stays the whole
step's, module batching); each micro-batch's outputs go back in a combine of its own, which the next layer waits
for only when that micro-batch's attention comes (`take`).

Every rank of the group sends the same number of micro-batches (`ExpertParallelMoE.agree`; a rank with fewer
sends empty ones). An expert gets its rows in the synchronous exchange's order (by source rank, each source's in
its own row order: micro-batch after micro-batch), so its GEMMs see the same matrix, and every token adds its k
contributions in the same order. The router and the shared experts run on one micro-batch's rows per call
instead of a rank's whole batch: the same rows, in smaller GEMMs (tests/distributed/test_ep_overlap.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Sent:
    """One micro-batch's dispatch: what its combine needs to put the rows back in place."""

    order: torch.Tensor       # the (token, expert) assignments by expert (stable)
    perm: torch.Tensor        # ... and by destination rank and slot: the rows as sent
    weights: torch.Tensor     # the routing weights [T, k], fp32
    tokens: int
    dtype: torch.dtype
    send_c: torch.Tensor      # [ranks, slots] rows sent to each rank's slots
    recv_c: torch.Tensor      # [ranks, slots] rows arrived from each rank for this rank's slots
    x_send: torch.Tensor
    x_recv: torch.Tensor
    pending: object           # the dispatch in flight
    shared: torch.Tensor | None
    y_send: torch.Tensor | None = None
    y_recv: torch.Tensor | None = None
    combine: object = None    # the combine in flight
    taken: bool = False


class OverlappedExchange:
    """One layer's exchange over `micro_batches` micro-batches of an `ExpertParallelMoE` (`ep.overlapped`)."""

    def __init__(self, ep, micro_batches: int):
        self.ep, self.micro_batches = ep, micro_batches
        self.sent: list[_Sent] = []

    def send(self, hidden: torch.Tensor) -> None:
        """Route the next micro-batch's rows (post-attention-normed [T, H], T may be 0) and dispatch them."""
        if len(self.sent) >= self.micro_batches:
            raise RuntimeError(f"micro-batch {len(self.sent)} sent, but the group agreed on {self.micro_batches}")
        ep, comm = self.ep, self.ep.comm
        P, W = comm.size, ep.width
        ids, weights = ep.shard.route(hidden)
        order, _, dest, send_counts = ep.destinations(ids)
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all_single(recv_counts, send_counts, what="MoE count exchange")
        perm = torch.argsort(dest, stable=True)
        x_send = hidden[order[perm] // ids.shape[1]]
        send_c, recv_c = send_counts.view(P, W), recv_counts.view(P, W)
        x_recv = hidden.new_empty(int(recv_c.sum()), hidden.shape[-1])
        pending = comm.start_all_to_all_single(x_recv, x_send, recv_c.sum(1).tolist(), send_c.sum(1).tolist(),
                                               what="MoE dispatch")
        self.sent.append(_Sent(order, perm, weights, hidden.shape[0], hidden.dtype, send_c, recv_c, x_send, x_recv,
                               pending, ep.shard.shared(hidden)))

    def run(self) -> None:
        """Once every micro-batch is sent: the local experts on all arrived rows, then each micro-batch's
        combine issued."""
        ep, comm = self.ep, self.ep.comm
        if len(self.sent) != self.micro_batches:
            raise RuntimeError(f"{len(self.sent)} micro-batches sent of the {self.micro_batches} agreed")
        if not self.sent:  # no rank had a row for this layer
            return
        P, W = comm.size, ep.width
        for s in self.sent:
            comm.wait(s.pending)
        # rows by source, then micro-batch (each source's own row order), each block by slot as it arrived
        blocks, slots, where = [], [], []
        starts = [torch.cumsum(s.recv_c.sum(1), 0) - s.recv_c.sum(1) for s in self.sent]
        for src in range(P):
            for j, s in enumerate(self.sent):
                n = int(s.recv_c[src].sum())
                lo = int(starts[j][src])
                blocks.append(s.x_recv[lo:lo + n])
                slots.append(torch.arange(W, device=s.recv_c.device).repeat_interleave(s.recv_c[src]))
                where.append((j, lo, n))
        x = torch.cat(blocks)
        per_expert = sum(s.recv_c.sum(0) for s in self.sent)[:len(ep.local_experts)]
        ep.last_counts = per_expert
        out = torch.empty_like(x)
        if x.shape[0]:
            local_order = torch.argsort(torch.cat(slots), stable=True)
            out[local_order] = ep.shard.sorted_expert_rows(x[local_order], per_expert)
        for s in self.sent:
            s.y_recv = torch.empty_like(s.x_recv)
        pos = 0
        for j, lo, n in where:
            self.sent[j].y_recv[lo:lo + n] = out[pos:pos + n]
            pos += n
        for s in self.sent:
            s.y_send = torch.empty_like(s.x_send)
            s.combine = comm.start_all_to_all_single(s.y_send, s.y_recv, s.send_c.sum(1).tolist(),
                                                     s.recv_c.sum(1).tolist(), what="MoE combine")

    def take(self, j: int) -> torch.Tensor:
        """Micro-batch j's layer output (routed experts' weighted sum, plus the shared experts), once its combine
        is in: what `ExpertParallelMoE.forward` returns for those rows."""
        s = self.sent[j]
        self.ep.comm.wait(s.combine)
        s.taken = True
        out = self.ep.combined(s.y_send, s.perm, s.order, s.weights, s.tokens, s.dtype)
        return out if s.shared is None else out + s.shared

    def finish(self) -> None:
        """Wait for the combines nobody takes (the empty micro-batches a rank sent to match the group)."""
        for s in self.sent:
            if not s.taken:
                self.ep.comm.wait(s.combine)
                s.taken = True
