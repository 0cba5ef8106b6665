"""PD-disaggregation (`pd_disagg`) in the simulator: prefill and decode on separate units, the KV shipped
between them priced on the network, back-pressure when the decode side is full, and bad layouts refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchgen.memory import ConfigError
from batchgen.sim.run import simulate
from conftest import make_job


def _job(n=120, units=(1, 3), num_gpus=16, **knobs):
    rng = np.random.default_rng(0)
    return make_job("pd_disagg", "qwen3_30b_a3b", "h20_16", inputs=rng.integers(200, 2000, n),
                    outputs=rng.integers(20, 400, n), cluster_overrides={"num_gpus": num_gpus},
                    policy_overrides={"prefill_units": units[0], "decode_units": units[1], **knobs})


def test_prefill_units_only_prefill_and_decode_units_only_decode():
    out = simulate(_job(units=(1, 3)), progress=False)  # 16 GPUs: four units of 4, one prefilling
    state, t = out.prepared.state, out.prepared.state.table
    assert state.topo.num_instances == 4 and out.prepared.cluster.instance_size == 4
    phases = {i: {r.phase for r in out.records if r.instance == i} for i in range(4)}
    assert phases[0] == {"prefill"}
    assert all(phases[i] <= {"decode", "mixed", "prefill"} and "decode" in phases[i] for i in (1, 2, 3))
    assert np.all(t.instance >= 1)  # every sequence finished on a decode unit
    decoded_somewhere = t.output_len > 1
    # prefill GPUs (node 0) and decode GPUs (node 1 for units 2, 3) are on different nodes for half the units:
    assert t.migrations[decoded_somewhere].sum() > 0
    # whole prompts are prefilled on the prefill unit only: the decode units prefill only what they preempted
    for r in out.records:
        if r.instance and r.decision is not None and r.decision.chunked:
            assert np.all(t.recomputes[list(r.decision.chunked)] > 0)


def test_the_shipped_kv_is_priced_on_the_network():
    """The same job with a 100x slower inter-node network takes longer: the KV each decode unit on the other
    node admits is a MIGRATE whose bytes the run that admits it pays for."""
    fast = _job(units=(2, 2))  # 16 GPUs, units of 4: prefill on node 0, decode on node 1: every shipment crosses
    gpu = fast.cluster.gpu
    slow = dataclasses.replace(fast, cluster=dataclasses.replace(
        fast.cluster, gpu=dataclasses.replace(gpu, network_gbs=gpu.network_gbs / 100)))
    a, b = simulate(fast, progress=False), simulate(slow, progress=False)
    t = a.prepared.state.table
    assert np.all(t.migrations[t.output_len > 1] == 1)  # each decoded sequence crossed once
    bct = lambda out: out.prepared.state.table.finish_time.max()  # noqa: E731
    assert bct(b) > 1.05 * bct(a)


def test_a_full_decode_side_stalls_prefill():
    """Back-pressure: the prefill unit holds at most hold_share x its KV pool of prefilled, unshipped KV; with a
    decode side of a few slots it waits (idle between prefills) instead of running ahead."""
    job = _job(n=80, units=(1, 1), num_gpus=2, max_running=2, hold_share=0.002)
    out = simulate(job, progress=False)
    state = out.prepared.state
    pool_tokens = int(state.gpu_pages[0]) * state.page_tokens
    bound = max(0.002 * pool_tokens, int(state.table.context(np.arange(80)).max()) + 1)
    # one node holds both units here: its host KV is the prefill pool (the decode side keeps no host copy)
    assert state.peak_host[0] <= bound
    prefill = [r for r in out.records if r.instance == 0]
    span = prefill[-1].start + prefill[-1].duration
    assert sum(r.duration for r in prefill) < 0.5 * span  # the prefill unit mostly waited for the decode side


def test_decode_units_wait_idle_for_kv_when_prefill_is_the_bottleneck():
    """1 prefill unit feeding 3 decode units: the decode side runs far less than the span of the job."""
    out = simulate(_job(units=(1, 3)), progress=False)
    end = max(r.start + r.duration for r in out.records)
    for i in (1, 2, 3):
        busy = sum(r.duration for r in out.records if r.instance == i)
        assert busy < 0.9 * end


@pytest.mark.parametrize("knobs,num_gpus,match", [
    ({"prefill_units": 3, "decode_units": 2, "unit_gpus": 4}, 16, "do not make up"),
    ({"prefill_units": 1, "decode_units": 1}, 1, "do not make up"),
    ({"prefill_units": 1, "decode_units": 1}, 24, "whole number of nodes"),  # units of 12 on 8-GPU nodes
])
def test_layouts_that_do_not_fit_the_cluster_are_refused(knobs, num_gpus, match):
    from batchgen.job import prepare
    job = make_job("pd_disagg", "qwen3_30b_a3b", "h20_16", n=4, cluster_overrides={"num_gpus": num_gpus},
                   policy_overrides=knobs)
    with pytest.raises((ConfigError, ValueError), match=match):
        prepare(job)


def test_a_dense_model_is_refused():
    from batchgen.job import prepare
    with pytest.raises(ConfigError, match="dense"):
        prepare(make_job("pd_disagg", "llama2_7b", "h100_8", n=4))
