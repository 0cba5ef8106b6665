"""Pricing of one-rank runs with Python floats: a serving engine's forward on one GPU, or a short decode run.

Why. A chunked-prefill forward on one rank is a (1 x 1) grid, a decode run until the next finish a (1 x K) one
with K mostly below 8; the roofline's numpy methods then spend their time in per-call overhead (argument
checks, ufunc dispatch, reductions over one element), about 0.3 ms a run, a quarter of the simulator's time on
Vidur's workload and half of it under two-batch overlap. Here the same formulas run on Python floats, one
iteration at a time.

Same results, bit for bit (a fast path of batchgen.fastpath): every operation is the one numpy does, on the
same operands, in the same order (IEEE arithmetic is the same in both; numpy's x ** 2 is x * x; its rounding,
like Python's, is half to even); GEMM times are read from the very curves the roofline reads; sums over
iterations are left to numpy on arrays built from the same values (its pairwise order). It applies only where
every one of those arguments holds: a plain `Roofline` (not a table or a tensor-parallel-attention wrapper), a
dense model (no expert all-to-all to price), nothing partitioned (no join), whole token counts within the
GEMM curves. Everywhere else `scalar_pricer` returns None and the numpy path prices. A longer run whose batch
stays the same (a static batch, a run to the first finish) goes to `price_vector`: its constant modules on
floats once, decode attention's context-dependent part as numpy vectors. tests/test_sim_fastpath.py checks the
rows and prices against `costs.decode_load` / `mixed_load` / `price` / `tbo.price_tbo` on random loads, and
whole jobs with and without the fast paths.
"""

from __future__ import annotations

import math

import numpy as np

from batchgen import fastpath
from batchgen.latency import formulas
from batchgen.latency.roofline import _GEMM_LOOKUP_MAX, Roofline
from batchgen.pricing.cost import RunCost

# decode runs longer than this stay on numpy (a Python loop per iteration would cost more than the arrays)
MAX_ITERATIONS = 12


class _NotHere(Exception):
    """A value outside what the scalar path mirrors (a token count beyond the curves, a fractional launch)."""


