"""Data-parallel prefill (`policy.prefill_parallel=dp`): each rank runs its own prompts through every expert,
streaming in the experts it does not hold, with no all-to-all. Its price, its memory, what the simulator counts,
and the backends and layouts that refuse it."""

import numpy as np
import pytest

from batchgen.engine.loop import check_supported
from batchgen.job import prefill_as_performed, prepare
from batchgen.latency.roofline import Roofline
from batchgen.memory import ConfigError, prefill_ring_bytes, prefill_stream_bytes_per_layer
from batchgen.policy.base import Capabilities
from batchgen.policy.coroutine import CoroutinePolicy
from batchgen.pricing.costs import prefill_load
from batchgen.pricing.price import price
from batchgen.sim.run import simulate
from batchgen.specs import load_cluster, load_model
from conftest import make_job

_NONE = np.empty(0, np.int64)


def _lat(ranks: int = 8) -> Roofline:
    return Roofline(load_model("qwen3_30b_a3b"), load_cluster("h100_8").gpu, ep_ranks=ranks)


def _prefill(lat, prompts_per_rank: int = 4, length: float = 2048.0):
    R = lat.ep_ranks
    rank = np.repeat(np.arange(R), prompts_per_rank)
    return prefill_load(rank, np.full(rank.size, length), _NONE, np.empty(0), R, 64)


def test_local_experts_are_one_gpu_holding_every_expert():
    lat, one = _lat(8), _lat(1)
    tokens = np.array([[512.0, 8192.0]])
    assert np.allclose(lat.local_experts(tokens), one.experts(tokens)[0])
    assert np.allclose(one.local_experts(tokens), one.experts(tokens)[0])


def test_each_moe_layer_takes_the_longer_of_its_compute_and_its_experts_copy():
    """Streaming bound: every MoE layer costs the copy, whatever its compute. Compute bound (no copy): attention,
    router and every expert on the rank's own tokens, and no all-to-all: no collective time at all."""
    lat = _lat(8)
    load = _prefill(lat)
    n_dense, n_moe = lat.layer_counts()
    gate = load.gate_tokens[0, 0]
    attn = float(np.ravel(lat.attention_prefill(load.prefill_tokens, load.prefill_sq, 1.0, load.prefill_max,
                                                load.prefill_seqs))[0])
    compute = attn + float(lat.router(gate) + lat.shared_experts(gate) + lat.local_experts(gate))
    head = float(np.ravel(lat.lm_head(load.sequences) + lat.step_overhead(load.sequences))[0])
    slow = price(lat, load, dp_stream_s=10.0 * compute)
    assert slow.iteration_s[0] == pytest.approx(n_moe * 10.0 * compute + head)
    fast = price(lat, load, dp_stream_s=0.0)
    assert fast.iteration_s[0] == pytest.approx(n_moe * compute + head)
    assert np.all(fast.rank_comm == 0.0)
    assert np.all(price(lat, load).rank_comm > 0.0)  # expert parallel: the all-to-all on every prompt token


