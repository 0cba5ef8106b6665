"""What batch-invariant mode (backend.batch_invariant, batchgen/exec/models/invariant.py) costs against the
default, on the model forward the executor runs: a prefill step and a decode step, one torch thread.

    python benchmarks/batch_invariant.py [--hidden 128] [--layers 2] [--experts 4] [--prompts 8]
        [--prompt-len 96] [--decode-batch 64] [--context 320] [--rounds 5]

The default model is the demo model's shape (`python -m batchgen.batch.demo`). Each round times both modes on the
same weights, tokens and KV pages, alternating, and the median of the rounds is kept (another load on the machine
only slows a run down). Last line: `ratio_prefill=<invariant/default> ratio_decode=<invariant/default>`.
Recorded results: benchmarks/results/batch_invariant.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.exec.metadata import AttentionMetadata
from batchgen.exec.models import ExecModelConfig, init_random, invariant

PAGE = 16


def metadata(ctx_lens: list[int], new: list[int]) -> AttentionMetadata:
    """Sequence b owns pages b*W .. b*W+W-1 and adds new[b] tokens ending at ctx_lens[b]."""
    width = max((c + PAGE - 1) // PAGE for c in ctx_lens)
    positions, slots, starts = [], [], [0]
    for b, (c, n) in enumerate(zip(ctx_lens, new)):
        for p in range(c - n, c):
            positions.append(p)
            slots.append((b * width + p // PAGE) * PAGE + p % PAGE)
        starts.append(starts[-1] + n)
    table = [[b * width + i for i in range(width)] for b in range(len(ctx_lens))]
    return AttentionMetadata(torch.tensor(positions), torch.tensor(starts), torch.tensor(ctx_lens),
                             torch.tensor(table), torch.tensor(slots), PAGE)


@torch.no_grad()
def time_step(model, pools, ids, meta, on: bool) -> float:
    with invariant.mode(on):
        t0 = time.perf_counter()
        model(ids, meta, pools)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    heads = max(2, a.hidden // 32)
    cfg = ExecModelConfig(architecture="mixtral", vocab_size=512, hidden_size=a.hidden, num_layers=a.layers,
                          num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=32, num_experts=a.experts,
                          top_k=2, moe_intermediate_size=2 * a.hidden, rope_theta=1e6, rms_norm_eps=1e-5)
    model = init_random(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    steps = {
        "prefill": ([a.prompt_len] * a.prompts, [a.prompt_len] * a.prompts),
        "decode": ([a.context - (b * 7) % 64 for b in range(a.decode_batch)], [1] * a.decode_batch),
    }
    ratios = {}
    for name, (ctx, new) in steps.items():
        meta = metadata(ctx, new)
        pages = len(ctx) * int(meta.block_table.shape[1])
        pools = [(torch.randn(model.kv_cache_shape(pages, PAGE), generator=gen) * 0.1,
                  torch.randn(model.kv_cache_shape(pages, PAGE), generator=gen) * 0.1) for _ in range(a.layers)]
        ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=gen)
        time_step(model, pools, ids, meta, False)  # warm both paths
        time_step(model, pools, ids, meta, True)
        runs = {False: [], True: []}
        for r in range(a.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                runs[on].append(time_step(model, pools, ids, meta, on))
        base, inv = statistics.median(runs[False]), statistics.median(runs[True])
        ratios[name] = inv / base
        print(f"{name}: {sum(new)} tokens, default {base * 1e3:.1f} ms, batch-invariant {inv * 1e3:.1f} ms, "
              f"ratio {inv / base:.2f}", flush=True)
    print(f"ratio_prefill={ratios['prefill']:.2f} ratio_decode={ratios['decode']:.2f}")


if __name__ == "__main__":
    main()
