"""The roofline's formulas for the modules a forward prices per iteration, each written once.

Why one place. `Roofline` prices a one-rank run's iterations on Python floats and every other run on numpy arrays
(batchgen.pricing.price); both call these functions, with `max` or `np.maximum` as `maximum`, so they perform
the same operations in the same order and agree to the bit (IEEE arithmetic is the same in both). A function
takes amounts of work (tokens, context, launches) and the model's and GPU's constants, already achieved (peak x
efficiency); the caller handles empty cells (no token: no cost) and the weight GEMMs' time (`proj`).
"""

from __future__ import annotations


def streaming(flops, bytes_, launches, rate, bw, kernel_s, maximum):
    """A kernel without weights (attention scores over the KV): its FLOPs or its bytes, whichever takes longer,
    plus a launch per call (`rate`: achieved FLOP/s; `bw`: achieved bytes/s)."""
    return maximum(flops / rate, bytes_ / bw) + maximum(launches, 1) * kernel_s


def padded(exact, dense, share, maximum):
    """Work of an attention kernel when `share` of it runs as a dense padded batch (`dense`: queries x the
    longest context); exact for paged / varlen kernels (share 0)."""
    return (1.0 - share) * exact + share * maximum(dense, exact)


def decode_attention(tokens, context, launches, proj, kv_bytes, act_row, score_flops, rate, bw, kernel_s, maximum):
    """Decode attention of `tokens` queries over `context` tokens: the projections (`proj`), every context
    token's KV read once, each query's new KV and its activations written, scores at `score_flops` per context
    token."""
    kv = (context + tokens) * kv_bytes + 2 * tokens * act_row
    return proj + streaming(score_flops * context, kv, launches, rate, bw, kernel_s, maximum)


def prefix_attention(pairs, kv_tokens, launches, kv_bytes, act_row, score_flops, rate, bw, kernel_s, maximum):
    """A cascade's prefix kernel: its members' queries over their shared prefix (`pairs` query-key pairs), the
    prefix's KV read once per call (`kv_tokens`); the projections are the decode attention's."""
    return streaming(score_flops * pairs, kv_tokens * kv_bytes, launches, rate, bw, kernel_s, maximum)


def prefill_attention(tokens, pairs, launches, proj, kv_bytes, act_row, score_flops, rate, bw, kernel_s, maximum):
    """Prefill attention over `tokens` prompt tokens attending `pairs` query-key pairs: each prompt token's KV
    written once."""
    kv = tokens * kv_bytes + 2 * tokens * act_row
    return proj + streaming(score_flops * pairs, kv, launches, rate, bw, kernel_s, maximum)


def lm_head(tokens, proj, vocab, bw, kernel_s):
    """The final projection and sampling: fp32 logits of every row written and read back, one launch."""
    return proj + (2 * tokens * vocab * 4 / bw + kernel_s)


def step_overhead(sequences, step_s, per_sequence_s):
    """The engine's time per forward outside the modules."""
    return step_s + per_sequence_s * sequences
