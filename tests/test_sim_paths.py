"""Where the simulator takes a cheaper way to a common case, the result is the general code's, bit for bit: one rank's
runs priced on floats (pricing.price.price_cells, price_steady), a boundary's few chunks and finishes on Python scalars
(core.few), an offloading block's one-rank run priced as the chain its DAG reduces to (pricing.scalar_offload), GEMM
times read from one launch count's curve (latency.roofline), decisions recorded lazily (decisions.DeferredDecision) and
identical decode runs as one event (engine.repeat). `general_paths` turns each of them off from here (the package has no
switch): every job takes the same decisions and ends with the same times, step by step."""

import contextlib
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchgen.decisions import first_difference, trace_of
from batchgen.latency.roofline import Roofline
from batchgen.memory import ConfigError
from batchgen.sim.run import simulate
from conftest import make_job
from test_sim_properties import POLICIES, build, jobs


def outcome(job, kv_pages=None):
    """Everything a run produces that a cheaper path could change."""
    out = simulate(job, progress=False, kv_pages_per_gpu=kv_pages)
    t = out.prepared.state.table
    steps = [(r.instance, r.start, r.duration, r.phase, r.iterations, r.tokens, r.running, r.expert_tokens,
              r.expert_calls, np.asarray(r.rank_busy).tolist(), np.asarray(r.rank_comm).tolist(),
              sorted(r.modules.items())) for r in out.records]
    return dict(finish=t.finish_time.copy(), first=t.first_token_time.copy(), trace=trace_of(out.records),
                steps=steps, events=out.events, host_bytes=out.host_bytes,
                host_bytes_per_iteration=out.host_bytes_per_iteration)


def assert_same(fast, ref):
    diff = first_difference(fast["trace"], ref["trace"])
    assert diff is None, diff.describe()
    for key in ("finish", "first"):
        assert np.array_equal(fast[key], ref[key], equal_nan=True), key
    for k, (a, b) in enumerate(zip(fast["steps"], ref["steps"])):
        assert a == b, f"step {k}: {a} != {b}"
    for key in ("steps", "host_bytes", "host_bytes_per_iteration"):
        assert fast[key] == ref[key], key
    assert fast["events"] <= ref["events"], "events"  # repeated runs as one event (batchgen.engine.repeat): fewer


class _Eager:
    """In place of `DeferredDecision`: each boundary's decision record made at once."""

    def __new__(cls, decision, plan, folded):
        from batchgen.decisions import BoundaryDecision

        return BoundaryDecision.of(decision, plan, folded)


@contextlib.contextmanager
def general_paths():
    """Every cheaper way above turned off: the general code alone."""
    from unittest import mock

    import batchgen.engine.apply as apply
    import batchgen.engine.loop as loop
    import batchgen.latency.roofline as roofline
    import batchgen.pricing.microbatch as microbatch
    import batchgen.pricing.offload as offload
    import batchgen.sim.backend as backend
    from batchgen.core.accounts import Accounts
    from batchgen.core.few import FewIds
    from batchgen.policy.offload.base import OffloadPolicy

    with contextlib.ExitStack() as stack:
        for target, name, value in (
                (FewIds, "_prefill_chunks_few", lambda *args: False),  # the state's primitives on arrays
                (FewIds, "_finish_few", lambda *args: False),
                (Accounts, "_one_gpu_pages", lambda *args: False),
                (apply, "_FEW_CHUNKS", 0), (backend, "_FEW_CHUNKS", 0),  # a forward's chunks on arrays
                (roofline.Roofline, "prices_floats", False),  # one rank's runs priced on the grid
                (roofline, "_uniform", lambda calls, tokens: None),
                (microbatch, "chain_applies", lambda lat: False),
                (offload, "chain_applies", lambda lat: False),
                (loop, "DeferredDecision", _Eager),
                (OffloadPolicy, "repeats", lambda self, snap, decision, forecast: 0)):
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def both_ways(job, kv_pages=None):
    fast = outcome(job, kv_pages)
    with general_paths():
        ref = outcome(job, kv_pages)
    return fast, ref


def vidur_like(policy, n=150, **knobs):
    """A scaled-down sim_scale --policies job: Llama-2-7B on one A100, conversation-like lengths."""
    rng = np.random.default_rng(1)
    inputs, outputs = rng.integers(8, 3000, n), rng.integers(1, 600, n)
    job = make_job(policy, "llama2_7b", "a100_8", inputs, outputs, policy_overrides=knobs,
                   cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})
    return job