class ScalarRoofline:
    """`Roofline`'s attention, dense FFN, LM head and per-forward overhead for one cell, on Python floats.
    Each method follows the roofline's method of the same name operation for operation (see there for why)."""

    def __init__(self, lat: Roofline):
        m, gpu = lat.model, lat.gpu
        self.lat = lat
        self.n_dense = lat.layer_counts()[0]
        self.kvb = m.kv_bytes_per_token_per_layer
        self.act_row = lat._act_row
        self.pad = lat.eff.attention_padding
        self.flops_decode = m.attention_score_flops_decode
        self.flops_prefill = m.attention_score_flops_prefill
        self.attn_shapes = tuple(lat._attention_shapes)
        h = m.hidden_size
        self.head_shapes = ((h, m.vocab_size),)
        self.vocab = m.vocab_size
        inter = m.intermediate_size
        self.ffn_shapes = ((h, 2 * inter), (inter, h)) if inter > 0 else None
        e_head = lat._eff["lm_head"]
        self.head_bw = gpu.hbm_bw * e_head.memory
        self.head_kernel = e_head.kernel_s
        self.step_s, self.step_seq_s = lat.eff.step_s, lat.eff.step_per_sequence_s
        # module -> (flop rate, byte rate, launch seconds) of its score kernel (formulas.streaming)
        self.stream = {module: lat.stream_rates(module) for module in ("attention_decode", "attention_prefill")}
        self.shapes_ok = all(type(k) is int and type(n) is int
                             for shapes in (self.attn_shapes, self.head_shapes, self.ffn_shapes or ())
                             for k, n in shapes)
        self._gemm: dict = {}  # (module, launches, tokens) -> seconds read from the roofline's curve
        self._head: dict = {}  # rows -> lm_head seconds, and tokens -> dense_ffn seconds: pure functions of a
        self._ffn: dict = {}   # whole number that recurs from forward to forward, so each is priced once
        self._tbo_batches: dict = {}  # `_tbo_halves`

    def gemm(self, module: str, tokens: float, shapes: tuple, launches: float) -> float:
        """`Roofline._gemm_lookup` for one cell: the curve's value at `tokens` rows in `launches` launches."""
        key = (module, launches, tokens)
        out = self._gemm.get(key)
        if out is None:
            if tokens > _GEMM_LOOKUP_MAX or tokens != math.floor(tokens) or launches != math.floor(launches):
                raise _NotHere
            index = int(tokens)
            out = self._gemm[key] = float(self.lat._gemm_curve(module, shapes, launches, index)[index])
        return out

    def attention_decode(self, t: float, ctx: float, mb: float, longest: float) -> float:
        if self.pad != 0:
            ctx = formulas.padded(ctx, t * longest, self.pad, max)
        if not t > 0:
            return 0.0
        proj = self._gemm.get(("attention_decode", mb, t))  # `gemm`'s table read first (its key), then `gemm`
        if proj is None:
            proj = self.gemm("attention_decode", t, self.attn_shapes, mb)
        return formulas.decode_attention(t, ctx, mb, proj, self.kvb, self.act_row, self.flops_decode,
                                         *self.stream["attention_decode"], max)

    def attention_prefill(self, t: float, sq: float, longest: float, seqs: float) -> float:
        """With one launch (as `costs.price` calls it)."""
        if not t > 0:
            return 0.0
        pairs = 0.5 * sq
        if self.pad != 0:
            pairs = formulas.padded(pairs, seqs * (longest * longest), self.pad, max)
        proj = self.gemm("attention_prefill", t, self.attn_shapes, 1.0)
        return formulas.prefill_attention(t, pairs, 1.0, proj, self.kvb, self.act_row, self.flops_prefill,
                                          *self.stream["attention_prefill"], max)

    def lm_head(self, t: float) -> float:
        out = self._head.get(t)
        if out is None:
            out = self._head[t] = self._lm_head(t)
        return out

    def _lm_head(self, t: float) -> float:
        if not t > 0:
            return 0.0
        proj = self.gemm("lm_head", t, self.head_shapes, 1.0)
        return formulas.lm_head(t, proj, self.vocab, self.head_bw, self.head_kernel)

    def step_overhead(self, n: float) -> float:
        return formulas.step_overhead(n, self.step_s, self.step_seq_s) if n > 0 else 0.0

    def dense_ffn(self, t: float) -> float:
        out = self._ffn.get(t)
        if out is None:
            out = self._ffn[t] = (0.0 if self.ffn_shapes is None or not t > 0
                                  else self.gemm("dense_ffn", t, self.ffn_shapes, 1.0))
        return out


def scalar_pricer(lat) -> ScalarRoofline | None:
    """The scalar mirror of `lat` where one applies (see the module docstring), built once per model."""
    if not fastpath.ENABLED or type(lat) is not Roofline:
        return None
    cached = lat.__dict__.get("_scalar_pricer", False)
    if cached is False:
        n_dense, n_moe = lat.layer_counts()
        sp = ScalarRoofline(lat)
        cached = sp if (n_moe == 0 and not lat.model.is_moe and sp.shapes_ok) else None
        lat.__dict__["_scalar_pricer"] = cached
    return cached


# the RankLoad fields a run's price reads, in the order `price_row` takes them
FIELDS = ("attn_tokens", "attn_context", "gate_tokens", "prefill_sq", "prefill_tokens", "micro_batches",
          "attn_max", "prefill_max", "prefill_seqs", "sequences", "head_rows")


def rows_of(load) -> list[list[float]] | None:
    """A one-rank RankLoad's fields as per-iteration lists (head_rows: the sequences' when None); None when
    the load has more than one rank or too many iterations for the scalar path."""
    if load.gate_tokens.shape[0] != 1 or load.gate_tokens.shape[1] > MAX_ITERATIONS:
        return None
    out = [getattr(load, f)[0].tolist() for f in FIELDS[:-1]]
    out.append(out[9] if load.head_rows is None else load.head_rows[0].tolist())
    return out


