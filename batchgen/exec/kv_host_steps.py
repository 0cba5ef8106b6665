"""Host-resident decode on a paged KV cache.

Host-resident decode runs a host-only sequence without giving it device pages: `prepare_host` reserves host room
for the new tokens and describes the step in host-pool coordinates (block tables of host pages); per layer, a
runner either restores the pages into a device staging buffer (`batchgen.exec.staging`), attends there and appends
the new tokens' KV back (`write_host_tokens`), or attends on the host pool itself on the CPU (`host_layer`);
`host_advance` then counts the new tokens. In between, the sequence cannot be moved.
"""

from __future__ import annotations

import torch

from batchgen.exec.metadata import AttentionMetadata


class HostResidentSteps:
    """The host-resident step methods of `PagedKVCache` (which owns the pools and the sequences these use)."""

    def prepare_host(self, seq_ids: list[int], new_tokens: list[int],
                     start_positions: list[int]) -> AttentionMetadata:
        """A step of host-resident sequences (held here on host only), in host-pool coordinates, on CPU.

        Host pages for the new tokens are reserved now (the pool may grow: fetch `host_layer` views after
        this); block_table names host pages and slot_mapping host slots. The sequences hold no device pages.
        The new tokens count once `host_advance` is called, after every layer has written its KV back."""
        if not len(seq_ids) == len(new_tokens) == len(start_positions):
            raise ValueError(f"prepare_host got {len(seq_ids)} sequence ids, {len(new_tokens)} token counts and "
                             f"{len(start_positions)} start positions")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"prepare_host got a sequence twice: {seq_ids}")
        seqs = [self._get(sid) for sid in seq_ids]
        for sid, s, n, p in zip(seq_ids, seqs, new_tokens, start_positions):
            if s.on_device:
                raise ValueError(f"sequence {sid} holds device pages: yield it to host before running it "
                                 "host-resident")
            if s.pending:
                raise ValueError(f"sequence {sid} is already in a host-resident step")
            if n < 1:
                raise ValueError(f"sequence {sid}: a step must add at least one token, got {n}")
            if p != s.synced:
                raise ValueError(f"sequence {sid}: new tokens start at position {p} but its host KV holds "
                                 f"{s.synced} tokens (new tokens must follow the existing KV)")
        self._host_cover({s: s.synced + int(n) for s, n in zip(seqs, new_tokens)})
        for s, n in zip(seqs, new_tokens):
            s.pending = int(n)
        return self._metadata([s.host_pages for s in seqs], new_tokens, start_positions)

    def host_advance(self, seq_ids) -> None:
        """The host-resident step is done: its new tokens' KV is in the host copy."""
        for sid in seq_ids:
            s = self._get(sid)
            if not s.pending:
                raise ValueError(f"sequence {sid} is not in a host-resident step")
            s.synced += s.pending
            s.pending = 0

    def gather_host_pages(self, layer: int, pages: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One layer's host pages into `out` [planes, len(pages), page_size, kv_heads, head_dim]: one gather."""
        return torch.index_select(self._host[layer], 1, pages, out=out)

    def write_host_tokens(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [num_layers, planes, T, kv_heads, head_dim] into host slots [T]: one index_copy (the
        append of host-resident steps' new tokens)."""
        self._host_flat().index_copy_(2, slots, values)