CASES = {
    **{f"{p}-a100": (lambda p=p: vidur_like(p)) for p in POLICIES if p != "pd_disagg"},  # it needs experts
    "pd_disagg-tiny-2x4": lambda: make_job("pd_disagg", "tiny_moe", "h100_8", n=80),
    "continuous-whole-prompts": lambda: vidur_like("continuous", chunked_prefill=False),
    "continuous-conservative": lambda: vidur_like("continuous", n=80, admission="conservative", token_budget=512),
    # several ranks and instances, host-resident KV, migration and partition: the general paths' territory
    "coroutine-host-2x8": lambda: dataclasses.replace(
        make_job("coroutine", "qwen3_30b_a3b", "h20_16", np.full(40, 3000), np.arange(1, 41) * 40,
                 policy_overrides={"kv_residency": "mixed", "b_moe": 8, "partition_min_context": 1024}),
    ),
    "static-tiny-8": lambda: make_job("static", "tiny_moe", "h100_8", n=80),
    "continuous-tiny-8": lambda: make_job("continuous", "tiny_moe", "h100_8", n=80,
                                          policy_overrides={"token_budget": 300}),
    # one rank short of KV pages: preemption (greedy) and a tight reserve (conservative) on the one-rank paths
    "continuous-a100-preempting": lambda: vidur_like("continuous", n=120),
    "sglang_opt-a100-small-pool": lambda: vidur_like("sglang_opt", n=120),
    "sglang_opt-a100-unmixed": lambda: vidur_like("sglang_opt", n=120, mixed_chunks=False),  # chunks alone
}
KV_PAGES = {"continuous-a100-preempting": 400, "sglang_opt-a100-small-pool": 400}  # pages per GPU


@pytest.mark.parametrize("case", sorted(CASES))
def test_cheaper_paths_reproduce_the_general_code(case):
    fast, ref = both_ways(CASES[case](), KV_PAGES.get(case))
    assert len(fast["steps"]) > 1
    if case == "continuous-a100-preempting":
        assert any(d.evicted for d in fast["trace"])  # the case preempts
    assert_same(fast, ref)


def test_the_comparison_catches_a_shortcut_that_changes_a_price(monkeypatch):
    """A shortcut one part in 10^12 off is caught: the test above can fail."""
    job = vidur_like("continuous", n=40)
    honest = Roofline._gemm_lookup

    def off(self, *args):
        out = honest(self, *args)
        return None if out is None else out * (1 + 1e-12)

    monkeypatch.setattr(Roofline, "_gemm_lookup", off)
    fast, ref = both_ways(job)
    with pytest.raises(AssertionError):
        assert_same(fast, ref)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs)
def test_cheaper_paths_reproduce_the_general_code_on_random_jobs(p):
    try:
        job = dataclasses.replace(build(p), check_invariants=False)
        fast, ref = both_ways(job)
    except ConfigError:
        assume(False)
    assert_same(fast, ref)


# ---- one rank's runs on floats (batchgen.pricing.price.price_cells / price_steady) against the grid, bit for bit ----

def _scalar_setup(model="llama2_7b"):
    from batchgen.job import prepare
    from batchgen.pricing.scalar_offload import chain_applies

    rng = np.random.default_rng(0)
    job = make_job("continuous", model, "a100_8", rng.integers(8, 3000, 4), rng.integers(1, 600, 4),
                   cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})
    lat = prepare(job).latency
    return lat, chain_applies(lat)


