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

pytestmark = pytest.mark.usefixtures("one_thread")


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
                        host_pages=2, max_context=max_context, device=next(model.parameters()).device)


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
    return torch.stack([torch.cat([pool[idx.to(pool.device)].flatten(0, 1)[:length] for pool in pools(l)], -1)
                        for l in range(cache.num_layers)]).cpu()


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
    device = [sid for sid, h in enumerate(host_mask) if not h]
    hr.yield_to_host(device)  # the host pool grew inside a forward: it must take in-place updates outside one
    for sid in device:
        assert torch.equal(kv_of(hr, sid, lens[sid], host=True), kv_of(ref, sid, lens[sid], host=False))
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


def test_host_micro_batches_are_cut_to_fit_the_staging_buffer(model):
    """A staging buffer of a fixed number of pages: host micro-batches are cut to fit it (by pages, not only
    by B_attn), so the buffers are never reallocated, and the outputs are the device run's."""
    if model.config.is_mla:
        pytest.skip("the cut does not depend on the attention kind")
    runner = InstanceRunner(model)
    ref = new_cache(model)
    hr = PagedKVCache(**model.kv_cache_geometry()._asdict(), page_size=PAGE, num_pages=64, staging_pages=6)
    ids = list(range(len(PROMPTS)))
    for c in (ref, hr):
        run(runner, c, ids, PROMPTS, [0] * 4, [False] * 4, 0)
    hr.yield_to_host(ids)
    lens = [len(p) for p in PROMPTS]  # 11, 5, 8, 1 tokens: 3, 2, 3, 1 pages with the new token (1 + 2 + 3 + 3)
    tokens = [[1], [2], [3], [4]]
    a, _ = run(runner, ref, ids, tokens, lens, [False] * 4, 1)
    b, stats = run(runner, hr, ids, tokens, lens, [True] * 4, 0)
    assert torch.allclose(a, b, atol=1e-5)  # other micro-batches than the reference: equal up to rounding
    assert hr.staging.pages == 6 and hr.staging.allocations == 1
    assert stats.restored_bytes == (1 + 2 + 3 + 3) * hr.layer_page_bytes * hr.num_layers


def test_staging_buffers_come_out_of_the_kv_budget():
    """backend.kv_budget_mb is device memory for KV: a policy that may run sequences host-resident gets a
    smaller paged pool, by the two staging buffers; one that cannot fit them is told how to fix it."""
    import numpy as np

    from batchgen.exec.run import ExecSettings, execute
    from batchgen.memory import ConfigError
    from conftest import make_job

    inputs, outputs = np.array([20, 30, 12, 25]), np.array([6, 9, 4, 12])  # longest 39 tokens: 3 pages of 16
    per_page = 16 * 2 * 2 * 64 * 4  # tiny_moe: one layer of a page, K and V, fp32
    runs = {}
    for residency, attention in (("device", "gpu"), ("host", "cpu"), ("host", "gpu")):
        job = make_job("coroutine", inputs=inputs, outputs=outputs, page_tokens=16,
                       policy_overrides={"b_moe": 4, "b_attn": 2, "kv_residency": residency, "attention": attention})
        out = execute(job, ExecSettings(device="cpu", kv_budget_mb=1.0))
        runs[residency] = out
        if attention == "cpu":  # nothing is staged: the whole budget pages KV
            assert out.prepared.state.gpu_pages[0] == 16 and out.kv_traffic["cpu_attention_seq_steps"] > 0
    pages = {k: int(o.prepared.state.gpu_pages[0]) for k, o in runs.items()}
    assert pages["device"] - pages["host"] == -(-2 * 2 * 3 * per_page // (4 * per_page))  # 2 buffers x 2 x 3
    assert runs["host"].kv_traffic["host_resident_seq_steps"] > 0
    assert [list(g) for g in runs["host"].tokens.generated] == [list(g) for g in runs["device"].tokens.generated]
    with pytest.raises(ConfigError, match="staging buffers of host-resident decode take"):
        execute(job, ExecSettings(device="cpu", kv_budget_mb=2 * 2 * 3 * per_page / 2**20))
    with pytest.raises(ConfigError, match="cannot hold the longest sequence"):
        execute(job, ExecSettings(device="cpu", kv_budget_mb=1.0, staging_mb=0.01))


def test_host_pool_grown_inside_a_forward_takes_updates_outside_one():
    """The runner calls prepare_host under inference mode; a host pool that grows there must not become an
    inference tensor, or the next YIELD (outside any forward) could not write into it."""
    cache = PagedKVCache(2, 2, 4, page_size=PAGE, num_pages=8, host_pages=2)
    cache.prepare([1, 2], [8, 3], [0, 0])
    cache.yield_to_host([1])                 # two host pages: the pool is full
    with torch.inference_mode():
        cache.prepare_host([1], [1], [8])    # a third page: the pool doubles here
        cache.host_advance([1])
    assert cache.host_capacity_pages() == 4
    cache.yield_to_host([2])                 # into the pool grown above
    cache.check()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("host_mask,micro_batch,cpu_attention", [((True,) * 4, 1, False),
                                                                  ((True, False, True, False), 2, False),
                                                                  ((True, False, True, False), 2, True)])
def test_host_resident_on_cuda_equals_device_resident(model, host_mask, micro_batch, cpu_attention):
    """On CUDA: pinned host pool, restores through pinned bounce buffers on a side stream, ordered by events,
    two buffers reused across micro-batches and layers: bit-identical to device-resident attention. CPU
    attention (q, k, v to the host, the output back) agrees to rounding."""
    import copy
    if cpu_attention and model.config.is_mla:
        pytest.skip("CPU attention is GQA/MHA only")
    gpu = copy.deepcopy(model).to("cuda")
    ref, hr, a, b, lens = decode_both(gpu, host_mask, micro_batch, cpu_attention)
    for x, y in zip(a, b):
        if cpu_attention:
            assert torch.allclose(x, y, atol=1e-4) and torch.equal(x.argmax(-1), y.argmax(-1))
        else:
            assert torch.equal(x, y)
    assert hr.host_layer(0)[0].is_pinned()
    for sid, (h, n) in enumerate(zip(host_mask, lens)):
        got, want = kv_of(hr, sid, n, host=h), kv_of(ref, sid, n, host=False)
        assert torch.allclose(got, want, atol=1e-5) if cpu_attention else torch.equal(got, want)
    hr.check()


def test_a_staged_steps_restores_are_not_counted_as_its_attention(model, monkeypatch):
    """The runner times attention apart from the copies around it (the simulator prices restores and appends as
    their own nodes): a slow restore leaves the step's attention time alone."""
    import time

    from batchgen.exec import staging

    restore = staging.StagingArea.restore
    monkeypatch.setattr(staging.StagingArea, "restore",
                        lambda self, *a: (time.sleep(0.05), restore(self, *a))[1])
    runner = InstanceRunner(model)
    cache = new_cache(model, max_context=32)
    ids, prompts = list(range(len(PROMPTS))), list(PROMPTS)
    run(runner, cache, ids, prompts, [0] * len(ids), [False] * len(ids), 2)
    cache.yield_to_host(ids)
    _, stats = run(runner, cache, ids, [[1]] * len(ids), [len(p) for p in prompts], [True] * len(ids), 2)
    restores = 2 * model.config.num_layers  # two micro-batches of two, every layer
    assert stats.host_resident == len(ids)
    assert sum(stats.rank_attention_s) < 0.05 * (restores - 1) / 4
