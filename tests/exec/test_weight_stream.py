"""Weight streaming saves device memory for real (batchgen.exec.weight_stream): streamed weights live only in
host copies, the device holds two staging slots that the streamed layers' parameters view, and a forward
through the slots equals one with every weight resident. The memory plan decides what streams, and the
device-memory check counts what the streamer allocates."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from batchgen.exec.fits import check_fits
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import ExecModelConfig, init_random
from batchgen.exec.run import ExecSettings, execute
from batchgen.exec.runner import InstanceRunner, RankBatch
from batchgen.exec.weight_stream import StreamSpec, footprint, meta_model, stream_onto, stream_spec_of
from batchgen.job import prepare
from batchgen.memory import ConfigError, MemorySettings
from batchgen.specs import load_model
from conftest import make_job

from .test_host_resident import mla_config

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ([3, 3, 8, 1, 4, 4, 4, 4, 2, 6, 1], [5, 9, 2, 7, 1], [2, 2, 9, 9, 1, 5, 3, 8], [7])
EXPERTS_ALL = StreamSpec(whole=False, moe_layers=4, of_moe_layers=4)
WHOLE = StreamSpec(whole=True, moe_layers=4, of_moe_layers=4)


def tiny_config() -> ExecModelConfig:
    return ExecModelConfig.from_spec(load_model("tiny_moe"))


def storages(tensors) -> dict[int, int]:
    """Distinct storages backing `tensors`: data pointer -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def streamed_params(model, spec):
    from batchgen.exec.weight_stream import streamed_parameters
    return [p for _, params in streamed_parameters(model, spec) for p in params]


def greedy(model, streamer, steps=4, device="cpu"):
    """Prompts, then `steps` greedy decode tokens, through the runner (which acquires each streamed layer)."""
    cache = PagedKVCache(**model.kv_cache_geometry()._asdict(), page_size=4, num_pages=64, device=device)
    runner = InstanceRunner(model, streamer=streamer)
    ids, tokens, starts = list(range(len(PROMPTS))), [list(p) for p in PROMPTS], [0] * len(PROMPTS)
    out, moved = [], 0
    for _ in range(steps):
        batch = RankBatch(cache, ids, [t for seq in tokens for t in seq], [len(t) for t in tokens], starts)
        logits, stats = runner.forward([batch], 2, ffn_schedule="micro_batch")
        moved += stats.weight_bytes
        out.append(logits[0])
        starts = [s + len(t) for s, t in zip(starts, tokens)]
        tokens = [[int(i)] for i in logits[0].argmax(-1)]
    return torch.cat(out), moved


@pytest.mark.parametrize("config,spec", [(tiny_config, EXPERTS_ALL), (tiny_config, WHOLE), (mla_config, WHOLE),
                                         (mla_config, StreamSpec(False, 1, 2))])
def test_streamed_weights_are_host_only_and_the_device_holds_two_slots(config, spec):
    ref = init_random(config(), seed=3, std=0.1)
    model = copy.deepcopy(ref)
    before = storages(model.parameters())
    streamer = stream_onto(model, spec, "cpu")
    streamed = streamed_params(model, spec)
    slots = storages(streamer.slots)
    # every streamed parameter is a view into one of the (at most two) slots: their own tensors are gone
    assert storages(streamed) == slots and len(slots) == min(2, len(streamer.order))
    assert sum(slots.values()) == streamer.staging_bytes
    if len(streamer.order) > 2:  # a saving, not a copy (one or two streamed layers fill their slots exactly)
        assert sum(p.numel() * p.element_size() for p in streamed) > streamer.staging_bytes
    # the resident weights keep their own storages; the host copies are separate tensors from the slots
    resident = [p for p in model.parameters() if all(p is not q for q in streamed)]
    assert not set(storages(resident)) & set(slots)
    assert not set(storages(streamer.host)) & (set(slots) | set(storages(resident)))
    after = storages(model.parameters())
    print(f"\n{spec}: device parameter bytes {sum(before.values()):,} -> {sum(after.values()):,} "
          f"(staging {streamer.staging_bytes:,}, host copies {sum(h.numel() for h in streamer.host):,})")
    assert sum(after.values()) == sum(before.values()) - sum(p.numel() * p.element_size() for p in streamed) \
        + streamer.staging_bytes
    # what the fits check counts before building is what the streamer allocated
    fp = footprint(meta_model(config(), torch.float32), spec)
    assert (fp.staging_bytes, fp.host_bytes) == (streamer.staging_bytes, sum(h.numel() for h in streamer.host))
    # outputs: equal to the all-resident model's, every streamed layer copied once per forward
    want, _ = greedy(ref, None)
    got, moved = greedy(model, streamer)
    assert torch.equal(got, want)
    assert moved == 4 * fp.host_bytes


def test_a_slot_holds_garbage_until_its_layer_is_acquired():
    """The parameters view the slots only: overwrite the slots and the weights are gone until acquired."""
    model = init_random(tiny_config(), seed=3, std=0.1)
    streamer = stream_onto(model, EXPERTS_ALL, "cpu")
    streamer.begin()
    streamer.acquire(0)  # layer 0 in slot 0, layer 1 prefetched into slot 1
    w = model.moe(0).w_gate
    assert torch.equal(model.moe(0).w_gate, streamer.host[0][:w.numel() * 4].view(torch.float32).view(w.shape))
    for s in streamer.slots:
        s.zero_()
    assert not model.moe(0).w_gate.any() and not model.moe(2).w_up.any()  # layers 0 and 2 share slot 0
    with pytest.raises(RuntimeError, match="never acquired"):
        streamer.finish()  # layer 1's prefetch is left over