def _same_cost(a, b):
    for f in ("iteration_s", "rank_busy", "rank_comm", "expert_tokens"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.shape == y.shape and np.array_equal(x, y), (f, x, y)
    assert a.modules == b.modules


def _grid_price(lat, load, weight_stream_s=0.0, join=0.0, tbo=False, overlap=False):
    """`pricing.price.price` on the (R x K) grid, as many ranks are priced, never on one rank's floats."""
    from batchgen.pricing.price import _cost, forward
    from batchgen.pricing.tbo import forward_tbo

    tbo = tbo and weight_stream_s <= 0
    if tbo and (load.shards or overlap):
        raise ValueError("two-batch overlap with PARTITIONed sequences or the micro-batches' overlap")
    return _cost(*(forward_tbo(lat, load, join, one=False) if tbo
                   else forward(lat, load, weight_stream_s, join, overlap, one=False)))


@pytest.mark.parametrize("model", ["llama2_7b", "tiny_moe"])
@pytest.mark.parametrize("tbo", [False, True])
def test_one_rank_cells_price_decode_and_mixed_runs_as_the_grid(tbo, model):
    from batchgen.pricing.costs import decode_load, mixed_load
    from batchgen.pricing.one_rank import decode_cells, mixed_cells
    from batchgen.pricing.price import CELL_FIELDS, price, price_cells

    lat, _ = _scalar_setup(model)
    fields = lambda load: [getattr(load, f)[0].tolist() for f in CELL_FIELDS]  # noqa: E731
    rng = np.random.default_rng(7)
    for trial in range(150):
        n = int(rng.integers(0, 300))
        context = rng.integers(1, 5000, n)
        K = int(rng.integers(1, 13))
        # a run to the first finish (everyone alive throughout) or sequences ending part-way
        alive = np.full(n, K) if trial % 2 else rng.integers(1, K + 1, n)
        mb = int(rng.choice([0, 0, 7, 64]))
        stream = float(rng.choice([0.0, 0.0, 0.01]))
        rank, tp, zero = np.zeros(n, np.int64), np.ones(n, np.int64), np.zeros(1, np.int64)
        if n:
            load = decode_load(rank, context, alive, tp, 1, K, mb, zero, zero)
            cells = decode_cells(context, alive, K, mb)
            assert cells == fields(load)
            want = _grid_price(lat, load, stream, tbo=tbo)
            _same_cost(price_cells(lat, cells, None, stream, tbo=tbo), want)
            _same_cost(price(lat, load, stream, tbo=tbo), want)
        c = int(rng.integers(1, 6))
        start = rng.integers(0, 3000, c) * (rng.random(c) < 0.5)
        length = np.maximum(rng.integers(-3, 3000, c), 1)
        completes = rng.random(c) < 0.5
        load = mixed_load(np.zeros(c, np.int64), start, length, completes, rank, context, 1, mb)
        cells, heads = mixed_cells(start, length, completes, context, mb)
        assert cells == fields(load) and heads == load.head_rows[0].tolist()
        _same_cost(price_cells(lat, cells, heads, stream, tbo=tbo), _grid_price(lat, load, stream, tbo=tbo))


@pytest.mark.parametrize("model,tbo", [("llama2_7b", False), ("tiny_moe", False), ("tiny_moe", True)])
def test_steady_price_of_long_one_rank_runs_is_the_grids(model, tbo):
    """Runs of many iterations in which only the context changes (a run to the first finish, a static batch with
    padding rows): `price_steady` equals the grid's price bit for bit; a run whose batch changes is not steady."""
    from batchgen.pricing.costs import decode_load
    from batchgen.pricing.one_rank import steady
    from batchgen.pricing.price import price_steady

    lat, _ = _scalar_setup(model)
    rng = np.random.default_rng(3)
    for trial in range(100):
        n, K = int(rng.integers(1, 300)), int(rng.integers(13, 80))
        context = rng.integers(1, 6000, n)
        pad = np.array([int(rng.integers(0, 20)) if trial % 2 else 0])
        pad_ctx = pad * int(rng.integers(1, 4000))
        mb = int(rng.choice([0, 16]))
        load = decode_load(np.zeros(n, np.int64), context, np.full(n, K), np.ones(n, np.int64), 1, K, mb, pad, pad_ctx)
        _same_cost(price_steady(lat, steady(load), K, tbo=tbo), _grid_price(lat, load, tbo=tbo))
        _same_cost(price_steady(lat, steady(load), K, 0.01, tbo=tbo), _grid_price(lat, load, 0.01, tbo=tbo))
    ragged = decode_load(np.zeros(3, np.int64), np.array([5, 9, 700]), np.array([20, 30, 40]), np.ones(3, np.int64),
                         1, 40, 0, np.zeros(1, np.int64), np.zeros(1, np.int64))
    assert steady(ragged) is None  # sequences end part-way


def test_all_alive_price_is_the_grids():
    """`one_rank.all_alive` (every row through the whole run: a static batch with its padding rows, a run to the
    first finish) priced by `price_steady` equals the grid `costs.decode_load` builds, bit for bit, with the same
    gate-token total; with padded attention kernels too (the longest context enters the price)."""
    from batchgen.pricing.costs import decode_load
    from batchgen.pricing.one_rank import all_alive
    from batchgen.pricing.price import price_steady

    lat, _ = _scalar_setup()
    padded = Roofline(lat.model, lat.gpu, dataclasses.replace(lat.eff, attention_padding=0.4),
                      ep_ranks=lat.ep_ranks, gpus_per_node=lat.gpus_per_node, host=lat.host)
    rng = np.random.default_rng(9)
    for trial in range(100):
        model = padded if trial % 4 == 3 else lat
        n, K = int(rng.integers(1, 300)), int(rng.integers(13, 90))
        context = rng.integers(1, 6000 if trial % 4 != 3 else 300, n)  # padding rows longer than every row
        if trial % 3 == 0:  # a static batch: every row over the longest context
            context = np.full(n, context.max())
        pad = int(rng.integers(1, 40)) if trial % 2 else 0
        pad_ctx = pad * int(rng.integers(1, 5000)) + int(rng.integers(0, max(pad, 1)))  # a mean with a fraction
        mb = int(rng.choice([0, 7, 64]))
        stream = float(rng.choice([0.0, 0.02]))
        load = decode_load(np.zeros(n, np.int64), context, np.full(n, K), np.ones(n, np.int64), 1, K, mb,
                           np.array([pad]), np.array([pad_ctx]))
        alive = all_alive(context, K, mb, pad, pad_ctx)
        _same_cost(price_steady(model, alive, K, stream), _grid_price(model, load, stream))
        assert np.full((1, K), alive.gate_tokens).sum() == load.gate_tokens.sum()


@pytest.mark.parametrize("pipelined", [False, True])
def test_one_rank_offload_price_is_the_dags(pipelined):
    """`pricing.scalar_offload` (an offloading system's run on one rank with device KV, priced as a chain) equals
    `price_offload` on the per-layer DAG bit for bit: one micro-batch or several, sequences ending part-way,
    iterations without queries; and it declines host-resident KV (the DAG's territory)."""
    from batchgen.pricing.costs import decode_grid
    from batchgen.pricing.offload import price_offload
    from batchgen.pricing.scalar_offload import price_offload_one_rank

    lat, _ = _scalar_setup()
    rng = np.random.default_rng(11)
    taken = 0
    for trial in range(120):
        n, K = int(rng.integers(1, 200)), int(rng.integers(1, 80))
        context = rng.integers(1, 4000, n)
        alive = np.full(n, K) if trial % 3 == 0 else rng.integers(1, K + 1, n)
        mb = int(rng.choice([0, 1, 7, 16, 64, 256]))
        one, zero = np.ones(n, np.int64), np.zeros(1, np.int64)
        grid = decode_grid(np.zeros(n, np.int64), context, alive, one, np.zeros(n, bool), 1, K, mb, zero, zero)
        if trial % 10 == 1:  # a run whose last iterations have nobody left (steps past every finish)
            grid = decode_grid(np.zeros(n, np.int64), context, alive, one, np.zeros(n, bool), 1, K + 5, mb, zero, zero)
        fast = price_offload(lat, grid, mb, cpu_attention=False, pipelined=pipelined, prefetch_bytes=0.0)
        taken += price_offload_one_rank(lat, grid, mb, pipelined) is not None
        with general_paths():
            ref = price_offload(lat, grid, mb, cpu_attention=False, pipelined=pipelined, prefetch_bytes=0.0)
        _same_cost(fast[0], ref[0])
        assert fast[1:3] == ref[1:3] and np.array_equal(fast[3], ref[3])
    assert taken == 120  # every one of these runs took the chain
    hosted = decode_grid(np.zeros(3, np.int64), np.array([5, 9, 700]), np.array([4, 4, 4]), np.ones(3, np.int64),
                         np.ones(3, bool), 1, 4, 0, np.zeros(1, np.int64), np.zeros(1, np.int64))
    assert price_offload_one_rank(lat, hosted, 0, pipelined) is None


@pytest.mark.parametrize("pipelined", [False, True])
def test_one_row_microbatched_price_is_the_dags(pipelined):
    """The planner's typical iteration (a one-row, one-iteration grid: FlexGen's search) and the simulator's
    runs of several micro-batches: `price_microbatched` with and without the chain for device KV (host KV, restored
    or attended by the CPU, takes the DAG either way), bit for bit, up to more micro-batches than the DAG gives
    nodes (grouped), with replicas and prefetched bytes."""
    from batchgen.plan.decode import DecodeGrid
    from batchgen.pricing.microbatch import price_microbatched
    from batchgen.pricing.costs import decode_grid
    from batchgen.pricing.scalar_offload import microbatched_one_rank

    lat, _ = _scalar_setup()
    rng = np.random.default_rng(5)
    one = lambda v: np.full((1, 1), float(v))  # noqa: E731
    for trial in range(80):
        mb = int(rng.choice([0, 1, 2, 4, 16, 64]))
        hosted = trial % 4 == 1  # the planner's host-KV candidates: the DAG itself, on Python floats
        if trial % 2:
            n = int(rng.integers(1, 3000))
            kv = (one(0), one(0), one(0), one(n), one(n * int(rng.integers(1, 3000)))) if hosted else (
                one(n), one(n * int(rng.integers(1, 3000))), one(1), one(0), one(0))
            grid = DecodeGrid(*kv, one(n))
        else:
            n, K = int(rng.integers(1, 300)), int(rng.integers(1, 40))
            zero = np.zeros(1, np.int64)
            grid = decode_grid(np.zeros(n, np.int64), rng.integers(1, 4000, n), rng.integers(1, K + 1, n),
                               np.ones(n, np.int64), np.zeros(n, bool), 1, K, mb, zero, zero)
        kw = dict(cpu_attention=hosted and trial % 8 == 1, pipelined=pipelined,
                  prefetch_bytes=float(rng.choice([0.0, 1e6])), replicas=int(rng.choice([1, 8])))
        assert (microbatched_one_rank(lat, grid, mb, pipelined, kw["replicas"]) is None) == hosted
        fast, fast_calls = price_microbatched(lat, grid, mb, **kw)
        with general_paths():
            ref, ref_calls = price_microbatched(lat, grid, mb, **kw)
        for f in ("iteration_s", "rank_busy", "comm_s", "exposed_s", "moe_layer_s"):
            x, y = getattr(fast, f), getattr(ref, f)
            assert x.shape == y.shape and np.array_equal(x, y), (trial, f, x, y)
        assert (fast.h2d_bytes, fast.d2h_bytes) == (ref.h2d_bytes, ref.d2h_bytes)
        assert np.array_equal(fast_calls, ref_calls)


@pytest.mark.parametrize("model", ["llama2_7b", "qwen3_30b_a3b"])
def test_every_micro_batch_priced_at_once_is_each_priced_alone(model):
    """`microbatch._costs` prices each module once over all micro-batches: every node's cost equals pricing its
    micro-batch alone, bit for bit (the latency model's formulas are elementwise), as a float for one rank and one
    iteration and as the (R, K) slice otherwise; a dense and an MoE layer, device, restored and CPU attention."""
    from batchgen.plan.decode import _host_micro_batches
    from batchgen.pricing.microbatch import _costs
    from batchgen.specs import load_model

    base, _ = _scalar_setup()
    lat = Roofline(load_model(model), base.gpu, base.eff, ep_ranks=1, gpus_per_node=1, host=base.host)
    rng = np.random.default_rng(13)
    for trial in range(40):
        R, K = (1, 1) if trial % 2 else (int(rng.integers(1, 5)), int(rng.integers(1, 7)))
        host_tokens = rng.integers(0, 400, (R, K)).astype(float)
        context = host_tokens * rng.integers(1, 3000, (R, K))
        tokens, ctx, launches = _host_micro_batches(host_tokens, context, int(rng.choice([0, 7, 64])))
        for kind in ("device", "staged", "cpu"):
            for moe in (False, True):
                c, _ = _costs(lat, tokens, ctx, launches, kind, moe, 2, 0.0)
                for i, (t, x, n) in enumerate(zip(tokens, ctx, launches)):
                    want = {"attn": lat.attention_decode(t, 0.0 if kind == "cpu" else x, n),
                            "ffn": lat.shared_experts(t) + lat.router(t) if moe else lat.dense_ffn(t)}
                    if kind == "staged":
                        want.update(restore=lat.kv_restore(x, n), append=lat.kv_append(t, n))
                    if kind == "cpu":
                        (want["append"], want["back"]), want["cpu"] = lat.cpu_attention_ship(t, n), \
                            lat.cpu_attention(t, x, n)
                    for node, value in want.items():
                        got = getattr(c, node)[i]
                        assert type(got) is float if (R, K) == (1, 1) else got.shape == (R, K)
                        assert np.array_equal(np.broadcast_to(np.asarray(value, float), (R, K)),
                                              np.broadcast_to(got, (R, K))), (trial, kind, moe, node, i)


# ---- repeated decode runs as one event (batchgen.engine.repeat, batchgen.sim.repeated) ----------------------------

def run_by_run(job, kv_pages=None):
    """`outcome` of the job with every run its own event (the block policies declare no repeats)."""
    from unittest import mock

    from batchgen.policy.offload.base import OffloadPolicy

    with mock.patch.object(OffloadPolicy, "repeats", lambda self, snap, decision, forecast: 0):
        return outcome(job, kv_pages)


REPEAT_CASES = {
    "zero_inference-a100": lambda: vidur_like("zero_inference", n=200),
    "flexgen-a100": lambda: vidur_like("flexgen", n=200),
    # several micro-batches per block: each run priced on its own grid (not the one-micro-batch chain)
    "flexgen-a100-4x4": lambda: vidur_like("flexgen", n=120, gpu_batch_size=4, num_gpu_batches=4, cache_on="gpu",
                                           cpu_delegation=False),
    # without invariant checks: the replay alone, as benchmarks run it
    "zero_inference-a100-unchecked": lambda: dataclasses.replace(vidur_like("zero_inference", n=200),
                                                                 check_invariants=False),
    # a rank short of pages (the executor's pool): rows are shed part-way through a block, ending the repeats
    "zero_inference-a100-shedding": lambda: shedding_job(),
    # an MoE model (its runs priced on the DAG, run by run): one rank, four ranks in one instance
    "zero_inference-tiny-moe": lambda: make_job("zero_inference", "tiny_moe", "h100_8", n=60,
                                                policy_overrides={"batch_size": 16},
                                                cluster_overrides={"num_gpus": 1, "gpus_per_instance": None}),
    "flexgen-tiny-moe-4": lambda: make_job("flexgen", "tiny_moe", "h100_8", n=80, seed=2,
                                           policy_overrides={"gpu_batch_size": 4, "num_gpu_batches": 2,
                                                             "cache_on": "gpu", "cpu_delegation": False},
                                           cluster_overrides={"num_gpus": 4, "gpus_per_instance": 4}),
    # several instances: never merged (another instance's loop could look at the state between the runs)
    "zero_inference-tiny-moe-2x2": lambda: make_job("zero_inference", "tiny_moe", "h100_8", n=60, seed=4,
                                                    cluster_overrides={"num_gpus": 4, "gpus_per_instance": 2}),
    "zero_inference-a100-4x1": lambda: make_job("zero_inference", "llama2_7b", "a100_8", n=60, seed=3,
                                                cluster_overrides={"num_gpus": 4, "gpus_per_instance": None}),
}
REPEAT_PAGES = {"zero_inference-a100-shedding": 280}


def shedding_job():
    """Blocks of 16 prompts of 1,000 tokens that fit 280 pages of 64 tokens at prefill, not as they grow."""
    return make_job("zero_inference", "llama2_7b", "a100_8", np.full(40, 1000), np.arange(1, 41) * 15,
                    policy_overrides={"batch_size": 16}, cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})


