"""The roofline's collectives, copies and host-side attention: what moves between GPUs, nodes and host memory,
and the attention the host's CPUs compute beside host-resident KV. Mixed into `Roofline`, whose constants (the
GPU's and host's achieved bandwidths, the per-module efficiencies) they read; see there."""

from __future__ import annotations

import numpy as np

from batchgen.latency.arrays import _arr, _out


class Transfers:
    # ---- communication ----------------------------------------------------------------------------------

    def all_to_all(self, total_tokens):
        """Dispatch + combine of one MoE layer across the instance's ep_ranks; 0 if ep_ranks == 1 or dense: each
        rank sends (total_tokens / R) * top_k hidden states each way (`a2a_phase`)."""
        t = _arr(total_tokens, "total_tokens")
        r, m = self.ep_ranks, self.model
        if r == 1 or not m.is_moe:
            return _out(np.zeros_like(t))
        phase = self.a2a_phase((t / r) * m.top_k * self._act_row, r)
        return _out(np.where(t > 0, 2.0 * phase, 0.0))

    def a2a_phase(self, nbytes, ranks: int):
        """One phase of an expert-parallel all-to-all over `ranks` GPUs in which each rank sends `nbytes` (every
        copy, its own included) spread evenly over them, as expert-parallel kernels (DeepEP's) move them: every
        peer at once, the peers on the same node over NVLink (the all_to_all module's link fraction, and its
        per-peer latency for each of them, as fitted on one node), the rest over the network in parallel (the
        network module's link fraction and latency, as fitted across nodes); the collective's fixed latency plus
        the slower side. A per-peer latency over every remote peer would make a 64-way phase cost 0.3 ms before
        a byte moves; DeepEP's published latencies grow from 77 to 194 us between 8 and 256 ranks, with the bytes
        (batchgen.calibrate.a2a_check)."""
        n = _arr(nbytes, "nbytes")
        local_peers = min(ranks, self.gpus_per_node) - 1
        remote_peers = ranks - 1 - local_peers
        e, net = self._eff["all_to_all"], self._eff["network"]
        intra_s = (e.collective_per_peer_s * local_peers
                   + n * local_peers / ranks / (self.gpu.nvlink_bw * e.link)) if local_peers else 0.0
        inter_s = (net.collective_s + n * remote_peers / ranks / (self.gpu.network_bw * net.link)
                   if remote_peers else 0.0)
        return _out(e.collective_s + np.maximum(intra_s, inter_s))

    def all_reduce(self, nbytes, peers):
        """Sum `nbytes` across `peers` GPUs of one node (the join of a PARTITIONed sequence's head shards after
        their o_proj): a ring over NVLink, 2 (p - 1) / p of the bytes each way, plus the collective's latency;
        0 for one peer or no bytes."""
        n, p = _arr(nbytes, "nbytes"), np.asarray(peers, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            link = 2.0 * (p - 1) / p * n / (self.gpu.nvlink_bw * self._eff["all_reduce"].link)
        e = self._eff["all_reduce"]
        t = e.collective_s + e.collective_per_peer_s * (p - 1) + link
        return _out(np.where((n > 0) & (p > 1), t, 0.0))

    def _copy(self, nbytes, bandwidth, fixed_s, copies=1):
        """`copies` launches of fixed_s plus nbytes at `bandwidth` (already achieved, link efficiency in)."""
        n = _arr(nbytes, "nbytes")
        with np.errstate(divide="ignore", invalid="ignore"):
            t = fixed_s * np.maximum(copies, 1) + n / bandwidth
        return _out(np.where(n > 0, t, 0.0))

    def h2d(self, nbytes, copies=1):
        """Host-to-device copy over PCIe (a launch per copy plus bytes at `host_link_bw`: the achieved PCIe
        bandwidth, or this GPU's share of the node's DRAM bandwidth when that is lower)."""
        return self._copy(nbytes, self.host_link_bw, self._eff["copy"].kernel_s, copies)

    def d2h(self, nbytes, copies=1):
        """Device-to-host copy over PCIe (same link bandwidth as h2d, the other direction)."""
        return self._copy(nbytes, self.host_link_bw, self._eff["copy"].kernel_s, copies)

    def local_copy(self, nbytes):
        """A copy within one GPU's memory (a shared prefix's tail into a taker's page): a launch, and the bytes read
        and written at the achieved HBM bandwidth."""
        return self._copy(nbytes, self.mem_bw / 2.0, self._eff["copy"].kernel_s)

    def network(self, nbytes, cross_node):
        """Point-to-point transfer: NVLink within a node, the network across nodes (`cross_node` broadcasts)."""
        bw = np.where(np.asarray(cross_node, dtype=bool), self.gpu.network_bw, self.gpu.nvlink_bw)
        e = self._eff["network"]
        return self._copy(nbytes, bw * e.link, e.collective_s)

    # ---- host-resident KV and CPU attention (per layer, per rank) ---------------------------------------

    def kv_restore(self, context_sum, micro_batches=1):
        """Copy one layer's KV of `context_sum` context tokens from host to a device staging buffer, in
        `micro_batches` copies (one per attention micro-batch), over this GPU's host link."""
        ctx = _arr(context_sum, "context_sum")
        return self.h2d(ctx * self.model.kv_bytes_per_token_per_layer, micro_batches)

    def kv_append(self, tokens, micro_batches=1):
        """Copy one layer's new KV of `tokens` decode queries from the device back to host memory."""
        t = _arr(tokens, "tokens")
        return self.d2h(t * self.model.kv_bytes_per_token_per_layer, micro_batches)

    def _require_cpu_attention(self) -> None:
        if self.model.attention == "mla":
            raise ValueError(f"CPU attention is not offered for {self.model.name}: its MLA latent KV must be "
                             "up-projected per head (or absorbed into the queries) before attention, which is "
                             "GPU work; use GPU attention (policy.attention=gpu)")

    def cpu_attention(self, tokens, context_sum, micro_batches=1):
        """Decode attention (scores and weighted sum only; the projections stay on the GPU) of `tokens`
        queries over `context_sum` context tokens, on this GPU's share of its node's CPUs, beside host KV.

        Roofline over the host: max(score FLOPs / CPU FLOP/s, KV bytes read + new KV written / DRAM bytes/s),
        both the node's figures divided among its GPUs, plus host_kernel_s per call. GQA/MHA only.
        """
        self._require_cpu_attention()
        t, ctx, mb = _arr(tokens, "tokens"), _arr(context_sum, "context_sum"), _arr(micro_batches, "micro_batches")
        m = self.model
        flops = m.attention_score_flops_decode * ctx
        bytes_ = (ctx + t) * m.kv_bytes_per_token_per_layer + 2 * t * m.num_heads * m.head_dim * m.act_bytes
        time = (np.maximum(flops / self.host_flops, bytes_ / self.host_mem_bw)
                + np.maximum(mb, 1) * self._eff["cpu_attention"].host_kernel_s)
        return _out(np.where(t > 0, time, 0.0))

    def cpu_attention_ship(self, tokens, micro_batches=1):
        """(to host, back) seconds of the PCIe copies around CPU attention for `tokens` queries: their
        queries and new KV (the append) go down, the attention outputs come back."""
        self._require_cpu_attention()
        t = _arr(tokens, "tokens")
        m = self.model
        q = t * m.num_heads * m.head_dim * m.act_bytes
        return (self.d2h(q + t * m.kv_bytes_per_token_per_layer, micro_batches), self.h2d(q, micro_batches))

    def cpu_attention_ship_bytes(self, tokens):
        """Bytes the copies of `cpu_attention_ship` move, both directions together."""
        t = _arr(tokens, "tokens")
        m = self.model
        return _out(t * (2 * m.num_heads * m.head_dim * m.act_bytes + m.kv_bytes_per_token_per_layer))
