"""Roofline latency model of one MoE (or dense) transformer on one GPU type; see `batchgen.latency`."""
from __future__ import annotations

import math

import numpy as np

from batchgen.latency import formulas
from batchgen.latency.efficiency import Efficiency
from batchgen.latency.efficiency import MODULES as MODULE_NAMES
from batchgen.latency.arrays import _FLOAT, _arr, _fits, _out, _uniform, maximum_for, positive
from batchgen.latency.gemm import gemm_seconds
from batchgen.latency.tp_attention import shard_spec
from batchgen.latency.transfers import Transfers
from batchgen.specs.host import DEFAULT_HOST

_LOOKUP_ABOVE = 8     # grids larger than this read the GEMM time per token count from a cached curve
_GEMM_LOOKUP_MAX = 1 << 16  # ... and so do smaller ones up to this many tokens (a serving engine's forwards)
_EXPERT_CHUNK = 4096  # distinct global batch sizes evaluated at once by `experts` (bounds a (chunk, E) array)
_LARGE_EXPERT_MEMO = 1 << 16  # prefill batch sizes whose expert times `experts` keeps
_CELLS_KEPT = 1 << 16  # one-cell GEMM times `_gemm_cell` keeps
_EXPERT_LOOKUP_MAX = 1 << 16  # gate batches up to this read a cached curve (decode); larger ones (prefill) not