@pytest.mark.parametrize("case", sorted(REPEAT_CASES))
def test_repeated_runs_as_one_event_change_no_result(case):
    job, kv_pages = REPEAT_CASES[case](), REPEAT_PAGES.get(case)
    merged, alone = outcome(job, kv_pages), run_by_run(job, kv_pages)
    assert_same(merged, alone)
    assert alone["events"] == len(alone["steps"])
    if case.endswith(("2x2", "4x1")):
        assert merged["events"] == alone["events"]  # several instances: never merged
    else:
        assert merged["events"] < alone["events"] / 2, (merged["events"], alone["events"])
    if case.endswith("shedding"):
        assert any(d.evicted for d in merged["trace"]), "the case must shed rows part-way through a block"


def test_a_wrong_repeat_declaration_fails_the_checked_run(monkeypatch):
    """With invariant checks the policy is asked at every replayed boundary: a block that declares repeats
    through a boundary where it sheds rows is caught there."""
    from batchgen.core.sequences import InvariantError
    from batchgen.policy.offload.base import OffloadPolicy

    job = shedding_job()
    monkeypatch.setattr(OffloadPolicy, "repeats", lambda self, snap, decision, forecast: forecast.alive.shape[0])
    with pytest.raises(InvariantError, match="declared"):
        simulate(job, progress=False, kv_pages_per_gpu=REPEAT_PAGES["zero_inference-a100-shedding"])