def price_row(sp: ScalarRoofline, rows: list[list[float]], head_rows_given: bool, weight_stream_s: float = 0.0,
              tbo: bool = False):
    """`costs.price` (or, with `tbo`, `tbo.price_tbo`) of a one-rank run of a dense model without a join, from
    `rows_of`; None where a value is outside what the scalar path mirrors. `head_rows_given`: the load's
    head_rows was set (TBO splits them; otherwise they are the sequences, split alike)."""

    try:
        if tbo and weight_stream_s <= 0:
            return _tbo(sp, rows, head_rows_given, RunCost)
        return _plain(sp, rows, weight_stream_s, RunCost)
    except _NotHere:
        return None


def _plain(sp: ScalarRoofline, rows, weight_stream_s: float, RunCost):
    n_dense = sp.n_dense
    (a_tok, a_ctx, gate, p_sq, p_tok, mb, a_max, p_max, p_seq, seqs, head_rows) = rows
    iteration, busy, attention, ffn, head_s, active = [], [], [], [], [], []
    batch = None
    for k in range(len(gate)):
        g = gate[k]
        if batch != (p_tok[k], p_sq[k], p_max[k], p_seq[k], head_rows[k], seqs[k], g):
            # the parts that do not depend on the context: priced again only when the batch changes
            batch = (p_tok[k], p_sq[k], p_max[k], p_seq[k], head_rows[k], seqs[k], g)
            prefill = sp.attention_prefill(p_tok[k], p_sq[k], p_max[k], p_seq[k])
            head = sp.lm_head(head_rows[k])
            base = head + sp.step_overhead(seqs[k])
            dense_ffn = sp.dense_ffn(g)
        attn = sp.attention_decode(a_tok[k], a_ctx[k], mb[k], a_max[k]) + prefill
        it = base
        dense = attn + dense_ffn
        it += n_dense * (dense + 0.0)
        b = head + n_dense * dense
        if weight_stream_s > 0:
            it = max(it, weight_stream_s)
        on = g > 0
        iteration.append(it if on else 0.0)
        busy.append(b)
        attention.append(n_dense * attn if on else 0.0)
        ffn.append(n_dense * dense_ffn if on else 0.0)
        head_s.append(head if on else 0.0)
        active.append(on)
    return _cost(RunCost, iteration, busy, gate, active, 0.0, attention, ffn, head_s)


def _tbo(sp: ScalarRoofline, rows, head_rows_given: bool, RunCost):
    """`tbo.price_tbo` on one rank of a dense model (no all-to-all, no join: nothing to communicate, so the
    rank's comm is 0.0): each half's chain, one after the other. A half's parts that do not depend on the context
    (its prefill attention, LM head, overhead, dense FFN) are priced once per batch, as in `_plain`."""
    n_dense = sp.n_dense
    (a_tok, a_ctx, gate, p_sq, p_tok, mb, a_max, p_max, p_seq, seqs, head_rows) = rows
    iteration, busy, attention, ffn, head_s, active = [], [], [], [], [], []
    batch = halves = share = None
    for k in range(len(gate)):
        if batch != (a_tok[k], gate[k], p_tok[k], p_seq[k], seqs[k], head_rows[k], p_sq[k], p_max[k]):
            batch = (a_tok[k], gate[k], p_tok[k], p_seq[k], seqs[k], head_rows[k], p_sq[k], p_max[k])
            share, halves = _tbo_halves(sp, batch, head_rows_given)
        (t0, pre0, head0, over0, ffn0), (t1, pre1, head1, over1, ffn1) = halves
        attn0 = sp.attention_decode(t0, a_ctx[k] * share, mb[k], a_max[k]) + pre0
        attn1 = sp.attention_decode(t1, a_ctx[k] * (1.0 - share), mb[k], a_max[k]) + pre1
        # the first half's chain, then the second's (the two passes of tbo.price_tbo's loop, unrolled)
        b = 0.0 + head0
        it = 0.0 + (head0 + over0)
        hs = 0.0 + head0
        at = 0.0 + n_dense * attn0
        f = 0.0
        if n_dense:
            it += n_dense * (attn0 + ffn0 + 0.0)
            b += n_dense * (attn0 + ffn0)
            f += n_dense * ffn0
        b += head1
        it += head1 + over1
        hs += head1
        at += n_dense * attn1
        if n_dense:
            it += n_dense * (attn1 + ffn1 + 0.0)
            b += n_dense * (attn1 + ffn1)
            f += n_dense * ffn1
        on = gate[k] > 0
        iteration.append(it if on else 0.0)
        busy.append(b)
        attention.append(at if on else 0.0)
        ffn.append(f if on else 0.0)
        head_s.append(hs if on else 0.0)
        active.append(on)
    return _cost(RunCost, iteration, busy, gate, active, 0.0, attention, ffn, head_s)


