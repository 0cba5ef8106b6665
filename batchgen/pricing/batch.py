"""A plan's whole batch, predicted: its prompts prefilled in forwards of the planned chunk, then its outputs
decoded at the plan's throughput over the batch's waves. The decode plan alone cannot compare instance sizes:
a larger instance batches more tokens per expert in decode, but pays a wider all-to-all on every prompt token
too, and in long-prompt jobs prefill is a third of the time or more."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.pricing.costs import prefill_load
from batchgen.pricing.price import price

_NONE = np.empty(0, np.int64)


@dataclass(frozen=True)
class BatchTime:
    """Predicted seconds of one job on a plan: prefill and decode, one after the other (they share the GPUs)."""

    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def prefill_forward_s(lat: LatencyModel, ranks: int, prompts_per_rank: int, prompt_len: float,
                      micro_batch: int, weight_stream_s: float = 0.0, dp_stream_s: float | None = None) -> float:
    """Seconds of one prefill forward in which every rank of the instance prefills `prompts_per_rank` whole
    prompts of `prompt_len` tokens, priced as the simulator prices it (batchgen.pricing.price; `dp_stream_s`: a
    data-parallel prefill's copy per MoE layer, None for an expert-parallel one)."""
    rank = np.repeat(np.arange(ranks), prompts_per_rank)
    load = prefill_load(rank, np.full(rank.size, float(prompt_len)), _NONE, np.empty(0), ranks, micro_batch)
    return float(price(lat, load, weight_stream_s, dp_stream_s=dp_stream_s).iteration_s[0])


def batch_time(lat: LatencyModel, *, sequences: int, mean_input: float, mean_output: float, ranks: int,
               instances: int, chunk: int, micro_batch: int, decode_tokens_per_s: float,
               weight_stream_s: float = 0.0, dp_stream_s: float | None = None) -> BatchTime:
    """`sequences` spread evenly over `instances` of `ranks` ranks each: every rank prefills as many whole
    prompts of the mean length as its `chunk` of tokens holds (at least one) per forward, and the instances
    decode the outputs at `decode_tokens_per_s` each."""
    per_forward = max(1, int(chunk // max(mean_input, 1.0)))
    forwards = math.ceil(sequences / (per_forward * ranks * instances))
    prefill = forwards * prefill_forward_s(lat, ranks, per_forward, mean_input, micro_batch, weight_stream_s,
                                           dp_stream_s)
    decode = sequences * mean_output / (decode_tokens_per_s * instances) if decode_tokens_per_s > 0 else math.inf
    return BatchTime(prefill, decode)