def test_forecast_of_the_next_boundaries():
    from batchgen.engine.repeat import forecast

    ahead = forecast(np.array([5, 16, 17, 40]), np.array([100, 10, 7, 1]), steps=16)
    # boundaries 1 and 2 after this one (at 16 and 32 tokens made): the last one still runs at both
    assert ahead.alive.tolist() == [[False, False, True, True], [False, False, False, True]]
    assert ahead.context.tolist() == [[116, 26, 23, 17], [132, 42, 39, 33]]
    assert forecast(np.array([16, 3]), np.array([1, 1]), steps=16).alive.shape == (0, 2)  # all end in this run
    assert forecast(np.array([1000]), np.array([1]), steps=1, limit=7).alive.shape == (7, 1)


@given(st.floats(0, 1e7), st.lists(st.floats(1e-9, 1e3), min_size=1, max_size=80))
def test_one_timeout_lands_where_the_runs_timeouts_would(now, durations):
    from batchgen.sim.repeated import _landing_delay

    end = now
    for d in durations:
        end = end + d
    delay = _landing_delay(now, durations)
    if delay is not None:
        assert delay >= 0 and now + delay == end
        return
    lo = hi = end - now  # None only where no delay near end - now lands there (a rounding tie)
    assert now + lo != end
    for _ in range(16):
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        assert now + lo != end and now + hi != end