def _tbo_halves(sp: ScalarRoofline, batch: tuple, head_rows_given: bool) -> tuple[float, tuple]:
    """A TBO forward's share of sequences in its first half and, per half, its decode queries and the parts of its
    chain that do not depend on the context (prefill attention, LM head, overhead, dense FFN): a pure function of
    the batch, kept per batch (a decode batch recurs from run to run; the table is emptied when it grows large)."""
    key = (batch, head_rows_given)
    out = sp._tbo_batches.get(key)
    if out is None:
        a_tok, gate, p_tok, p_seq, s, head_rows, p_sq, p_max = batch
        share = math.ceil(s / 2.0) / s if s > 0 else 0.0
        split = []
        for total in (a_tok, gate, p_tok, p_seq, s, head_rows):  # as tbo.split: the first half's rounded share
            first = float(round(total * share))
            split.append((first, total - first))
        sq = (p_sq * share, p_sq * (1.0 - share))
        halves = tuple((split[0][i], sp.attention_prefill(split[2][i], sq[i], p_max, split[3][i]),
                        sp.lm_head(split[5][i] if head_rows_given else split[4][i]), sp.step_overhead(split[4][i]),
                        sp.dense_ffn(split[1][i]) if sp.n_dense else 0.0) for i in (0, 1))
        if len(sp._tbo_batches) >= _TBO_BATCHES:
            sp._tbo_batches.clear()
        out = sp._tbo_batches[key] = (share, halves)
    return out


_TBO_BATCHES = 4096  # batches whose TBO halves a pricer keeps


def _cost(RunCost, iteration, busy, gate, active, rank_comm, attention, ffn, head_s):
    """The RunCost of per-iteration values, summed by numpy as the array paths sum them (pairwise)."""
    if len(iteration) == 1:  # numpy's sum of one element is 0.0 + it (its identity first): the same, cheaper
        modules = {"attention": 0.0 + attention[0], "ffn": 0.0 + ffn[0], "head": 0.0 + head_s[0]}
        expert = gate[0] if active[0] else 0.0
        if isinstance(rank_comm, float) and type(expert) is float:  # one array, four one-element views of it
            v = np.array([iteration[0], 0.0 + busy[0], expert, 0.0])
            return RunCost(v[0:1], v[1:2], v[3:4], v[2:3], modules)
        return RunCost(np.array(iteration), np.array([0.0 + busy[0]]),
                       np.zeros(1) if isinstance(rank_comm, float) else rank_comm, np.array([expert]), modules)
    if isinstance(rank_comm, float):  # no join, no all-to-all: zero per rank, as the array path's sum gives
        rank_comm = np.zeros(1)
    modules = {"attention": float(np.array(attention).sum()), "ffn": float(np.array(ffn).sum()),
               "head": float(np.array(head_s).sum())}
    expert = np.array([g if on else 0.0 for g, on in zip(gate, active)])
    return RunCost(np.array(iteration), np.array([busy]).sum(axis=1), rank_comm, expert, modules)


