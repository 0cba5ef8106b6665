"""Per-module efficiencies, padded attention, engine overheads and efficiency files (batchgen.latency)."""
import numpy as np
import pytest

from batchgen.latency import Efficiency, LatencyModel, Roofline, load_efficiency
from batchgen.pricing.costs import decode_load
from batchgen.pricing.price import price
from batchgen.specs.catalog import load_efficiency_dict, load_hardware, load_model
from conftest import make_job

MODEL = load_model("mixtral_8x7b")
GPU = load_hardware("h100")


def test_roofline_implements_the_interface():
    assert isinstance(Roofline(MODEL, GPU), LatencyModel)


def test_a_module_override_moves_only_that_module():
    base = Roofline(MODEL, GPU, Efficiency())
    slow = Roofline(MODEL, GPU, Efficiency(modules={"experts": {"compute": 0.1, "memory": 0.1}}))
    tokens = 4096.0
    assert slow.experts(tokens)[0] > 3 * base.experts(tokens)[0]
    assert slow.attention_decode(64, 64 * 1024) == base.attention_decode(64, 64 * 1024)
    assert slow.dense_ffn(64) == base.dense_ffn(64) and slow.router(64) == base.router(64)


def test_unknown_module_or_field_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown module 'expert'.*experts"):
        Efficiency(modules={"expert": {"compute": 0.5}})
    with pytest.raises(ValueError, match="unknown field.*computer"):
        Efficiency(modules={"experts": {"computer": 0.5}})
    with pytest.raises(ValueError, match=r"compute must be in \(0, 1\]"):
        Efficiency(modules={"experts": {"compute": 2.0}})


def test_padded_attention_pays_queries_times_the_longest_context():
    exact = Roofline(MODEL, GPU, Efficiency(attention_padding=0.0))
    padded = Roofline(MODEL, GPU, Efficiency(attention_padding=1.0))
    # 64 queries, one 32K context among short ones: the sum is ~96K tokens, the padded batch 64 x 32K
    ctx_sum, longest = 63 * 1024 + 32768, 32768
    assert exact.attention_decode(64, ctx_sum, 1, longest) == exact.attention_decode(64, ctx_sum)
    assert padded.attention_decode(64, ctx_sum, 1, longest) > 5 * exact.attention_decode(64, ctx_sum, 1, longest)
    # equal contexts: padding costs nothing
    assert padded.attention_decode(64, 64 * 1024, 1, 1024) == pytest.approx(exact.attention_decode(64, 64 * 1024))
    # prefill: a padded kernel pays every prompt the longest one's whole square (no causal saving)
    sq = 3 * 1000 ** 2 + 16000 ** 2
    assert (padded.attention_prefill(19000, sq, 1, 16000, 4) > 2 * exact.attention_prefill(19000, sq, 1, 16000, 4))


def test_simulated_decode_charges_the_engine_overheads_per_forward():
    plain = Roofline(MODEL, GPU, Efficiency())
    busy = Roofline(MODEL, GPU, Efficiency(step_s=1e-3, step_per_sequence_s=1e-5))
    rank, ctx = np.zeros(10, np.int64), np.full(10, 100)
    alive = np.arange(1, 11)  # one sequence ends per iteration
    load = decode_load(rank, ctx, alive, np.ones(10, np.int64), 1, 10, 0, np.zeros(1), np.zeros(1))
    extra = price(busy, load).iteration_s - price(plain, load).iteration_s
    assert extra == pytest.approx(1e-3 + 1e-5 * np.arange(10, 0, -1))


def test_longest_context_follows_the_sequences_still_running():
    rank = np.zeros(3, np.int64)
    ctx = np.array([100, 500, 300])
    alive = np.array([5, 2, 4])  # the 500-token one stops after 2 iterations
    load = decode_load(rank, ctx, alive, np.ones(3, np.int64), 1, 5, 0, np.zeros(1), np.zeros(1))
    assert load.attn_max[0].tolist() == [500, 501, 302, 303, 104]