def rig(policy: str, gpu_gb: float, **knobs):
    """tiny_moe on 2 GPUs of `gpu_gb` GB (no fixed reserve): at 0.03 GB the plan streams every MoE layer's
    experts (32.5 MB of weights per GPU do not fit; 20 MB with two layers' experts do), at 80 GB nothing."""
    job = make_job(policy, model="tiny_moe", inputs=np.array([9, 14, 5, 12, 7, 3]), outputs=np.array([5, 3, 6, 4, 2, 5]),
                   page_tokens=8, cluster_overrides={"num_gpus": 2}, policy_overrides=knobs)
    c = job.cluster
    gpu = dataclasses.replace(c.gpu, hbm_gb=gpu_gb, memory_mib=gpu_gb * 1e9 / 2**20)
    return dataclasses.replace(job, cluster=dataclasses.replace(c, gpu=gpu),
                               memory=MemorySettings(activation_reserve_gb=0))


def test_the_memory_plan_decides_what_streams_and_the_executor_matches_it():
    """A flexgen job whose plan streams the experts equals, token for token, the same job with every weight
    resident; only the streamed run moves weights, one copy of each streamed layer per forward."""
    knobs = {"gpu_batch_size": 2, "num_gpu_batches": 2, "cache_on": "cpu", "cpu_delegation": False}
    small, big = rig("flexgen", 0.03, **knobs), rig("flexgen", 80, **knobs)
    assert stream_spec_of(prepare(small).budget, small.model) == EXPERTS_ALL
    assert stream_spec_of(prepare(big).budget, big.model) is None
    settings = ExecSettings(device="cpu", kv_budget_mb=2)
    streamed, resident = execute(small, settings), execute(big, settings)
    assert streamed.tokens.generated == resident.tokens.generated
    forwards = sum(r.iterations for r in streamed.records)
    fp = footprint(meta_model(tiny_config(), torch.float32), EXPERTS_ALL)
    assert streamed.kv_traffic["weight_bytes"] == forwards * fp.host_bytes
    assert resident.kv_traffic["weight_bytes"] == 0


def test_deepseek_v2_on_an_a5000_streams_whole_layers():
    from batchgen.specs import load_cluster
    job = dataclasses.replace(make_job("zero_inference", model="deepseek_v2", n=4, inputs=np.full(4, 64),
                                       outputs=np.full(4, 16)), cluster=load_cluster("a5000_1"))
    budget = prepare(job).budget
    assert budget.whole_layers and stream_spec_of(budget, job.model).whole


def test_fits_counts_streamed_weights_as_host_copies_and_device_slots():
    job = make_job("flexgen", model="tiny_moe", n=4)
    fp = footprint(meta_model(tiny_config(), torch.float32), EXPERTS_ALL)
    weights = job.model.total_params * 4
    device_need = weights - fp.streamed_bytes + fp.staging_bytes
    cuda = torch.device("cuda")
    free = {cuda: int((device_need + 2**20) / 0.9 + 2**20), torch.device("cpu"): int(fp.host_bytes / 0.9) + 2**20}
    fits = dict(job=job, model_path=None, kv_budget_mb=1, devices=[cuda], dtype=torch.float32,
                ranks_per_instance=1, free=free.get)
    with pytest.raises(ConfigError, match="KV budget"):  # all resident: the device is too small
        check_fits(**fits)
    check_fits(**fits, streamed=fp)  # streamed: the slots fit on the device, the copies on the host
    free[torch.device("cpu")] = int(fp.host_bytes / 2)
    with pytest.raises(ConfigError, match="host copies"):  # ... but not a host too small for the copies
        check_fits(**fits, streamed=fp)
    # a CPU device is the host: the resident weights, the slots and the host copies all count there
    cpu_fits = dict(fits, devices=[torch.device("cpu")],
                    free=lambda d: int((device_need + fp.host_bytes + 2**20) / 0.9) - 2**18)
    with pytest.raises(ConfigError):
        check_fits(**cpu_fits, streamed=fp)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", [EXPERTS_ALL, WHOLE])
def test_cuda_streaming_pinned_side_stream_equals_resident(spec):
    """On CUDA: pinned host copies, copies on a side stream, the next layer prefetched; greedy logits equal the
    all-resident model's on the same device, and the device holds only the slots for the streamed weights."""
    ref = init_random(tiny_config(), seed=3, std=0.1, device="cuda")
    model = init_random(tiny_config(), seed=3, std=0.1)  # built on the CPU: the streamed part never on the GPU
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    streamer = stream_onto(model, spec, "cuda")
    assert all(h.is_pinned() for h in streamer.host) and streamer.stream is not None
    assert storages(streamed_params(model, spec)) == storages(streamer.slots)
    fp = footprint(meta_model(tiny_config(), torch.float32), spec)
    grown = torch.cuda.memory_allocated() - base
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert grown <= full - fp.streamed_bytes + fp.staging_bytes + 2**20  # the allocator rounds up a little
    want, _ = greedy(ref, None, device="cuda")
    got, moved = greedy(model, streamer, device="cuda")
    assert torch.equal(got, want) and moved == 4 * fp.host_bytes