def test_the_ring_holds_two_layers_of_the_experts_a_rank_lacks():
    m = load_model("qwen3_30b_a3b")
    lat = _lat(8)
    per_layer = (m.num_experts - m.num_experts // 8) * m.expert_params * m.weight_bytes
    assert prefill_stream_bytes_per_layer(m, lat) == pytest.approx(per_layer)
    assert prefill_ring_bytes(m, lat, CoroutinePolicy(prefill_parallel="dp")) == pytest.approx(2 * per_layer)
    assert prefill_ring_bytes(m, lat, CoroutinePolicy()) == 0.0
    assert prefill_stream_bytes_per_layer(m, _lat(1)) == 0.0  # one GPU holds every expert already


def _job(mode: str, **knobs):
    return make_job("coroutine", "qwen3_30b_a3b", "h100_8", n=80, seed=3, inputs=np.full(80, 1024),
                    policy_overrides={"attention_tp": 1, "kv_residency": "device", "b_attn": 32, "b_moe": 64,
                                      "prefill_tokens_per_rank": 4096, "prefill_parallel": mode, **knobs})


def test_the_ring_comes_out_of_the_kv_pool():
    ep, dp = prepare(_job("ep")), prepare(_job("dp"))
    m = load_model("qwen3_30b_a3b")
    ring = dp.budget.prefill_ring_bytes
    assert ring == pytest.approx(2 * prefill_stream_bytes_per_layer(m, ep.latency))
    assert ep.budget.prefill_ring_bytes == 0
    page = dp.budget.page_tokens * m.kv_bytes_per_token
    assert ep.budget.kv_pages_per_gpu - dp.budget.kv_pages_per_gpu == pytest.approx(ring / page, abs=1)
    assert "data-parallel prefill streams" in dp.budget.describe(m)


def test_the_simulator_streams_every_prefill_forward_and_runs_no_all_to_all_in_it():
    outs = {mode: simulate(_job(mode), progress=False) for mode in ("ep", "dp")}
    for out in outs.values():
        assert (out.prepared.state.table.finish_time > 0).all()
    dp = outs["dp"]
    prefills = [r for r in dp.records if r.phase == "prefill"]
    assert prefills and all(float(np.max(r.rank_comm)) == 0.0 for r in prefills)
    assert max(r.expert_calls for r in prefills) > 1  # each rank's experts on its own tokens: a batch per rank
    assert any(float(np.max(r.rank_comm)) > 0.0 for r in outs["ep"].records if r.phase == "prefill")
    lat = dp.prepared.latency
    per_forward = lat.ep_ranks * lat.layer_counts()[1] * prefill_stream_bytes_per_layer(dp.job.model, lat)
    assert dp.h2d_bytes >= len(prefills) * per_forward * (1 - 1e-9)
    assert outs["ep"].h2d_bytes < per_forward


def test_backends_that_do_not_stream_experts_refuse_it():
    with pytest.raises(ConfigError, match="policy.prefill_parallel=ep"):
        check_supported(CoroutinePolicy(prefill_parallel="dp"), Capabilities(dp_prefill=False))
    check_supported(CoroutinePolicy(prefill_parallel="dp"), Capabilities())


def test_tensor_parallel_attention_groups_refuse_it():
    with pytest.raises(ConfigError, match="prefill_parallel=dp"):
        prepare(_job("dp", attention_tp=2))


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="prefill_parallel must be one of ep, dp"):
        CoroutinePolicy(prefill_parallel="tp")


def _sim_scale_like(n: int):
    """benchmarks/sim_scale.py's job (Qwen3-30B-A3B on 128 H20, LongBench 12K -> 4K), as configured: prefill auto."""
    from golden.cases import sim_scale_like
    return sim_scale_like(n=n)


@pytest.mark.parametrize("n, chosen", [(20000, "dp"), (2000, "ep")])
def test_auto_takes_the_shorter_predicted_batch(n, chosen):
    """Many long prompts: the prefill's all-to-all outweighs the ring's cost to decode; few: decode dominates,
    and the ring's KV is worth more than the faster prefill. Every way is recorded, the choice is the shortest."""
    prepared = prepare(_sim_scale_like(n))
    rows = prepared.plan.prefill_modes
    assert [mode for mode, *_ in rows] == ["ep", "dp", "dp", "dp"]
    best = min(p + d for _, _, p, d in rows)
    first = next((mode, chunk) for mode, chunk, p, d in rows if p + d <= best * 1.01)  # ep, then larger chunks
    assert prepared.policy.prefill_parallel == chosen == first[0]
    if chosen == "dp":
        assert prepared.policy.prefill_tokens_per_rank == first[1] and prepared.budget.prefill_ring_bytes > 0
    assert "prefill planned" in prepared.plan.describe()
    assert prepared.plan.to_dict()["prefill_modes"][0][0] == "ep"


def test_backends_without_it_run_auto_as_expert_parallel():
    job = _sim_scale_like(2000)
    assert prefill_as_performed(job, dp_prefill=False).policy.prefill_parallel == "ep"
    assert prefill_as_performed(job, dp_prefill=True) is job
    explicit = _job("dp")
    assert prefill_as_performed(explicit, dp_prefill=False) is explicit  # refused by check_supported, not changed


def test_one_gpu_per_instance_has_nothing_to_choose():
    job = make_job("coroutine", "mixtral_8x7b", "a5000_1", n=20, inputs=np.full(20, 512),
                   policy_overrides={"prefill_parallel": "auto"})
    prepared = prepare(job)
    assert prepared.policy.prefill_parallel == "ep" and not prepared.plan.prefill_modes
    assert prepared.budget.prefill_ring_bytes == 0
