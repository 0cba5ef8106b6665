"""The contract between the paged KV cache (which builds it) and attention (which reads it).

One forward pass runs a flat batch of new tokens from several sequences: a whole prompt (prefill), one token
(decode), or the prompt plus generated tokens of a sequence being recomputed. Tokens of one sequence are
contiguous and in order. Each layer's KV pool is a pair of tensors [num_pages, page_size, kv_heads, head_dim];
a sequence's KV lives in the pages its row of `block_table` names, in order. Pools hold only finite values
(they start zeroed and receive only K/V): attention reads the slots past a context (the tail of the last page,
padding pages) and relies on its mask, not on zeros, to ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor     # [T] int64: absolute position of each new token in its sequence
    query_starts: torch.Tensor  # [B+1] int64: sequence b's new tokens are rows query_starts[b]:query_starts[b+1]
    context_lens: torch.Tensor  # [B] int64: tokens in the sequence's KV once this pass has written its new ones
    block_table: torch.Tensor   # [B, max_pages] int64: page ids of each sequence, padded with -1
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset where each new token's K/V is written
    page_size: int
    # a cascaded call (batchgen.core.cascade): every row is one decode query whose context begins with these
    # shared pages; attention reads them once for the call and each row's own pages after them (`own`)
    prefix_pages: torch.Tensor | None = None
    prefix_tokens: int = 0
    # rows whose K/V is also written to more slots: a shared prefix's tail, copied below a page into the pages of
    # the prefix and of its takers in the forward that writes it (batchgen.exec.kv_prefixes)
    fanout_rows: torch.Tensor | None = None
    fanout_slots: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.context_lens.numel()

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    def query_lens(self) -> torch.Tensor:
        return self.query_starts[1:] - self.query_starts[:-1]

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        return AttentionMetadata(self.positions.to(device), self.query_starts.to(device),
                                 self.context_lens.to(device), self.block_table.to(device),
                                 self.slot_mapping.to(device), self.page_size,
                                 None if self.prefix_pages is None else self.prefix_pages.to(device),
                                 self.prefix_tokens,
                                 None if self.fanout_rows is None else self.fanout_rows.to(device),
                                 None if self.fanout_slots is None else self.fanout_slots.to(device))

    def write(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """The new tokens' K/V (`values`, a row per token) into their slots of a flat pool, and the rows fanned out
        to their other slots."""
        flat.index_copy_(0, self.slot_mapping, values)
        if self.fanout_slots is not None:
            flat.index_copy_(0, self.fanout_slots, values[self.fanout_rows])

    def own(self) -> "AttentionMetadata":
        """A cascaded call's rows over their own pages only: positions and contexts counted from the prefix's end
        (attention only masks with them; the new K/V was written at the real slots)."""
        n, p = self.prefix_tokens // self.page_size, self.prefix_tokens
        return AttentionMetadata(self.positions - p, self.query_starts, self.context_lens - p,
                                 self.block_table[:, n:], self.slot_mapping, self.page_size)

    def check(self) -> None:
        """Shapes and ranges a wrong cache or runner would break; cheap enough to run in tests."""
        q = self.query_lens()
        assert self.query_starts[0] == 0 and int(self.query_starts[-1]) == self.num_tokens
        assert torch.all(q >= 1) and torch.all(q <= self.context_lens)
        assert self.slot_mapping.numel() == self.num_tokens
        if self.num_sequences:
            pages_needed = (self.context_lens + self.page_size - 1) // self.page_size
            assert int(pages_needed.max()) <= self.block_table.shape[1]