def decode_rows(context: np.ndarray, alive_for: np.ndarray, iterations: int, micro_batch: int) -> list[list[float]]:
    """`rows_of(costs.decode_load(...))` for one rank, nothing partitioned, no padding rows and no similar-context
    calls: per iteration k, the sequences still running (alive_for > k), their contexts summed (+ k each) and
    the longest (+ k). Every amount is a whole number below 2^53, so the sums are exact in any order."""
    K = iterations
    n = alive_for.size
    if n and int(alive_for.min()) >= K:  # every sequence runs the whole run (a run to the first finish)
        tokens = [float(n)] * K
        base, top = float(context.sum()), float(context.max())
        ctx = [base + tokens[0] * k for k in range(K)]
        longest = [top + k for k in range(K)]
    else:
        alive = np.minimum(alive_for, K)
        count = np.bincount(alive, minlength=K + 1).tolist()
        total = np.bincount(alive, weights=context, minlength=K + 1).tolist()
        most = np.full(K + 1, -1, np.int64)
        np.maximum.at(most, alive, context)
        most = most.tolist()
        tokens, ctx, longest = [0.0] * K, [0.0] * K, [0.0] * K
        c = s = 0.0
        m = -1
        for k in range(K - 1, -1, -1):  # alive at k: alive_for in k + 1 .. K
            c += count[k + 1]
            s += total[k + 1]
            m = max(m, most[k + 1])
            tokens[k], ctx[k], longest[k] = c, s + c * k, (m + k if m >= 0 else 0.0)
    if micro_batch > 0:
        mb = [max(float(math.ceil(g / micro_batch)), 1.0) for g in tokens]
    else:
        mb = [1.0] * K
    zeros = [0.0] * K
    return [tokens, ctx, tokens, zeros, zeros, mb, [float(x) for x in longest], zeros, zeros, tokens, tokens]


def mixed_rows(chunk_start: np.ndarray, chunk_len: np.ndarray, chunk_completes: np.ndarray,
               decode_context: np.ndarray, micro_batch: int) -> list[list[float]]:
    """`rows_of(costs.mixed_load(...))` for one rank without similar-context calls (head rows given). Sums of
    whole numbers below 2^53 are exact in any order; the longest chunk's sqrt is numpy's (both IEEE)."""
    p_tok = p_sq = p_seq = d_single = single_ctx = 0
    p_max = 0.0
    d_max = float(decode_context.max()) if decode_context.size else 0.0
    for s, n in zip(chunk_start.tolist(), chunk_len.tolist()):
        if n > 1:
            p_tok += n
            p_sq += n * n + 2 * s * n
            p_seq += 1
            p_max = max(p_max, math.sqrt(float(n * (s + n))))
        else:  # a one-token chunk attends like a decode query over start + 1
            d_single += 1
            single_ctx += s + 1
            d_max = max(d_max, float(s + 1))
    d_tok = float(decode_context.size + d_single)
    d_ctx = float(int(decode_context.sum()) + single_ctx)
    seqs = p_seq + d_tok
    mb = math.ceil(seqs / micro_batch) if micro_batch > 0 else (1.0 if seqs > 0 else 0.0)
    head = float(decode_context.size + int(np.count_nonzero(chunk_completes)))
    p_tok = float(p_tok)
    return [[d_tok], [d_ctx], [p_tok + d_tok], [float(p_sq)], [p_tok], [max(float(mb), 1.0)], [d_max], [p_max],
            [float(p_seq)], [seqs], [head]]


def price_vector(sp: ScalarRoofline, load, weight_stream_s: float = 0.0):
    """`costs.price` (no two-batch overlap) of a one-rank run of many iterations in which every amount but the
    context is the same each iteration (a run to the first finish, a static batch with its padding rows): the
    constant modules priced once on Python floats, decode attention's context-dependent part as numpy vectors
    over the iterations (element for element the grid's operations). None where that does not hold."""
    fields = {}
    for name in ("attn_tokens", "gate_tokens", "micro_batches", "sequences", "prefill_tokens", "prefill_sq",
                 "prefill_max", "prefill_seqs"):
        row = getattr(load, name)[0]
        first = row[0]
        if not (row == first).all():
            return None
        fields[name] = float(first)
    head_rows = load.head_rows
    if head_rows is not None:
        row = head_rows[0]
        if not (row == row[0]).all():
            return None
        h_rows = float(row[0])
    else:
        h_rows = fields["sequences"]
    return _price_vector(sp, fields, h_rows, load.attn_context[0], load.attn_max[0], load.gate_tokens.shape[1],
                         weight_stream_s)