def test_auto_loads_the_gpus_file_and_overrides_win():
    shipped = load_efficiency_dict("h100")
    eff = load_efficiency({"auto": True, "kernel_s": 1e-5}, "h100")
    assert eff.compute == pytest.approx(shipped["compute"]) and eff.kernel_s == 1e-5
    assert load_efficiency({"auto": True}, "a5000") == Efficiency()  # nothing fitted for it: data sheet
    assert load_efficiency({}, "h100") == Efficiency()               # efficiency=datasheet


def test_inherited_file_keeps_the_parents_factors():
    assert load_efficiency({"inherit": "h20"}, "h20").compute == pytest.approx(load_efficiency_dict("h100")["compute"])


def test_efficiency_round_trips_through_its_file_format():
    eff = Efficiency(compute=0.7, modules={"experts": {"memory": 0.5}}, source={"device": "h100"})
    assert Efficiency.from_dict(eff.to_dict()) == eff
    with pytest.raises(ValueError, match="unknown efficiency field"):
        Efficiency.from_dict({"compute": 0.7, "bogus": 1})


def test_padded_kernels_are_priced_per_run_of_similar_contexts():
    from batchgen.pricing.costs import similar_runs

    rank = np.array([0, 0, 0, 0, 1, 1])
    ctx = np.array([100, 110, 1000, 1100, 50, 5000])
    run = similar_runs(rank, ctx, 0)
    assert run[0] == run[1] != run[2] == run[3]       # 100/110 together, 1000/1100 together
    assert len({run[4], run[5]}) == 2 and not {run[4], run[5]} & {run[0], run[2]}
    assert len(set(similar_runs(rank, ctx, 1).tolist())) == 6  # B_attn = 1: one call each
    # decode: the padded work is each run's members x its longest context, not the rank's longest
    alive = np.full(6, 3)
    load = decode_load(rank, ctx, alive, np.ones(6, np.int64), 2, 3, 0, np.zeros(2), np.zeros(2),
                       similar_calls=True)
    assert load.micro_batches[:, 0].tolist() == [2, 2]
    assert load.attn_tokens[0, 0] * load.attn_max[0, 0] == pytest.approx(2 * 110 + 2 * 1100)


def test_a_cpu_device_overlaps_nothing():
    """On a CPU "device" the host copies and CPU attention run on the same cores as the compute: the layer
    costs their sum, where a GPU hides the copies behind compute."""
    from batchgen.plan.layer import LayerCosts, layer_time

    parts = dict(dev_attn=1.0, ffn=1.0, moe=1.0, host_attn=[1.0, 1.0], restore=[0.5, 0.5], append=[0.25, 0.25])
    assert layer_time(LayerCosts(**parts, serial=True)) == pytest.approx(6.5)
    assert layer_time(LayerCosts(**parts)) < 6.5


def test_the_executor_pads_nothing_so_its_simulation_does_not_either():
    from batchgen.policy.base import Capabilities
    from batchgen.sim.run import simulate

    job = make_job("static", n=24)
    padded, unpadded = simulate(job), simulate(job, capabilities=Capabilities(padded_batches=False))
    assert [r.decision for r in padded.records] == [r.decision for r in unpadded.records]
    assert unpadded.records[-1].start + unpadded.records[-1].duration < padded.records[-1].start + padded.records[-1].duration


def test_a_cpu_device_plans_device_resident_kv_and_device_attention():
    """On the CPU executor "host" KV would sit in the same memory and "CPU attention" on the same cores:
    the planner offers neither, and an explicit knob still wins."""
    from batchgen.job import prepare

    cpu = load_hardware("cpu_epyc_milan_2c")
    job = make_job("coroutine", n=24, cluster_overrides={"gpu": cpu, "num_gpus": 1})
    plan = prepare(job).plan
    assert (plan.kv_residency, plan.attention) == ("device", "gpu")