class Roofline(Transfers):
    """Seconds per module for `model` on `gpu`, vectorised: every argument broadcasts as numpy arrays.

    Unless a method says otherwise, a cost is for ONE layer on ONE rank. `ep_ranks` GPUs form one
    expert-parallel instance (data-parallel attention, experts placed round-robin), `gpus_per_node` of them
    per node. `routing_skew` s >= 0 makes expert e's share of routed tokens proportional to (e+1)^-s
    (0 = uniform). `use_fp8` runs weight GEMMs at the FP8 peak when the GPU has one and the weights are 1 byte.
    `host` is the node's CPUs and DRAM (default: batchgen.specs.DEFAULT_HOST), shared by its gpus_per_node GPUs.
    Each module runs at its own factors (`Efficiency.for_module`); weight GEMMs follow tiles and waves where
    the GPU's SM count is known (`batchgen.latency.gemm`).
    """

    # one cell's amounts priced on Python floats cost less than a one-element grid (batchgen.pricing.price)
    prices_floats = True

    def __init__(self, model, gpu, eff: Efficiency = Efficiency(), *, ep_ranks: int = 1,
                 gpus_per_node: int = 8, routing_skew: float = 0.0, use_fp8: bool = False, host=None) -> None:
        if not (isinstance(ep_ranks, (int, np.integer)) and ep_ranks >= 1):
            raise ValueError(f"ep_ranks must be an integer >= 1, got {ep_ranks!r}")
        if not (isinstance(gpus_per_node, (int, np.integer)) and gpus_per_node >= 1):
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
        if not (math.isfinite(routing_skew) and routing_skew >= 0):
            raise ValueError(f"routing_skew must be finite and >= 0, got {routing_skew!r}")
        if ep_ranks > gpus_per_node and model.is_moe and not gpu.network_bw > 0:
            raise ValueError(f"ep_ranks={ep_ranks} spans nodes of {gpus_per_node} GPUs, but {gpu.name} has no "
                             "network (network_bw == 0)")
        if host is None:
            host = DEFAULT_HOST
        self.model, self.gpu, self.eff, self.host = model, gpu, eff, host
        self.ep_ranks, self.gpus_per_node = int(ep_ranks), int(gpus_per_node)
        self.routing_skew, self.use_fp8 = float(routing_skew), bool(use_fp8)
        fp8 = use_fp8 and gpu.flops_fp8 > 0 and model.weight_bytes == 1
        self._gemm_peak = gpu.flops_fp8 if fp8 else gpu.flops_bf16  # weight GEMMs; attention scores run bf16
        self.gemm_flops = self._gemm_peak * eff.compute  # achieved by large weight GEMMs (top-level factors)
        self.mem_bw = gpu.hbm_bw * eff.memory  # achieved HBM bytes/s
        self._act_row = model.hidden_size * model.act_bytes  # bytes of one token's hidden state
        self._eff = {name: eff.for_module(name) for name in MODULE_NAMES}
        # Host side, per GPU: the node's DRAM bandwidth and CPU FLOP/s are shared by its GPUs, and every PCIe
        # copy reads or writes that DRAM, so a GPU's host link gets min(PCIe, DRAM / GPUs per node).
        copy = self._eff["copy"]
        cpu = self._eff["cpu_attention"]
        self.host_mem_bw = host.dram_bw * cpu.host_memory / self.gpus_per_node  # achieved, this GPU's share
        self.host_flops = host.flops * cpu.host_compute / self.gpus_per_node    # achieved, this GPU's share
        self.host_link_bw = min(gpu.pcie_bw * copy.link, host.dram_bw * copy.host_memory / self.gpus_per_node)
        self._rank_p = self._expert_shares_by_rank() if model.is_moe else None
        self._ranks_alike = model.is_moe and bool((self._rank_p == self._rank_p[:1]).all())
        self._attention_gemms = tuple(self._attention_shapes_of_model())
        self._layers = (model.num_dense_layers, model.num_moe_layers)
        # (KV bytes per token, activation row bytes, score FLOPs per context token, achieved FLOP/s, bytes/s,
        # seconds per launch) of decode and of prefill attention: `formulas`' constants, read every forward
        kvb = model.kv_bytes_per_token_per_layer
        self._attention_constants = tuple(
            (kvb, self._act_row, flops, *self.stream_rates(module))
            for module, flops in (("attention_decode", model.attention_score_flops_decode),
                                  ("attention_prefill", model.attention_score_flops_prefill)))
        self._curves: dict = {}  # (module, GEMM shapes, launches) -> seconds by token count (_gemm_curve)
        self._cells: dict = {}   # (module, launches, tokens) -> seconds of one cell (_gemm_cell)
        self._large_experts: dict[float, tuple[float, float]] = {}  # gate batch -> (worst, mean): experts
        self._head_shards: dict[int, Roofline] = {}  # degree -> head_shard(degree)
        self._all_experts: Roofline | None = None  # this GPU holding every expert (local_experts), built once

    @property
    def attention_padding(self) -> float:
        return self.eff.attention_padding

    def head_shard(self, degree: int) -> "Roofline":
        """The same GPU computing 1/degree of every head (`tp_attention.shard_spec`): what one rank of a
        PARTITIONed sequence's group projects and attends with. Built once per degree."""
        shard = self._head_shards.get(degree)
        if shard is None:
            shard = self._head_shards[degree] = Roofline(
                shard_spec(self.model, degree), self.gpu, self.eff, ep_ranks=self.ep_ranks,
                gpus_per_node=self.gpus_per_node, routing_skew=self.routing_skew, use_fp8=self.use_fp8,
                host=self.host)
        return shard

    def key(self) -> tuple:
        """Everything the prices depend on (plan caches key on it)."""
        return (type(self).__name__, self.model, self.gpu, self.eff, self.host, self.ep_ranks, self.gpus_per_node,
                self.routing_skew, self.use_fp8)

    # ---- the roofline ----------------------------------------------------------------------------------

    def _weight_gemms(self, module: str, tokens, shapes, calls=1):
        """Seconds of a module's weight GEMMs over `tokens` rows in `calls` launches each (`shapes`: (k, n)
        per GEMM), at the module's factors."""
        if type(tokens) is float and type(calls) in (float, int):
            out = self._cells.get((module, calls, tokens))  # `_gemm_cell`'s table first (1 and 1.0: one key)
            return out if out is not None else self._gemm_cell(module, tokens, shapes, float(calls))
        launches = _uniform(calls, tokens)
        if launches is not None and all(type(k) is int and type(n) is int for k, n in shapes):
            fast = self._gemm_lookup(module, tokens, shapes, launches)
            if fast is not None:
                return fast
        t, c = np.broadcast_arrays(np.asarray(tokens, float), np.asarray(calls, float))
        scalar_shapes = all(np.ndim(k) == 0 and np.ndim(n) == 0 for k, n in shapes)
        if (scalar_shapes and (t.size > _LOOKUP_ABOVE or t.max(initial=0.0) <= _GEMM_LOOKUP_MAX)
                and np.all(t == np.floor(t)) and np.all(c == np.floor(c))):
            # whole token counts (a run's ranks x iterations grid, or one forward's few ranks): read each launch
            # count's curve, computed once per model over 0..max tokens, instead of pricing the tiles again
            out = np.empty(t.shape)
            for launches in np.unique(c):
                cells = c == launches
                curve = self._gemm_curve(module, tuple(shapes), float(launches), int(t[cells].max()))
                out[cells] = curve[t[cells].astype(np.int64)]
            return out
        return self._gemms_direct(module, t, shapes, c)

    def _gemm_lookup(self, module: str, tokens, shapes, launches: float):
        """The lookup branch of `_weight_gemms` for one launch count and whole token counts, in a few array
        operations (the simulator prices small grids thousands of times a second); None where that branch
        does not apply (the caller then takes the general path, which decides the same way)."""
        t = tokens if type(tokens) is np.ndarray and tokens.dtype == _FLOAT else np.asarray(tokens, float)
        if not t.size or launches != math.floor(launches):
            return None
        index = t.astype(np.int64)
        top = int(index.max())
        if not (t.size > _LOOKUP_ABOVE or top <= _GEMM_LOOKUP_MAX) or not (index == t).all():
            return None
        return self._gemm_curve(module, tuple(shapes), launches, top)[index]

    def _gemm_cell(self, module: str, tokens: float, shapes, launches: float) -> float:
        """`_weight_gemms` of one cell: the curve's value, as the grid reads it, kept per (module, launches,
        tokens) (a serving engine's forwards repeat their batch sizes)."""
        key = (module, launches, tokens)
        out = self._cells.get(key)
        if out is None:
            if (tokens <= _GEMM_LOOKUP_MAX and tokens == math.floor(tokens) and launches == math.floor(launches)
                    and all(type(k) is int and type(n) is int for k, n in shapes)):
                out = float(self._gemm_curve(module, tuple(shapes), launches, int(tokens))[int(tokens)])
            else:
                out = float(self._gemms_direct(module, np.asarray(tokens), shapes, np.asarray(launches)))
            if len(self._cells) >= _CELLS_KEPT:
                self._cells.clear()
            self._cells[key] = out
        return out

    def _gemms_direct(self, module: str, t, shapes, c):
        e = self._eff[module]
        total = 0.0
        for k, n in shapes:
            total = total + gemm_seconds(t, k, n, peak_flops=self._gemm_peak, mem_bw=self.gpu.hbm_bw,
                                         weight_bytes=self.model.weight_bytes, act_bytes=self.model.act_bytes,
                                         compute=e.compute, memory=e.memory, kernel_s=e.kernel_s,
                                         pad_rows=e.gemm_pad_rows, sm_count=self.gpu.sm_count, calls=c)
        return total

    def _gemm_curve(self, module: str, shapes: tuple, launches: float, upto: int) -> np.ndarray:
        """Seconds of the module's GEMMs for 0..n tokens in `launches` launches, n >= upto (grown by doubling)."""
        key = (module, shapes, launches)
        curve = self._curves.get(key)
        if curve is None or curve.size <= upto:
            size = max(upto + 1, 2 * (curve.size if curve is not None else 512))
            curve = self._curves[key] = np.asarray(
                self._gemms_direct(module, np.arange(size, dtype=float), shapes, launches), float)
        return curve

    def stream_rates(self, module: str) -> tuple[float, float, float]:
        """(achieved FLOP/s, achieved bytes/s, seconds per launch) of a kernel without weights
        (`formulas.streaming`): attention scores over the KV."""
        e = self._eff[module]
        return self.gpu.flops_bf16 * e.compute, self.gpu.hbm_bw * e.memory, e.kernel_s

    # ---- attention --------------------------------------------------------------------------------------

    def _padded(self, exact, padded, max_context):
        """Work of an attention kernel: `exact` for paged / varlen kernels, `padded` (queries x longest
        context) for the share `attention_padding` of it that a dense padded batch pays; exact when the
        longest context is unknown."""
        if max_context is None:
            return exact
        pad = self.eff.attention_padding
        return exact if pad == 0 else formulas.padded(exact, padded, pad, maximum_for(exact, padded))

    def attention_decode(self, tokens, context_sum, micro_batches=1, max_context=None):
        """Decode attention for `tokens` sequences (one query each) whose context lengths sum to `context_sum`
        (the longest is `max_context`).

        The projections are weight GEMMs, re-read by each micro-batch; the KV of every context token is read
        once, each query appends one token's KV, and the score kernel is one launch per micro-batch.
        """
        t, ctx, mb = _arr(tokens, "tokens"), _arr(context_sum, "context_sum"), _arr(micro_batches, "micro_batches")
        if max_context is not None:
            longest = _arr(max_context, "max_context")
            if self.eff.attention_padding != 0:  # else _padded returns the exact sum
                ctx = self._padded(ctx, t * longest, max_context)
        proj = self._weight_gemms("attention_decode", t, self._attention_gemms, mb)
        seconds = formulas.decode_attention(t, ctx, mb, proj, *self._attention_constants[0], maximum_for(t, ctx, mb))
        return _out(positive(t, seconds))

    def attention_prefix(self, pairs, kv_tokens, calls):
        """The prefix kernels of cascade attention (batchgen.core.cascade): `calls` calls whose queries attend
        `pairs` query-key pairs of shared prefixes, each call reading its prefix's KV once (`kv_tokens` in all)."""
        p, kv, c = _arr(pairs, "pairs"), _arr(kv_tokens, "kv_tokens"), _arr(calls, "calls")
        seconds = formulas.prefix_attention(p, kv, c, *self._attention_constants[0], maximum_for(p, kv, c))
        return _out(positive(c, seconds))

    def attention_prefill(self, tokens, context_sq_sum, micro_batches=1, max_context=None, sequences=None):
        """Prefill attention over `tokens` prompt tokens; `context_sq_sum` = sum over prompts of length^2.

        Causal masking halves the score FLOPs of exact kernels; a padded kernel pays every prompt the whole
        square of the longest (`sequences` x `max_context`^2, no causal saving); each prompt token's KV is
        written once.
        """
        if type(tokens) is float and tokens == 0.0:  # one cell with nothing prefilled (a decode's)
            return 0.0
        t, sq, mb = _arr(tokens, "tokens"), _arr(context_sq_sum, "context_sq_sum"), _arr(micro_batches, "micro_batches")
        pairs = 0.5 * sq
        if max_context is not None and sequences is not None:
            seqs, longest = _arr(sequences, "sequences"), _arr(max_context, "max_context")
            if self.eff.attention_padding != 0:  # else _padded returns the exact pairs
                pairs = self._padded(pairs, seqs * (longest * longest), max_context)
        if type(t) is float:
            if not t > 0:
                return 0.0
        elif t.ndim and not t.any() and _fits(t, sq, mb, pairs):
            return np.zeros(t.shape)  # nothing prefilled (a decode run's grid): 0 everywhere, as below
        proj = self._weight_gemms("attention_prefill", t, self._attention_gemms, mb)
        seconds = formulas.prefill_attention(t, pairs, mb, proj, *self._attention_constants[1],
                                             maximum_for(t, pairs, mb))
        return _out(positive(t, seconds))

    @property
    def _attention_shapes(self) -> tuple[tuple[int, int], ...]:
        """(k, n) of the attention's weight GEMMs (fused QKV; MLA's low-rank chain), summing to
        attention_params_per_layer; computed once (every priced step asks for them)."""
        return self._attention_gemms

    def _attention_shapes_of_model(self) -> list[tuple[int, int]]:
        m = self.model
        h, heads = m.hidden_size, m.num_heads
        if m.attention == "gqa":
            return [(h, (heads + 2 * m.num_kv_heads) * m.head_dim), (heads * m.head_dim, h)]
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ([(h, m.q_lora_rank), (m.q_lora_rank, heads * qk_head)] if m.q_lora_rank > 0
             else [(h, heads * qk_head)])
        return q + [(h, m.kv_lora_rank + m.qk_rope_head_dim),
                    (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)), (heads * m.v_head_dim, h)]

    # ---- FFN modules ------------------------------------------------------------------------------------

    def _ffn(self, module: str, tokens, inter: int):
        """A replicated SwiGLU block of intermediate size `inter` (fused gate+up, then down) on this rank's
        tokens; 0 when inter == 0."""
        t = _arr(tokens, "tokens")
        if inter <= 0:
            return 0.0 if type(t) is float else _out(np.zeros_like(t))
        h = self.model.hidden_size
        return _out(positive(t, self._weight_gemms(module, t, ((h, 2 * inter), (inter, h)))))

    def dense_ffn(self, tokens):
        """A dense layer's FFN on this rank's tokens (weights replicated on every rank)."""
        if type(tokens) is float:  # one cell: a pure function of the token count, which recurs
            out = self._cells.get(("dense_ffn", tokens))
            if out is None:
                out = self._cells[("dense_ffn", tokens)] = self._ffn("dense_ffn", tokens, self.model.intermediate_size)
            return out
        return self._ffn("dense_ffn", tokens, self.model.intermediate_size)

    def shared_experts(self, tokens):
        """All shared experts of one MoE layer on this rank's tokens (fused into one FFN); 0 if none."""
        m = self.model
        return self._ffn("shared_experts", tokens, m.num_shared_experts * m.moe_intermediate_size if m.is_moe else 0)

    def router(self, tokens):
        """The gate's linear layer and top-k on this rank's tokens; 0 for a dense model."""
        t = _arr(tokens, "tokens")
        if not self.model.is_moe:
            return 0.0 if type(t) is float else _out(np.zeros_like(t))
        return _out(positive(t, self._weight_gemms("router", t, ((self.model.hidden_size, self.model.num_experts),))))

    def lm_head(self, tokens):
        """Final projection and sampling, once per step (not per layer): fp32 logits written and read back."""
        if type(tokens) is float:  # one cell: a pure function of the row count, which recurs
            out = self._cells.get(("lm_head", tokens))
            if out is None:
                out = self._cells[("lm_head", tokens)] = self._lm_head(_arr(tokens, "tokens"))
            return out
        return self._lm_head(_arr(tokens, "tokens"))

    def _lm_head(self, t):
        m = self.model
        e = self._eff["lm_head"]
        proj = self._weight_gemms("lm_head", t, ((m.hidden_size, m.vocab_size),))
        seconds = formulas.lm_head(t, proj, m.vocab_size, self.gpu.hbm_bw * e.memory, e.kernel_s)
        return _out(positive(t, seconds))

    def step_overhead(self, sequences):
        """The engine's time per forward outside the modules: step_s + step_per_sequence_s * sequences."""
        if type(sequences) is float and sequences > 0:  # one cell: the formula at once
            return formulas.step_overhead(sequences, self.eff.step_s, self.eff.step_per_sequence_s)
        n = _arr(sequences, "sequences")
        return _out(positive(n, formulas.step_overhead(n, self.eff.step_s, self.eff.step_per_sequence_s)))

    def boundary_overhead(self, sequences):
        """The engine's time at one scheduling boundary: boundary_s + boundary_per_sequence_s * sequences."""
        n = _arr(sequences, "sequences")
        return _out(self.eff.boundary_s + self.eff.boundary_per_sequence_s * n)

    # ---- routed experts ---------------------------------------------------------------------------------

    def _expert_shares_by_rank(self) -> np.ndarray:
        """(ep_ranks, slots) routing shares p_e, expert e at [e % R, e // R]; empty slots hold 0."""
        e = self.model.num_experts
        p = np.arange(1, e + 1, dtype=float) ** -self.routing_skew
        p /= p.sum()
        slots = -(-e // self.ep_ranks)
        padded = np.zeros(slots * self.ep_ranks)
        padded[:e] = p
        return padded.reshape(slots, self.ep_ranks).T

    def _expert_rank_times(self, total_tokens: np.ndarray) -> np.ndarray:
        """(n, ep_ranks) expected expert time of each rank for a 1-D array of global gate batches. Where every
        rank holds the same shares (uniform routing, experts divisible by ranks: the usual), one rank's times
        are every rank's: computed once and broadcast (the same values, ep_ranks times less work)."""
        m, p = self.model, self._rank_p
        if self._ranks_alike:
            p = p[:1]
        assignments = total_tokens[:, None, None] * m.top_k  # (n, 1, 1)
        tokens = assignments[..., 0] * p.sum(axis=1)  # (n, R) expected token-expert pairs per rank
        if self.routing_skew == 0:  # uniform shares: one power per batch size instead of one per expert
            miss = np.power(1.0 - 1.0 / m.num_experts, assignments[..., 0])  # (n, 1)
            touched = (p > 0).sum(axis=1) * (1.0 - miss)  # (n, R) experts with >= 1 token
        else:
            touched = (1.0 - np.power(1.0 - p, assignments)).sum(axis=2)
        # one grouped GEMM per weight over the touched experts: as many tiles (and waves) as one GEMM whose n is
        # touched x the expert's, each expert's weights read once, one launch
        rows = np.divide(tokens, touched, out=np.zeros_like(tokens), where=touched > 0)
        h, inter = m.hidden_size, m.moe_intermediate_size
        t = (self._weight_gemms("experts", rows, [(h, 2 * inter * touched), (inter, h * touched)])
             + 2 * np.maximum(tokens - rows, 0) * self._act_row / (self.gpu.hbm_bw * self._eff["experts"].memory))
        return np.broadcast_to(np.where(tokens > 0, t, 0.0), (total_tokens.size, self._rank_p.shape[0]))

    def experts(self, total_tokens):
        """Routed experts of one MoE layer for `total_tokens` entering the gate across the instance.

        Returns (max_rank_s, mean_rank_s): the slowest rank sets the pace of lockstep expert parallelism; the
        mean is for idle accounting. Costs are expectations (see the package docstring). Dense -> (0, 0).
        """
        t = _arr(total_tokens, "total_tokens")
        if type(t) is float:  # one cell: the grid's value of a one-element batch
            if not self.model.is_moe:
                return 0.0, 0.0
            worst, mean = self.experts(np.array([t]))
            return float(worst[0]), float(mean[0])
        if not self.model.is_moe:
            return _out(np.zeros_like(t)), _out(np.zeros_like(t))
        top = float(t.max(initial=0.0))
        if top <= _EXPERT_LOOKUP_MAX and np.all(t == np.floor(t)):
            curve = self._curves.get("experts")
            if curve is None or curve[0].size <= top:  # decode batch sizes: one curve, computed once
                size = int(max(top + 1, 2 * (curve[0].size if curve is not None else 1024)))
                curve = self._curves["experts"] = self._expert_times(np.arange(size, dtype=float))
            index = t.astype(np.int64)
            return _out(curve[0][index]), _out(curve[1][index])
        values, inverse = np.unique(t, return_inverse=True)  # a grid repeats few distinct batch sizes
        worst, mean = self._large_expert_times(values)
        return _out(worst[inverse].reshape(t.shape)), _out(mean[inverse].reshape(t.shape))

    def local_experts(self, tokens):
        """Routed experts of one MoE layer for `tokens` of this rank's own gate, every expert on this GPU: a
        data-parallel prefill, whose rank runs its tokens through the experts it holds and those streamed in."""
        if self.ep_ranks == 1:
            return self.experts(tokens)[0]
        if self._all_experts is None:
            self._all_experts = Roofline(self.model, self.gpu, self.eff, ep_ranks=1, gpus_per_node=self.gpus_per_node,
                                         routing_skew=self.routing_skew, use_fp8=self.use_fp8, host=self.host)
        return self._all_experts.experts(tokens)[0]

    def _large_expert_times(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`_expert_times` of batch sizes past the curve (prefill forwards), each computed once: a job's prefills
        repeat a few sizes (every rank's full token budget) far more often than they bring a new one."""
        known = self._large_experts
        keys = values.tolist()
        new = [v for v in keys if v not in known]
        if new:
            if len(known) + len(new) > _LARGE_EXPERT_MEMO:
                known.clear()
            for v, w, m in zip(new, *(a.tolist() for a in self._expert_times(np.asarray(new, float)))):
                known[v] = (w, m)
        worst, mean = zip(*(known[v] for v in keys))
        return np.array(worst), np.array(mean)

    def _expert_times(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slowest rank, mean rank) seconds for each global gate batch in the 1-D `values`."""
        worst, mean = np.empty_like(values), np.empty_like(values)
        for i in range(0, values.size, _EXPERT_CHUNK):
            ranks = self._expert_rank_times(values[i:i + _EXPERT_CHUNK])
            worst[i:i + _EXPERT_CHUNK], mean[i:i + _EXPERT_CHUNK] = ranks.max(axis=1), ranks.mean(axis=1)
        return worst, mean

    def expert_batch_per_expert(self, total_tokens):
        """Mean tokens per routed expert: total_tokens * top_k / num_experts (0 for a dense model)."""
        t = _arr(total_tokens, "total_tokens")
        m = self.model
        return _out(t * m.top_k / m.num_experts if m.is_moe else np.zeros_like(t))

    # ---- conveniences for the simulator -----------------------------------------------------------------

    def layer_counts(self) -> tuple[int, int]:
        """(num_dense_layers, num_moe_layers)."""
        return self._layers

    def weight_bytes_per_rank(self) -> float:
        """Bytes of weights one rank holds: every non-expert weight (replicated) + embeddings + LM head + its
        routed experts (round-robin, so the busiest rank's ceil(num_experts / ep_ranks) per MoE layer)."""
        m = self.model
        replicated = (m.num_layers * m.attention_params_per_layer + m.num_dense_layers * m.dense_ffn_params
                      + m.embedding_params)
        if m.is_moe:
            per_rank_experts = -(-m.num_experts // self.ep_ranks)
            replicated += m.num_moe_layers * (m.shared_expert_params + m.router_params
                                              + per_rank_experts * m.expert_params)
        return float(replicated * m.weight_bytes)
