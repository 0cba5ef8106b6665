"""What the profiler measures: grids of module shapes, named (quick, full, test).

Decode attention is measured over batches x longest contexts, each with equal contexts and with contexts
spread from half the longest to the longest (so that the sum and the maximum differ: the executor's padded
attention pays the maximum); prefill over prompts per call x prompt lengths, equal and spread too. FFN-like
modules over tokens at the gate, the LM head (with sampling) over sampled rows, the per-forward overhead over
decode batches, copies over bytes. Everything is clipped to the model's context and a token budget, so one
grid serves tiny and large models.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    name: str
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_micro_batches: tuple[tuple[int, int, int], ...]  # (sequences, longest context, micro-batches)
    prefill_prompts: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    ffn_tokens: tuple[int, ...]
    lm_head_tokens: tuple[int, ...]
    step_batches: tuple[int, ...]
    step_context: int
    copy_bytes: tuple[int, ...]
    max_kv_tokens: int = 1 << 17        # decode: sequences x longest context at most this
    max_prefill_tokens: int = 1 << 14   # prefill: tokens of one call at most this
    rounds: int = 2                     # the whole grid is measured this many times, repeats split over them
    # decode points also timed as a layer's later call (equal contexts, up to this many sequences): the runner
    # calls a layer's attention once per run of similar contexts, and the calls after the first find the layer's
    # weights in cache, and run faster (benchmarks/results/validation.md)
    warm_decode_batch: int = 32

    def decode_points(self, max_context: int) -> list[tuple[int, int, str]]:
        """(sequences, longest context, shape) for one-call decode attention; shape equal or spread."""
        out = []
        for ctx in sorted({min(c, max_context) for c in self.decode_contexts}):
            for b in self.decode_batches:
                if b * ctx > self.max_kv_tokens:
                    continue
                out.append((b, ctx, "equal"))
                if b > 1 and ctx >= 4:
                    out.append((b, ctx, "spread"))
        return out

    def prefill_points(self, max_context: int) -> list[tuple[int, int, str]]:
        out = []
        for length in sorted({min(n, max_context) for n in self.prefill_lengths}):
            for n in self.prefill_prompts:
                if n * length > self.max_prefill_tokens:
                    continue
                out.append((n, length, "equal"))
                if n > 1 and length >= 4:
                    out.append((n, length, "spread"))
        return out


def contexts_of(count: int, longest: int, shape: str) -> list[int]:
    """`count` context lengths whose maximum is `longest`: all equal, or spread evenly from half of it."""
    if shape == "equal" or count == 1:
        return [longest] * count
    low = max(1, longest // 2)
    return [low + (longest - low) * i // (count - 1) for i in range(count)]


GRIDS = {
    "quick": Grid("quick", decode_batches=(1, 4, 16, 32, 64, 128), decode_contexts=(64, 256, 512, 1024, 2048),
                  decode_micro_batches=((64, 256, 2), (64, 256, 4), (16, 1024, 2)),
                  prefill_prompts=(1, 4, 16), prefill_lengths=(64, 256, 1024),
                  ffn_tokens=(1, 4, 16, 64, 256, 1024, 4096), lm_head_tokens=(1, 4, 16, 64, 256),
                  step_batches=(1, 4, 16, 64), step_context=256,
                  copy_bytes=(1 << 16, 1 << 20, 1 << 24, 1 << 26), rounds=3),
    "full": Grid("full", decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                 decode_contexts=(16, 64, 128, 256, 512, 1024, 2048, 4096),
                 decode_micro_batches=((64, 256, 2), (64, 256, 4), (128, 512, 4), (16, 1024, 2)),
                 prefill_prompts=(1, 2, 4, 8, 16, 32), prefill_lengths=(16, 64, 128, 256, 512, 1024, 2048),
                 ffn_tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
                 lm_head_tokens=(1, 4, 16, 64, 128, 256, 512), step_batches=(1, 2, 4, 8, 16, 32, 64, 128),
                 step_context=256, copy_bytes=(1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28),
                 max_kv_tokens=1 << 19, max_prefill_tokens=1 << 15, rounds=3),
    # seconds, for tests: every module, a handful of points
    "test": Grid("test", decode_batches=(1, 4), decode_contexts=(16, 64), decode_micro_batches=((4, 64, 2),),
                 prefill_prompts=(1, 2), prefill_lengths=(8, 32), ffn_tokens=(1, 8, 32), lm_head_tokens=(1, 4),
                 step_batches=(1, 4), step_context=32, copy_bytes=(1 << 12, 1 << 16), rounds=1),
}


def grid_named(name: str) -> Grid:
    if name not in GRIDS:
        raise ValueError(f"grid={name!r} is not a profiling grid: choose one of {', '.join(GRIDS)}")
    return GRIDS[name]
