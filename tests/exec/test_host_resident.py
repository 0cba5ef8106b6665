"""Host-resident decode on real tensors: a step whose KV is restored layer by layer from the host pool into
staging pages (or attended on the host CPU) equals, bit for bit, the same step over device pages; and the
staging buffers are allocated once."""

from __future__ import annotations

import pytest
import torch

from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import ExecModelConfig, init_random
from batchgen.exec.runner import InstanceRunner, RankBatch
from batchgen.specs import load_model

PAGE = 4
# The runner orders each residency group by context; host_mask (True, False, True, False) with the longest
# prompts host-resident keeps both runs' micro-batches and token order the same, so results compare bit for bit.
PROMPTS = ([3, 3, 8, 1, 4, 4, 4, 4, 2, 6, 1], [5, 9, 2, 7, 1], [2, 2, 9, 9, 1, 5, 3, 8], [7])
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mla_config() -> ExecModelConfig:
    return ExecModelConfig(architecture="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4,
                           num_kv_heads=4, head_dim=8, intermediate_size=48, num_experts=4, top_k=2,
                           moe_intermediate_size=16, mlp_only_layers=(0,), q_lora_rank=16, kv_lora_rank=16,
                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_shared_experts=1, n_group=2,
                           topk_group=1, rope_interleave=True, max_position_embeddings=64)


@pytest.fixture(scope="module", params=["gqa", "mla"])
def model(request):
    config = ExecModelConfig.from_spec(load_model("tiny_moe")) if request.param == "gqa" else mla_config()
    return init_random(config, seed=3, std=0.1)


def new_cache(model, num_pages=64, max_context=None) -> PagedKVCache:
    return PagedKVCache(**model.kv_cache_geometry()._asdict(), page_size=PAGE, num_pages=num_pages,
                        host_pages=2, max_context=max_context)


def run(runner, cache, ids, tokens, starts, host, micro_batch, cpu_attention=False):
    batch = RankBatch(cache, list(ids), [t for seq in tokens for t in seq], [len(t) for t in tokens], list(starts),
                      list(host))
    logits, stats = runner.forward([batch], micro_batch, cpu_attention)
    return logits[0], stats


def decode_both(model, host_mask, micro_batch, cpu_attention=False):
    """The same prompts and greedy decode in two caches: all device-resident in one, with the sequences of
    `host_mask` host-resident (host-only, restored per layer) in the other. Returns the caches and the logits."""
    runner = InstanceRunner(model)
    ref, hr = new_cache(model), new_cache(model, max_context=32)
    ids = list(range(len(PROMPTS)))
    host = [host_mask[s] for s in ids]
    prompts = [PROMPTS[s] for s in ids]
    starts = [0] * len(ids)
    logits = [run(runner, c, ids, prompts, starts, [False] * len(ids), micro_batch)[0] for c in (ref, hr)]
    assert torch.equal(logits[0], logits[1])
    hr.yield_to_host([s for s, h in zip(ids, host) if h])
    steps_ref, steps_hr = [], []
    last = logits[0].argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    for _ in range(STEPS):
        a, _ = run(runner, ref, ids, [[t] for t in last], lens, [False] * len(ids), micro_batch)
        b, stats = run(runner, hr, ids, [[t] for t in last], lens, host, micro_batch, cpu_attention)
        steps_ref.append(a)
        steps_hr.append(b)
        assert stats.host_resident == sum(host_mask)
        last = a.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    by_id = dict(zip(ids, lens))
    return ref, hr, steps_ref, steps_hr, [by_id[s] for s in range(len(PROMPTS))]


def kv_of(cache, sid, length, host):
    pools = cache.host_layer if host else cache.layer
    pages = cache.host_pages(sid) if host else cache.pages(sid)
    n = -(-length // cache.page_size)
    idx = torch.tensor(pages[:n])
    return torch.stack([torch.cat([pool[idx].flatten(0, 1)[:length] for pool in pools(l)], -1)
                        for l in range(cache.num_layers)])


@pytest.mark.parametrize("host_mask,micro_batch", [((True,) * 4, 0), ((True,) * 4, 3), ((True, False, True, False), 1)])
def test_staged_host_resident_step_equals_device_step(model, host_mask, micro_batch):
    """Same sequences, same micro-batches: logits and the KV written back to the host copy are bit-identical
    to the device-resident run's (mixed device/host residency in one rank included)."""
    ref, hr, a, b, lens = decode_both(model, host_mask, micro_batch)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for sid, (h, n) in enumerate(zip(host_mask, lens)):
        assert hr.on_device(sid) == (not h)
        assert (hr.synced_tokens(sid) if h else hr.device_tokens(sid)) == n
        assert torch.equal(kv_of(hr, sid, n, host=h), kv_of(ref, sid, n, host=False))
    hr.check()
    if any(host_mask):
        staged = sum(host_mask) if micro_batch == 0 else micro_batch
        assert hr.staging.allocations == 1  # sized once, for B_attn sequences of the longest context
        assert hr.staging.pages >= min(staged, sum(host_mask)) * (32 // PAGE)
    assert hr.host_capacity_pages() > 2  # the host pool grew from its tiny start


def test_cpu_attention_on_the_host_pool_equals_device_step(model):
    if model.config.is_mla:
        with pytest.raises(ValueError, match="CPU attention needs GQA"):
            decode_both(model, (True,) * 4, 2, cpu_attention=True)
        return
    ref, hr, a, b, lens = decode_both(model, (True, False, True, False), 2, cpu_attention=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert hr.staging is None  # nothing staged: attention read the host pool itself
    for sid, n in enumerate(lens):
        assert torch.equal(kv_of(hr, sid, n, host=sid % 2 == 0), kv_of(ref, sid, n, host=False))


def test_prepare_host_refuses_what_would_lose_kv():
    cache = PagedKVCache(2, 2, 4, page_size=PAGE, num_pages=8)
    cache.prepare([1, 2], [5, 3], [0, 0])
    with pytest.raises(ValueError, match="holds device pages"):
        cache.prepare_host([1], [1], [5])
    cache.yield_to_host([1, 2])
    with pytest.raises(ValueError, match="start at position 4 but its host KV holds 5"):
        cache.prepare_host([1], [1], [4])
    with pytest.raises(KeyError, match="sequence 9"):
        cache.prepare_host([9], [1], [0])
    meta = cache.prepare_host([1, 2], [1, 2], [5, 3])
    assert meta.positions.tolist() == [5, 3, 4] and meta.context_lens.tolist() == [6, 5]
    assert meta.block_table.tolist() == [cache.host_pages(1), cache.host_pages(2)]
    for action in (lambda: cache.prepare_host([1], [1], [5]), lambda: cache.restore([1]),
                   lambda: cache.export(2)):
        with pytest.raises(ValueError, match="host-resident step"):
            action()
    cache.host_advance([1, 2])
    assert (cache.synced_tokens(1), cache.synced_tokens(2)) == (6, 5)
    with pytest.raises(ValueError, match="not in a host-resident step"):
        cache.host_advance([1])
    assert cache.used_pages() == 0
    cache.check()