def test_where_no_one_delay_lands_the_runs_keep_their_own_timeouts(monkeypatch):
    """A rounding tie (`now` on half the end's last place) leaves no single delay: the runs then take a timeout
    each, and the job's results are still those of running them one by one."""
    import batchgen.sim.repeated as repeated

    assert repeated._landing_delay(1.2132447763310665, [97.0, 1000.0, 1000.0, 1000.0, 999.7224461926149]) is None
    job = REPEAT_CASES["zero_inference-a100"]()
    alone = run_by_run(job)
    monkeypatch.setattr(repeated, "_landing_delay", lambda now, durations: None)
    ticked = outcome(job)
    assert_same(ticked, alone)
    assert ticked["events"] == alone["events"]
# ---- the state's flags that let the primitives skip work (batchgen.core.state) -------------------------------

def _one_gpu_state(n=12, seed=4):
    from batchgen.job import prepare

    rng = np.random.default_rng(seed)
    job = make_job("continuous", "llama2_7b", "a100_8", rng.integers(100, 400, n), rng.integers(1, 4, n),
                   cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})
    state = prepare(job).state
    ids = state.pending[0].peek(n)
    state.pin(0, ids, np.zeros(n, np.int64))
    return state


def _state_columns(state):
    t = state.table
    cols = {f: getattr(t, f).copy() for f in ("decoded", "where", "pages", "prefilled", "host_resident", "tp",
                                             "instance", "finish_time", "first_token_time")}
    cols.update(pages_used=state.pages_used.copy(), peak=state.peak_pages.copy(), active=state.active[0].copy(),
                queue=state.pinned[0].to_array().copy(), finished=state.num_finished)
    return cols


