"""Cascade attention on the executor (batchgen.exec.models.cascade): a call of decode queries that hold one shared
prefix reads its pages once and merges the two halves by log-sum-exp; the logits are those of attention over
each whole context, for GQA and MLA, whole heads and head shards."""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.core.sequences import InvariantError
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import load_model
from batchgen.exec.models.tensor_parallel import group_attention

from .test_deepseek import tiny_hf as tiny_deepseek
from .test_models import tiny_hf

PAGE, PREFIX, GROUP = 4, 12, 0  # a 12-token prefix: three pages
OWN = (3, 9, 5, 6)              # each member's own prompt tokens past the prefix

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, tmp_path_factory):
    hf = tiny_hf("qwen3_moe") if request.param == "qwen3_moe" else tiny_deepseek()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return load_model(path)


def _layers(cache: PagedKVCache):
    return [cache.layer(layer) for layer in range(cache.num_layers)]


@torch.no_grad()
def _sharers(model) -> tuple[PagedKVCache, list[int], list[int]]:
    """A cache whose sequences 0..3 hold one prefix (0 created it), each prefilled; (cache, ids, context lengths)."""
    cache = PagedKVCache(**model.kv_cache_geometry()._asdict(), page_size=PAGE, num_pages=64)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (PREFIX,), generator=gen)
    ids = list(range(len(OWN)))
    for sid, n in zip(ids, OWN):
        own = torch.randint(0, 256, (n,), generator=gen)
        cache.share_prefix(sid, GROUP, PREFIX, creates=sid == 0)
        start = 0 if sid == 0 else PREFIX
        tokens = torch.cat([prefix, own])[start:]
        model(tokens, cache.prepare([sid], [len(tokens)], [start]), _layers(cache))
        cache.take_creating()
    return cache, ids, [PREFIX + n for n in OWN]


@torch.no_grad()
def test_a_cascaded_call_gives_the_logits_of_whole_context_attention(model):
    cache, ids, lens = _sharers(model)
    tokens = torch.tensor([5, 17, 99, 3])
    meta = cache.prepare(ids, [1] * len(ids), lens)
    plain = model(tokens, meta, _layers(cache))
    cascaded = model(tokens, cache.cascade_metadata(copy.copy(meta), ids, GROUP), _layers(cache))  # same K/V written
    assert (plain - cascaded).abs().max().item() < 1e-5
    assert torch.equal(plain.argmax(-1), cascaded.argmax(-1))


@torch.no_grad()
def test_head_shards_of_a_tp_attention_group_cascade_alike(model):
    cache, ids, lens = _sharers(model)
    block = model.layers[0]
    hidden = block.input_layernorm(torch.randn(len(ids), model.config.hidden_size, generator=torch.Generator()
                                               .manual_seed(5)))
    meta = cache.prepare(ids, [1] * len(ids), lens)
    plain = group_attention(block.self_attn, hidden, meta, cache.layer(0), 2)
    cascaded = group_attention(block.self_attn, hidden, cache.cascade_metadata(copy.copy(meta), ids, GROUP),
                               cache.layer(0), 2)
    assert (plain - cascaded).abs().max().item() < 1e-5


@torch.no_grad()
def test_a_cascade_needs_every_member_to_hold_the_prefix_and_one_query_each(model):
    cache, ids, lens = _sharers(model)
    cache.prepare([9], [PREFIX + 2], [0])  # a sequence of its own, no prefix
    meta = cache.prepare([0, 9], [1, 1], [lens[0], PREFIX + 2])
    with pytest.raises(InvariantError, match="does not hold it"):
        cache.cascade_metadata(meta, [0, 9], GROUP)
    with pytest.raises(InvariantError, match="decode queries only"):
        cache.cascade_metadata(cache.prepare([1], [2], [lens[1]]), [1], GROUP)
    with pytest.raises(InvariantError, match="does not hold"):
        cache.cascade_metadata(cache.prepare([2], [1], [lens[2]]), [2], GROUP + 1)
