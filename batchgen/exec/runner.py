"""Module-based batching on real tensors: attention per rank in micro-batches, experts on the combined batch.

Every layer runs attention for each rank's sequences (each rank has its own paged KV cache, and its sequences
are split into micro-batches of `micro_batch`), then concatenates all their hidden states and runs the MoE
(or dense FFN) once on that combined batch: the expert batch is the sum of every micro-batch of every rank.
All ranks of one instance live on one device here (one process); a multi-process runner will put each rank
on its own device and exchange the combined batch with all-to-all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models.decoder import MoEDecoder


@dataclass
class RankBatch:
    """What one rank runs in a forward pass: new tokens of some sequences, contiguous per sequence."""

    cache: PagedKVCache
    seq_ids: list[int]
    token_ids: list[int]         # flat, sequence after sequence
    new_counts: list[int]        # new tokens per sequence
    start_positions: list[int]   # position of each sequence's first new token (= its KV length so far)


@dataclass
class ForwardStats:
    rank_attention_s: list[float] = field(default_factory=list)
    ffn_s: float = 0.0
    gate_tokens: int = 0


class InstanceRunner:
    def __init__(self, model: MoEDecoder, micro_batch: int = 0):
        self.model = model
        self.micro_batch = micro_batch
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def forward(self, ranks: list[RankBatch], micro_batch: int | None = None) -> tuple[list[torch.Tensor], ForwardStats]:
        """Logits of each sequence's last new token, per rank ([num_seqs, vocab] each), and timings."""
        mb = self.micro_batch if micro_batch is None else micro_batch
        stats = ForwardStats(rank_attention_s=[0.0] * len(ranks))
        pieces = []   # (rank index, row slice in the flat batch, metadata, cache)
        tokens, last_rows, offset = [], [], 0
        for r, batch in enumerate(ranks):
            starts = [0]
            for n in batch.new_counts:
                starts.append(starts[-1] + n)
            last = [0] * len(batch.seq_ids)
            # Prompts and single decode tokens go to separate micro-batches: attention pads every query to
            # the longest one of its call, so one prompt would otherwise inflate a whole decode batch.
            prompts = [i for i, n in enumerate(batch.new_counts) if n > 1]
            decodes = [i for i, n in enumerate(batch.new_counts) if n == 1]
            for group in (prompts, decodes):
                for lo, hi in _chunks(len(group), mb):
                    idx = group[lo:hi]
                    meta = batch.cache.prepare([batch.seq_ids[i] for i in idx], [batch.new_counts[i] for i in idx],
                                               [batch.start_positions[i] for i in idx]).to(self.device)
                    n = sum(batch.new_counts[i] for i in idx)
                    pieces.append((r, slice(offset, offset + n), meta, batch.cache))
                    for i in idx:
                        tokens.extend(batch.token_ids[starts[i]:starts[i + 1]])
                        offset += batch.new_counts[i]
                        last[i] = offset - 1
            last_rows.append(last)
        if not pieces:
            return [torch.empty(0) for _ in ranks], stats
        hidden = self.model.embed(torch.tensor(tokens, dtype=torch.long, device=self.device))
        for layer in range(self.model.num_layers):
            for r, rows, meta, cache in pieces:
                start = _clock(self.device)
                hidden[rows] = self.model.attention_block(layer, hidden[rows], meta, cache.layer(layer))
                stats.rank_attention_s[r] += _clock(self.device) - start
            start = _clock(self.device)
            hidden = self.model.ffn_block(layer, hidden)  # COMBINE: one expert batch for every rank
            stats.ffn_s += _clock(self.device) - start
            stats.gate_tokens = hidden.shape[0]  # tokens at the gate of each MoE layer
        out = []
        for rows in last_rows:
            out.append(self.model.final_logits(hidden[rows]).float() if rows else torch.empty(0))
        return out, stats


def _chunks(n: int, size: int):
    size = size if size > 0 else max(n, 1)
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