def _chunk_and_finish(state):
    """First chunks of three prompts (one completing), their continuation, decode tokens, and finishes of one and
    of several sequences at once: the scalar paths' territory (a few ids, one GPU, nothing partitioned)."""
    t, P = state.table, state.page_tokens
    gpu = np.zeros(3, np.int64)
    ids = state.pinned[0].peek(3).copy()
    state.take_pending(0, ids, 0)
    ctx = t.context(ids)
    lens = np.array([ctx[0], P + 1, 5])  # the first completes its prompt, the others write part of it
    state.prefill_chunks(0, ids, gpu, np.zeros(3, np.int64), lens)
    state.advance(ids[:1], np.ones(1, np.int64), host_sync=False)
    rest = ids[1:]
    state.prefill_chunks(0, rest, gpu[:2], t.prefilled[rest].copy(), t.context(rest) - t.prefilled[rest])
    state.advance(rest, np.ones(2, np.int64), host_sync=False)
    for sid in ids.tolist():  # decode each to its end; finish one, then the other two together
        left = int(t.output_len[sid] - t.decoded[sid])
        if left:
            state.reserve(np.array([sid]), left)
            state.advance(np.array([sid]), np.array([left]), host_sync=False)
    state.finish(0, ids[:1], np.array([1.0]))
    state.finish(0, ids[1:], np.array([2.0, 3.0]))
    state.check()


