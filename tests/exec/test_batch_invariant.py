"""Batch-invariant mode (models/invariant.py): a token's logits are bitwise the same computed in one prefill of
its whole context as computed by decode steps beside other sequences of varying number and length; in the
default mode they are not (the reason the mode exists)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.exec.models import ExecModelConfig, init_random, invariant

from .test_models import ToyPagedCache

CONFIG = ExecModelConfig(architecture="mixtral", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, num_experts=4, top_k=2, moe_intermediate_size=256,
                         rope_theta=1e6, rms_norm_eps=1e-5)
PROMPT, DECODED = 23, 70  # the decoded part crosses a TILE boundary of the key padding


def test_a_rows_result_does_not_depend_on_its_tile_or_batch():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(150, 128, generator=gen)
    with invariant.mode(True):
        alone = torch.cat([invariant.linear(x[i:i + 1], w, b) for i in range(len(x))])
        for n in (2, 5, 63, 64, 65, 150):
            assert torch.equal(invariant.linear(x[:n], w, b), alone[:n]), n
        assert torch.equal(invariant.linear(x[7:], w, b), alone[7:])  # each row at another place in its tile
    assert not torch.equal(F.linear(x[:1], w, b), F.linear(x[:64], w, b)[:1])  # why: a 1-row GEMM differs


@torch.no_grad()
def _prefill_vs_decode(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of sequence 0's last DECODED positions: from one prefill of its whole context, and from a
    prefill of its prompt then one decode step per token beside 0 to 6 other sequences (some mid-prefill)."""
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(0, CONFIG.vocab_size, (PROMPT + DECODED,), generator=gen)
    whole = ToyPagedCache(model, 1, PROMPT + DECODED)
    ref = model(toks, whole.meta([0], [len(toks)]), whole.pools)[PROMPT - 1:-1]

    others = 6
    cache = ToyPagedCache(model, 1 + others, PROMPT + DECODED + 40)
    first = torch.randint(0, CONFIG.vocab_size, (9,), generator=gen)
    model(torch.cat([toks[:PROMPT - 1], first]), cache.meta([0, 1], [PROMPT - 1, 9]), cache.pools)
    cache.advance([0, 1], [PROMPT - 1, 9])
    got = []
    for i in range(DECODED):
        company = [1 + j for j in range(i % (others + 1))]
        new = [1] + [1 + (s * i) % 3 for s in company]  # others decode one token or prefill a chunk
        ids = torch.cat([toks[PROMPT - 1 + i:PROMPT + i]] +
                        [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen) for n in new[1:]])
        logits = model(ids, cache.meta([0] + company, new), cache.pools)
        cache.advance([0] + company, new)
        got.append(logits[0])
    return ref, torch.stack(got)


def test_prefill_equals_decode_in_batch_invariant_mode():
    model = init_random(CONFIG, seed=0)
    with invariant.mode(True):
        ref, got = _prefill_vs_decode(model)
    assert torch.equal(ref, got), f"{(ref != got).any(-1).sum().item()} of {len(ref)} positions differ"


def test_prefill_and_decode_differ_in_the_default_mode():
    """The problem the mode solves, on this machine's kernels (if they ever agree, the mode's cost is moot)."""
    model = init_random(CONFIG, seed=0)
    ref, got = _prefill_vs_decode(model)
    assert torch.allclose(ref, got, atol=1e-4)
    assert not torch.equal(ref, got)


def test_mla_is_refused():
    with pytest.raises(ValueError, match="MLA"):
        invariant.check_supported("deepseek_v3")