def _price_vector(sp: ScalarRoofline, fields: dict, h_rows: float, ctx: np.ndarray, attn_max: np.ndarray, K: int,
                  weight_stream_s: float):
    """`price_vector` from the run's constant amounts (`fields`, the LM head's rows), its context and longest
    context per iteration."""

    t, g, mb = fields["attn_tokens"], fields["gate_tokens"], fields["micro_batches"]
    n_dense = sp.n_dense
    try:
        pre = sp.attention_prefill(fields["prefill_tokens"], fields["prefill_sq"], fields["prefill_max"],
                                   fields["prefill_seqs"])
        head = sp.lm_head(h_rows)
        overhead = sp.step_overhead(fields["sequences"])
        dense_ffn = sp.dense_ffn(g)
        proj = sp.gemm("attention_decode", t, sp.attn_shapes, mb) if t > 0 else 0.0
    except _NotHere:
        return None
    if sp.pad != 0:
        ctx = formulas.padded(ctx, t * attn_max, sp.pad, np.maximum)
    if t > 0:
        attn = formulas.decode_attention(t, ctx, mb, proj, sp.kvb, sp.act_row, sp.flops_decode,
                                         *sp.stream["attention_decode"], np.maximum)
    else:
        attn = np.zeros(K)
    attn = attn + pre
    dense = attn + dense_ffn
    iteration = (head + overhead) + n_dense * (dense + 0.0)
    busy = head + n_dense * dense
    if weight_stream_s > 0:
        iteration = np.maximum(iteration, weight_stream_s)
    if not g > 0:  # no iteration ran
        iteration = np.zeros(K)
        zero = np.zeros(K)
        modules = {"attention": float(zero.sum()), "ffn": float(zero.sum()), "head": float(zero.sum())}
        return RunCost(iteration, busy[None, :].sum(axis=1), np.zeros(1), zero, modules)
    modules = {"attention": float((n_dense * attn).sum()), "ffn": float(np.full(K, 0.0 + n_dense * dense_ffn).sum()),
               "head": float(np.full(K, head).sum())}
    return RunCost(iteration, busy[None, :].sum(axis=1), np.zeros(1), np.full(K, 0.0 + g), modules)


def price_all_alive(sp: ScalarRoofline, context: np.ndarray, iterations: int, micro_batch: int, pad_rows: int,
                    pad_context: int, weight_stream_s: float = 0.0):
    """`price_vector(sp, costs.decode_load(...))` and the load's gate-token total, for a one-rank run in which
    every one of the n sequences runs all K iterations (a static batch, whose finished rows are padding rows of
    the rank; a run to the first finish), nothing partitioned, no similar-context calls; without building the
    load's grid. Its amounts in closed form, as the grid's bincounts and cumulative sums give them: n + pad_rows
    queries and gate tokens each iteration, context (sum + n k) + (pad_context + pad_rows k), longest
    max + k (or the padding rows' mean + k where that is longer): sums of whole numbers below 2^53, exact in any
    order; the padding rows' mean is the grid's own division. None where price_vector declines."""
    n, K = context.size, iterations
    ks = np.arange(K)
    tokens = float(n) + pad_rows
    ctx = (float(context.sum()) + float(n) * ks) + (pad_context + pad_rows * ks)
    longest = float(context.max()) + ks
    if pad_rows > 0:
        longest = np.maximum(longest, np.float64(pad_context) / np.float64(pad_rows) + ks)
    mb = max(float(math.ceil(tokens / micro_batch)) if micro_batch > 0 else float(tokens > 0), 1.0)
    fields = dict(attn_tokens=tokens, gate_tokens=tokens, micro_batches=mb, sequences=tokens, prefill_tokens=0.0,
                  prefill_sq=0.0, prefill_max=0.0, prefill_seqs=0.0)
    cost = _price_vector(sp, fields, tokens, ctx, longest, K, weight_stream_s)
    return cost, np.full((1, K), tokens).sum()