def test_scalar_chunk_and_finish_paths_leave_the_array_codes_state():
    import copy

    fast_state = _one_gpu_state()
    ref_state = copy.deepcopy(fast_state)
    _chunk_and_finish(fast_state)
    with general_paths():
        _chunk_and_finish(ref_state)
    fast, ref = _state_columns(fast_state), _state_columns(ref_state)
    assert fast["finished"] == 3
    for key in fast:
        assert np.array_equal(fast[key], ref[key], equal_nan=True), key


@pytest.mark.parametrize("fast", [True, False])
def test_scalar_paths_refuse_what_the_array_code_refuses(fast):
    """A chunk that does not continue where its prefill stands, and a finish before the last token, fail with
    the array code's message, having changed nothing."""
    from batchgen.core.sequences import InvariantError

    state = _one_gpu_state()
    ids = state.pinned[0].peek(2).copy()
    state.take_pending(0, ids, 0)
    state.prefill_chunks(0, ids, np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([4, 4]))
    before = _state_columns(state)
    with (general_paths() if not fast else contextlib.nullcontext()):
        with pytest.raises(InvariantError, match="part-way through a chunked prefill"):
            state.prefill_chunks(0, ids, np.zeros(2, np.int64), np.array([4, 3]), np.array([2, 2]))
        with pytest.raises(InvariantError, match="done generating"):
            state.finish(0, ids[:1], np.array([1.0]))
    after = _state_columns(state)
    for key in before:
        assert np.array_equal(before[key], after[key], equal_nan=True), key


def test_state_check_catches_flags_out_of_step():
    """`partitioned_ever`, the host-copy flag and the count of chunked prefills under way let the primitives skip
    per-sequence scans; `check` fails when one says "none" while the table holds one."""
    from batchgen.core.sequences import InvariantError

    state = _one_gpu_state()
    state.check()
    state.table.tp[0] = 2
    with pytest.raises(InvariantError, match="never partitioned"):
        state.check()
    state.table.tp[0] = 1
    part = state.pinned[0].peek(1).copy()  # a chunked prefill under way, counted
    state.take_pending(0, part, 0)
    state.prefill_chunks(0, part, np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([3]))
    assert state.num_part_prefilled == 1
    state.check()
    state.num_part_prefilled = 0  # out of step
    with pytest.raises(InvariantError, match="num_part_prefilled"):
        state.check()
    state.num_part_prefilled = 1
    ids = state.pinned[0].peek(1).copy()  # one sequence prefilled, then yielded: a host copy
    state.host_kv_tokens = np.full_like(state.host_kv_tokens, 10**6)  # continuous plans no host KV: give it some
    state.take_pending(0, ids, 0)
    state.prefill_chunks(0, ids, np.zeros(1, np.int64), np.zeros(1, np.int64), state.table.context(ids))
    state.advance(ids, np.ones(1, np.int64), host_sync=False)
    state.yield_(0, ids)
    state.check()
    assert state.has_host_copies()
    state._host_any = False  # out of step
    with pytest.raises(InvariantError, match="has_host_copies"):
        state.check()


def test_no_moves_is_shared_and_read_only():
    from batchgen.core.accounts import Moves

    none = Moves.none(2)
    assert Moves.none(2) is none and not none.any()
    with pytest.raises(ValueError):
        none.d2h[0] = 1.0


def test_cells_beyond_the_gemm_curves_are_priced_as_the_grid():
    """A forward whose token count is past the GEMM curves (a 70K-token prompt chunk) or fractional is priced
    directly on floats, with the grid's values."""
    from batchgen.pricing.costs import mixed_load
    from batchgen.pricing.one_rank import mixed_cells
    from batchgen.pricing.price import price_cells

    lat, _ = _scalar_setup()
    for length in (70_000, 65_537, 3):
        start, completes, context = np.array([0]), np.array([True]), np.array([100, 4000])
        load = mixed_load(np.zeros(1, np.int64), start, np.array([length]), completes, np.zeros(2, np.int64),
                          context, 1, 0)
        cells, heads = mixed_cells(start, np.array([length]), completes, context, 0)
        _same_cost(price_cells(lat, cells, heads), _grid_price(lat, load))
    assert lat.lm_head(2.5) == lat.lm_head(np.array([2.5]))[0]  # a fractional row count: the direct GEMMs
