"""One measurable call per grid point, through the executor's own code.

Attention: `MoEDecoder.attention_block` over a real `PagedKVCache` (one layer) with metadata from the cache's
own `prepare`, the hidden rows written back as `InstanceRunner.forward` does; decode also as a layer's later call
(`warm`: right after another call of that layer, over other sequences). FFN: the MoE layer's pieces in
the order `ffn_block` runs them (router = post-attention norm + gate + top-k + the residual add; experts; shared
experts), a dense layer's whole `ffn_block`. LM head: `final_logits` + `sample` (greedy, the executor's
default). Step: a whole decode iteration (`InstanceRunner.forward` + sampling + token bookkeeping, as
`ExecBackend._decode` does) minus the modules timed inside it, all on the executor's clock (batchgen.exec.clock).
Copies: `copy_` between host and device tensors (on a CPU device both are host memory: a memcpy).

Each case is set up, timed and torn down once per round, so KV pools hold one point's sequences at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from batchgen.exec import clock
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import MoEDecoder
from batchgen.exec.runner import InstanceRunner, RankBatch
from batchgen.exec.sampling import SamplingParams, sample
from batchgen.profile.grid import Grid, contexts_of
from batchgen.profile.timing import Clock

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


@dataclass
class Case:
    """A grid point of one module: `setup()` returns (call, cleanup); `measure` times `calls` calls."""

    module: str
    point: dict
    setup: Callable[[], tuple[Callable[[], object], Callable[[], None]]]

    def measure(self, clock: Clock, warmup: int, calls: int) -> list[float]:
        fn, cleanup = self.setup()
        try:
            if warmup:
                clock.time_calls(fn, warmup)
            return clock.time_calls(fn, calls)
        finally:
            cleanup()


@dataclass
class WarmCase(Case):
    """A point timed right after an untimed call of the same module over other data (`setup()` returns
    (call, cleanup, before)): a layer's second and later attention calls of a forward, which find that layer's
    weights in cache where the first call of the layer does not."""

    def measure(self, clock: Clock, warmup: int, calls: int) -> list[float]:
        fn, cleanup, before = self.setup()
        try:
            if warmup:
                clock.time_calls(fn, warmup, before)
            return clock.time_calls(fn, calls, before)
        finally:
            cleanup()


@dataclass
class SelfTimedCase(Case):
    """A point whose call returns its own seconds (the step overhead: a whole iteration's time minus modules)."""

    def measure(self, clock: Clock, warmup: int, calls: int) -> list[float]:
        fn, cleanup = self.setup()
        try:
            for _ in range(warmup):
                fn()
            return [float(fn()) for _ in range(calls)]
        finally:
            cleanup()


@dataclass
class Bench:
    """The model under test and what every case shares: a random hidden state, one-layer KV caches."""

    model: MoEDecoder
    page_size: int
    seed: int = 0
    device: torch.device = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._gen = torch.Generator().manual_seed(self.seed)
        self._next_id = 0
        c = self.model.config
        self.moe_layer = next((l for l in range(c.num_layers) if c.is_moe_layer(l)), None)
        self.dense_layer = next((l for l in range(c.num_layers) if not c.is_moe_layer(l)), None)

    def hidden(self, tokens: int) -> torch.Tensor:
        """[tokens, hidden] as the first layer sees it: embeddings of random token ids."""
        ids = torch.randint(0, self.model.config.vocab_size, (max(tokens, 1),), generator=self._gen)
        with torch.inference_mode():
            return self.model.embed(ids.to(self.device))[:tokens].clone()

    def ids(self, n: int) -> list[int]:
        out = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        return out

    def cache(self, tokens: int, sequences: int, layers: int = 1) -> PagedKVCache:
        """A KV cache of `layers` layers with room for `tokens` tokens over `sequences` sequences (+ growth)."""
        g = self.model.kv_cache_geometry()._asdict()
        g["num_layers"] = layers
        pages = -(-tokens // self.page_size) + 2 * sequences + 4
        return PagedKVCache(**g, page_size=self.page_size, num_pages=pages, dtype=self.dtype, device=self.device)


# ---- attention -------------------------------------------------------------------------------------------

def _attention_case(bench: Bench, module: str, lens: list[int], decode: bool, micro_batches: int = 1,
                    warm: bool = False) -> Case:
    """Decode: one query per sequence at context lens[i]; prefill: whole prompts of lens[i] tokens. Sequences
    sorted by length and cut into `micro_batches` consecutive pieces, one attention call each (the runner's
    micro-batches). `warm` (decode): timed right after an untimed call of the same shape over other sequences
    of the same layer (`WarmCase`): a forward's attention calls after the first of each layer."""
    lens = sorted(lens)
    B = len(lens)
    tokens = B if decode else sum(lens)
    if decode:
        point = {"tokens": B, "context_sum": sum(lens), "max_context": max(lens), "micro_batches": micro_batches}
        if warm:
            point["warm"] = True
    else:
        point = {"tokens": tokens, "context_sq_sum": sum(n * n for n in lens), "max_context": max(lens),
                 "sequences": B, "micro_batches": micro_batches}

    def pieces_of(cache: PagedKVCache, ids: list[int]) -> list:
        bounds = [B * i // micro_batches for i in range(micro_batches + 1)]
        pieces, row = [], 0
        for lo, hi in zip(bounds, bounds[1:]):
            part, plen = ids[lo:hi], lens[lo:hi]
            if decode:
                grown = [(s, n - 1) for s, n in zip(part, plen) if n > 1]  # context n - 1 before the query
                if grown:
                    cache.prepare([s for s, _ in grown], [n for _, n in grown], [0] * len(grown))
                meta = cache.prepare(part, [1] * len(part), [n - 1 for n in plen]).to(bench.device)
                n = len(part)
            else:
                meta = cache.prepare(part, plen, [0] * len(part)).to(bench.device)
                n = sum(plen)
            pieces.append((slice(row, row + n), meta))
            row += n
        return pieces

    def caller(cache: PagedKVCache, pieces: list):
        hidden = bench.hidden(tokens)
        kv = cache.layer(0)
        model = bench.model

        @torch.inference_mode()
        def call():
            for rows, meta in pieces:
                hidden[rows] = model.attention_block(0, hidden[rows], meta, kv)

        return call

    def setup():
        sets = 2 if warm else 1
        cache = bench.cache(sets * (sum(lens) + B), sets * B)
        ids = bench.ids(B)
        call = caller(cache, pieces_of(cache, ids))
        if not warm:
            return call, lambda: cache.release(ids)
        other = bench.ids(B)
        before = caller(cache, pieces_of(cache, other))
        return call, lambda: cache.release(ids + other), before

    return (WarmCase if warm else Case)(module, point, setup)


def attention_cases(bench: Bench, grid: Grid, max_context: int) -> list[Case]:
    out = [_attention_case(bench, "attention_decode", contexts_of(b, ctx, shape), True)
           for b, ctx, shape in grid.decode_points(max_context)]
    out += [_attention_case(bench, "attention_decode", contexts_of(b, ctx, shape), True, warm=True)
            for b, ctx, shape in grid.decode_points(max_context) if shape == "equal" and b <= grid.warm_decode_batch]
    out += [_attention_case(bench, "attention_decode", contexts_of(b, min(ctx, max_context), "spread"), True, mb)
            for b, ctx, mb in grid.decode_micro_batches if b >= mb]
    out += [_attention_case(bench, "attention_prefill", contexts_of(n, length, shape), False)
            for n, length, shape in grid.prefill_points(max_context)]
    return out


# ---- FFN modules -----------------------------------------------------------------------------------------

def ffn_cases(bench: Bench, grid: Grid) -> list[Case]:
    model, out = bench.model, []
    for t in grid.ffn_tokens:
        if bench.moe_layer is not None:
            out += _moe_cases(bench, bench.moe_layer, t)
        if bench.dense_layer is not None:
            out.append(_timed(bench, "dense_ffn", {"tokens": t},
                              lambda x, layer=bench.dense_layer: model.ffn_block(layer, x), t))
    return out


def _timed(bench: Bench, module: str, point: dict, fn: Callable[[torch.Tensor], object], tokens: int) -> Case:
    def setup():
        x = bench.hidden(tokens)

        @torch.inference_mode()
        def call():
            return fn(x)

        return call, lambda: None

    return Case(module, point, setup)


def _moe_cases(bench: Bench, layer: int, t: int) -> list[Case]:
    block = bench.model.layers[layer]
    moe = block.mlp
    with torch.inference_mode():
        x = bench.hidden(t)
        h = block.post_attention_layernorm(x)
        ids, weights = moe.route(h)
        out = moe.experts(h, ids, weights)
        counts = moe.last_tokens_per_expert
        shared_out = moe.shared(h)

    def router(_):
        hh = block.post_attention_layernorm(x)
        moe.route(hh)
        return x + out  # the residual add of ffn_block

    cases = [_timed(bench, "router", {"tokens": t}, router, t),
             _timed(bench, "experts", {"total_tokens": t, "max_expert_tokens": max(counts),
                                       "experts_touched": sum(1 for c in counts if c)},
                    lambda _: moe.experts(h, ids, weights), t)]
    if shared_out is not None:
        cases.append(_timed(bench, "shared_experts", {"tokens": t}, lambda _: out + moe.shared(h), t))
    return cases


def lm_head_cases(bench: Bench, grid: Grid) -> list[Case]:
    model = bench.model

    def case(t: int) -> Case:
        params, ids, steps = [GREEDY] * t, list(range(t)), [0] * t
        return _timed(bench, "lm_head", {"tokens": t},
                      lambda x: sample(model.final_logits(x).float(), params, ids, steps).tolist(), t)

    return [case(t) for t in grid.lm_head_tokens]


# ---- the per-forward overhead ----------------------------------------------------------------------------

def step_cases(bench: Bench, grid: Grid, max_context: int) -> list[Case]:
    return [_step_case(bench, b, min(grid.step_context, max_context - 8)) for b in grid.step_batches]


def _step_case(bench: Bench, B: int, context: int) -> Case:
    """A decode iteration of B sequences at `context` tokens, as ExecBackend._decode runs it: per-sequence
    batch lists, `InstanceRunner.forward`, greedy sampling and one append per sequence; its seconds minus the
    attention and FFN time the runner's own timer reports and the LM head + sampling time measured inside."""
    model = bench.model
    point = {"sequences": B, "tokens": B, "context": context}

    def setup():
        layers = model.num_layers
        cache = bench.cache((context + 64) * B, B, layers=layers)
        ids = bench.ids(B)
        cache.prepare(ids, [context - 1] * B, [0] * B)
        runner = InstanceRunner(model)
        starts = {sid: context - 1 for sid in ids}
        last = {sid: 1 for sid in ids}
        generated = {sid: [] for sid in ids}
        head = _HeadTimer(bench.device)
        model.final_logits = head.wrap(MoEDecoder.final_logits.__get__(model))

        def call() -> float:
            t0 = clock.now()
            batch = RankBatch(cache, [], [], [], [], [], [])
            for sid in ids:
                batch.seq_ids.append(sid)
                batch.token_ids.append(last[sid])
                batch.new_counts.append(1)
                batch.start_positions.append(starts[sid])
                batch.tp.append(1)
            batch.host_resident = [False] * B
            logits, stats = runner.forward([batch])
            order = batch.seq_ids
            t1 = clock.now()
            toks = sample(torch.cat(logits), [GREEDY] * B, order, [len(generated[s]) for s in order]).tolist()
            t2 = clock.now()
            for sid, tok in zip(order, toks):
                generated[sid].append(int(tok))
                last[sid] = int(tok)
                starts[sid] += 1
            whole = clock.now() - t0
            modules = sum(stats.rank_attention_s) + stats.ffn_s + head.take() + (t2 - t1)
            return whole - modules

        def cleanup():
            del model.final_logits  # back to the class's method
            cache.release(ids)

        return call, cleanup

    return SelfTimedCase("step", point, setup)


class _HeadTimer:
    """Times `final_logits` inside a forward (the executor's clock on CPU, events on CUDA, read after the forward)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._s = 0.0
        self._marks: list = []

    def wrap(self, fn):
        def timed(hidden):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(hidden)
                b.record()
                self._marks.append((a, b))
                return out
            t0 = clock.now()
            out = fn(hidden)
            self._s += clock.now() - t0
            return out
        return timed

    def take(self) -> float:
        s = self._s + sum(a.elapsed_time(b) / 1e3 for a, b in self._marks)
        self._s, self._marks = 0.0, []
        return s


# ---- copies ----------------------------------------------------------------------------------------------

def copy_cases(bench: Bench, grid: Grid) -> list[Case]:
    """h2d and d2h of `bytes` bytes: pinned host memory to and from the device (CPU device: a memcpy)."""
    pinned = bench.device.type == "cuda"
    out = []
    for module in ("h2d", "d2h"):
        for n in grid.copy_bytes:
            def setup(n=n, module=module):
                host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
                host.fill_(1)
                dev = torch.ones(n, dtype=torch.uint8, device=bench.device)
                src, dst = (host, dev) if module == "h2d" else (dev, host)
                return (lambda: dst.copy_(src, non_blocking=pinned)), (lambda: None)
            out.append(Case(module, {"bytes": n}, setup))
    return out
