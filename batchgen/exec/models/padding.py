"""The flat token batch as a padded [sequences x queries] batch, and the context mask, for every attention.

Both attentions (GQA over K/V pages, MLA over latent pages) attend a padded batch with one SDPA call; this is
the shared bookkeeping: where each new token sits in the padded batch, and which context slots it may see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.exec.metadata import AttentionMetadata


@dataclass
class PaddedQueries:
    q: torch.Tensor      # [B, Q, ...]: sequence b's new tokens in rows 0..len-1, zeros after
    seq: torch.Tensor    # [T]: the sequence of each flat token
    row: torch.Tensor    # [T]: its row in the padded batch
    mask: torch.Tensor   # [B, Q, L]: causal, within the context, within the sliding window if any
    valid: torch.Tensor  # [B, L]: context slots that hold KV

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> [T, ...] in the flat order."""
        return out[self.seq, self.row]


def pad_queries(q: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None = None) -> PaddedQueries:
    T = q.shape[0]
    B, max_pages = meta.block_table.shape
    L = max_pages * meta.page_size  # pages in order: gathered slot j holds absolute position j
    qlens = meta.query_lens()
    Q = int(qlens.max())  # the one host sync of the call: the padded query length
    seq = torch.repeat_interleave(torch.arange(B, device=q.device), qlens, output_size=T)
    row = torch.arange(T, device=q.device) - meta.query_starts[seq]
    q_pad = q.new_zeros(B, Q, *q.shape[1:])
    q_pad[seq, row] = q
    # Padding rows get position 0 so that no row is fully masked (SDPA would return NaN); they are discarded.
    q_pos = torch.zeros(B, Q, dtype=torch.long, device=q.device)
    q_pos[seq, row] = meta.positions
    k_pos = torch.arange(L, device=q.device)
    valid = k_pos[None, :] < meta.context_lens[:, None]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return PaddedQueries(q_pad, seq, row, mask, valid)


def gather_context(pool: torch.Tensor, meta: AttentionMetadata, valid: torch.Tensor, dtype: torch.dtype
                   ) -> torch.Tensor:
    """Each sequence's context from its pages: [B, L, ...], one index_select of whole pages (a copy, never
    the pool; 4x faster on CPU than advanced indexing with the 2-D block table).

    Slots past a context (the tail of its last page, and the pages that pad its block-table row, read from page
    0) are not zeroed: the mask gives them weight exactly 0, and 0 * v = 0 for any finite v, so the result is
    the same as with zeros. This rests on the contract that pools hold only finite values (every pool starts
    zeroed and only ever receives K/V: `AttentionMetadata`); zeroing them cost as much as the gather itself."""
    B, W = meta.block_table.shape
    ctx = pool.index_select(0, meta.block_table.clamp(min=0).reshape(-1))
    return ctx.view(B, W * pool.shape[1], *pool.shape[2:]).to(dtype)
