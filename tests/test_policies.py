"""Policies as pure decisions: tested on hand-made states, with no simulator running."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from batchgen.engine import InstanceProgress, make_snapshot
from batchgen.job import prepare
from batchgen.memory import MemorySettings, host_weight_bytes
from batchgen.sim.run import simulate
from conftest import make_job


def squeezed(job, kv_tokens_per_gpu):
    """The same job with a KV pool of about `kv_tokens_per_gpu` tokens per GPU."""
    import dataclasses
    probe = prepare(job)
    usable = job.cluster.gpu.hbm_bytes / 1e9 * job.memory.gpu_memory_fraction
    kv_gb = kv_tokens_per_gpu * job.model.kv_bytes_per_token / 1e9
    reserve = usable - (probe.budget.weights_per_gpu_bytes + probe.budget.activation_bytes) / 1e9 - kv_gb
    return dataclasses.replace(job, memory=MemorySettings(activation_reserve_gb=reserve))


def snapshot(state, instance=0, last_phase="decode", capabilities=None, carry=None):
    from batchgen.policy.base import Capabilities
    progress = InstanceProgress(state.topo.instance_gpus(instance).size, last_phase=last_phase, carry=carry)
    return make_snapshot(state, instance, 0.0, progress, gpus_per_node=8,
                         capabilities=capabilities or Capabilities())


def run_on_gpu(state, ids, gpu):
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, np.full(ids.size, gpu), lookahead_tokens=1)


def test_policy_modules_import_neither_simpy_nor_torch():
    code = ("import sys, batchgen.policy, batchgen.policy.coroutine, batchgen.policy.continuous, "
            "batchgen.policy.static; bad = [m for m in ('simpy', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def under_pressure(kv_residency: str):
    """Eight sequences running on a GPU of 12 pages, each needing two for its next page: (job, state)."""
    job = squeezed(make_job("coroutine", n=8, inputs=np.full(8, 60), outputs=np.full(8, 200),
                            cluster_overrides={"num_gpus": 1}, policy_overrides={"kv_residency": kv_residency}),
                   kv_tokens_per_gpu=12 * 64 + 32)
    state = prepare(job).state
    ids = np.arange(8)
    run_on_gpu(state, ids, 0)
    state.table.decoded[ids] = np.array([3, 1, 0, 2, 4, 0, 1, 0])  # context 60..64: one page each
    state.reserve(ids, 0)
    return job, state


def test_coroutine_yields_most_decoded_first_under_memory_pressure():
    job, state = under_pressure("device")
    d = job.policy.decide(snapshot(state))
    assert state.gpu_pages[0] == 12
    # the next page needs 2 pages per sequence (16) but the GPU has 12: the two most-decoded ones go
    assert sorted(d.yield_ids.tolist()) == [0, 4]


def test_snapshot_carries_the_last_phase():
    """A policy keeps prefilling after a prefill (prefill_ahead): the snapshot must say what ran last."""
    job = make_job("coroutine", n=4, cluster_overrides={"num_gpus": 1})
    state = prepare(job).state
    assert snapshot(state, last_phase="prefill").last_phase == "prefill"
    assert snapshot(state, last_phase="decode").last_phase == "decode"


def test_mixed_residency_fills_device_pages_first_then_admits_host_resident():
    """kv_residency=mixed: the pool's head goes to device pages while they last, the rest of the b_moe slots
    run host-resident (no pages); a backend without host-resident decode gets device-resident admits only."""
    from batchgen.policy.base import Capabilities
    job = squeezed(make_job("coroutine", n=40, inputs=np.full(40, 100), outputs=np.full(40, 300),
                            cluster_overrides={"num_gpus": 1},
                            policy_overrides={"kv_residency": "mixed", "b_moe": 30}), kv_tokens_per_gpu=8 * 64)
    state = prepare(job).state
    pool = state.pending[0].peek(40)
    state.take_pending(0, pool)
    state.start_prefill_to_host(0, pool, np.zeros(40, np.int64))
    state.prefilled_to_host(0, pool, np.zeros(40, np.int64))
    d = job.policy.decide(snapshot(state, last_phase="prefill"))
    device = np.concatenate([a.ids for a in d.admits if not np.any(a.host_resident)])
    host = np.concatenate([a.ids for a in d.admits if np.all(a.host_resident)])
    assert device.size == state.gpu_pages[0] // 3  # 100 tokens + a page of growth: three pages each
    assert np.array_equal(np.concatenate([device, host]), np.arange(30))  # FIFO, b_moe slots in all
    d_dev = job.policy.decide(snapshot(state, last_phase="prefill",
                                       capabilities=Capabilities(host_resident_decode=False)))
    assert all(not np.any(a.host_resident) for a in d_dev.admits)
    assert sum(a.ids.size for a in d_dev.admits) == device.size


def test_mixed_residency_offloads_instead_of_yielding_under_memory_pressure():
    job, state = under_pressure("mixed")
    d = job.policy.decide(snapshot(state))
    assert d.yield_ids.size == 0 and sorted(d.offload_ids.tolist()) == [0, 4]  # most-decoded, still running


def test_coroutine_refills_drained_rank_from_pool_in_fifo_order():
    job = make_job("coroutine", n=20, inputs=np.full(20, 100), outputs=np.full(20, 500),
                   cluster_overrides={"num_gpus": 2})
    state = prepare(job).state
    pool = state.pending[0].peek(20)
    state.take_pending(0, pool)
    state.start_prefill_to_host(0, pool, np.zeros(20, np.int64))
    state.prefilled_to_host(0, pool, np.zeros(20, np.int64))
    state.table.decoded[pool] = 1
    state.host_used[:] = state.table.context(np.arange(20)).sum()
    d = job.policy.decide(snapshot(state, last_phase="prefill"))
    admitted = np.concatenate([a.ids for a in d.admits])
    assert np.array_equal(admitted, np.arange(20))  # FIFO: the pool's order
    ranks = np.concatenate([a.ranks for a in d.admits])
    assert set(ranks.tolist()) == {0, 1}  # both ranks get work


def test_continuous_pins_round_robin_and_prefills_first():
    job = make_job("continuous", n=10, inputs=np.full(10, 100), outputs=np.full(10, 50),
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"chunked_prefill": False})
    state = prepare(job).state
    d = job.policy.decide(snapshot(state))
    assert np.array_equal(d.pin_ranks, np.arange(10) % 2)
    assert d.prefill_ids.size == 10 and d.prefill_pinned and not d.prefill_to_host


def test_continuous_chunks_prompts_within_the_token_budget():
    """Chunked prefill (the default): each rank's forward takes prompts FIFO up to its token budget, the last
    one cut; a sequence part-way through continues first, and running sequences' decode tokens count."""
    job = make_job("continuous", n=10, inputs=np.full(10, 100), outputs=np.full(10, 50),
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"token_budget": 250})
    state = prepare(job).state
    d = job.policy.decide(snapshot(state))
    assert d.prefill_ids.size == 0 and d.prefill_pinned
    assert d.chunk_ids.tolist() == [0, 2, 4, 1, 3, 5] and d.chunk_ranks.tolist() == [0, 0, 0, 1, 1, 1]
    assert d.chunk_lens.tolist() == [100, 100, 50] * 2
    from batchgen.engine import InstanceProgress, apply_decision
    plan = apply_decision(state, 0, d, InstanceProgress(2))
    assert plan.phase == "prefill" and plan.steps == 1 and plan.chunk_completes.tolist() == [True, True, False] * 2
    t = state.table
    assert t.prefilled[[4, 5]].tolist() == [50, 50] and t.prefilled[[0, 1]].tolist() == [0, 0]
    assert t.pages[4] == -(-50 // job.page_tokens) and t.pages[0] == -(-101 // job.page_tokens)
    t.decoded[[0, 1, 2, 3]] = 1  # as the forward's outcome would record
    d = job.policy.decide(snapshot(state))
    # two decodes per rank, then the cut prompt's last 50 tokens, then the next prompts within 248 tokens
    assert d.chunk_ids.tolist() == [4, 6, 8, 5, 7, 9] and d.chunk_lens.tolist() == [50, 100, 98] * 2


def _one_gpu_with_running(running: int, admission: str, **knobs):
    """A 1-GPU rank of ~2,900 KV tokens, `running` sequences decoding on it and the rest of 10 prompts waiting."""
    job = squeezed(make_job("continuous", n=10, inputs=np.full(10, 100), outputs=np.full(10, 2000),
                            cluster_overrides={"num_gpus": 1, "gpus_per_node": 1},
                            policy_overrides={"admission": admission, "reserve_max_tokens": 1000, **knobs}), 3000)
    state = prepare(job).state
    run_on_gpu(state, np.arange(running), 0)
    return job, state


def test_conservative_admission_holds_back_prompts_greedy_would_admit():
    """SGLang's rule: a new prompt (100 tokens + min(max_tokens, clip) = 1,100) needs room beside each running
    sequence's reserve, min(max_tokens - generated, clip) x 0.7 = 700 tokens; greedy admits while pages last."""
    for running, greedy_takes, conservative_takes in ((4, 6, 0), (1, 9, 1)):
        taken = {}
        for admission in ("greedy", "conservative"):
            job, state = _one_gpu_with_running(running, admission)
            d = job.policy.decide(snapshot(state))
            assert d.evict_ids.size == 0
            taken[admission] = d.chunk_ids.tolist()
        assert taken["greedy"] == list(range(running, running + greedy_takes))
        assert taken["conservative"] == list(range(running, running + conservative_takes))
    job, state = _one_gpu_with_running(0, "conservative")  # an empty rank always takes its first prompt
    assert job.policy.decide(snapshot(state)).chunk_ids.tolist() == [0, 1]
    with pytest.raises(ValueError, match="chunked_prefill"):
        make_job("continuous", policy_overrides={"admission": "conservative", "chunked_prefill": False})


def test_greedy_admission_waits_for_a_whole_chunks_pages_while_decodes_run():
    """vLLM V1 allocates a chunk's slots whole or not at all: beside running decodes, a prompt whose pages are not
    all free waits for finishes to free them (it is not cut to the free pages); on a rank where nothing decodes,
    nothing would free them, so the chunk is cut to what is free."""
    def job_with(inputs, running):
        job = squeezed(make_job("continuous", n=len(inputs), inputs=np.array(inputs), outputs=np.full(len(inputs), 50),
                                cluster_overrides={"num_gpus": 1, "gpus_per_node": 1}), 3000)
        state = prepare(job).state
        run_on_gpu(state, np.arange(running), 0)
        return job, state

    job, state = job_with([1000, 1000, 2500, 100], running=2)
    snap = snapshot(state)
    P = snap.page_tokens
    free_tokens = (snap.pages_capacity[0] * 0.99 - (-(-(snap.active_context + 64) // P)).sum()) * P
    assert 0 < free_tokens < 2500  # the head prompt does not fit whole
    d = job.policy.decide(snap)
    assert d.chunk_ids.size == 0 and d.evict_ids.size == 0  # it waits, and the prompt behind it too (FIFO)
    job, state = job_with([1500, 1500], running=0)  # together more than the pool, nothing decoding
    d = job.policy.decide(snapshot(state))
    assert d.chunk_ids.tolist() == [0, 1] and d.chunk_lens[0] == 1500 and 0 < d.chunk_lens[1] < 1500


def test_unmixed_chunks_run_alone_with_the_whole_budget_while_decodes_wait():
    """mixed_chunks=false (SGLang's default): a forward of chunks carries no decode, so the running sequences'
    tokens take nothing from its budget, and they wait for it (the plan decodes nothing)."""
    from batchgen.engine import InstanceProgress, apply_decision
    lens = {}
    for mixed in (True, False):
        job, state = _one_gpu_with_running(4, "greedy", token_budget=250, mixed_chunks=mixed)
        d = job.policy.decide(snapshot(state))
        lens[mixed] = d.chunk_lens.tolist()
        assert d.chunks_only is not mixed
        plan = apply_decision(state, 0, d, InstanceProgress(1))
        assert plan.phase == ("mixed" if mixed else "prefill") and plan.decode_ids.size == (4 if mixed else 0)
    assert lens == {True: [100, 100, 46], False: [100, 100, 50]}


def test_unmixed_chunks_hold_only_their_own_ranks_decodes():
    """Each data-parallel attention rank is its own scheduler (SGLang's DP attention): the rank that prefills runs
    its chunks alone while its running sequences wait, and the other rank decodes in the same forward."""
    from batchgen.engine import apply_decision
    job = squeezed(make_job("sglang_opt", n=10, inputs=np.full(10, 100), outputs=np.full(10, 2000),
                            cluster_overrides={"num_gpus": 2, "gpus_per_node": 2},
                            policy_overrides={"token_budget": 250}), 3000)
    state = prepare(job).state
    run_on_gpu(state, np.arange(3), 0)
    run_on_gpu(state, np.arange(3, 6), 1)
    d = job.policy.decide(snapshot(state))
    assert d.chunks_only and d.chunk_ids.size and set(d.chunk_ranks.tolist()) == {0, 1}
    keep = d.chunk_ranks == 1  # only rank 1 takes a chunk: rank 0 decodes beside it
    d.chunk_ids, d.chunk_ranks, d.chunk_lens = d.chunk_ids[keep], d.chunk_ranks[keep], d.chunk_lens[keep]
    plan = apply_decision(state, 0, d, InstanceProgress(2))
    assert sorted(plan.decode_ids.tolist()) == [0, 1, 2] and plan.waiting == 3


def test_a_chunks_only_forward_counts_the_decodes_that_wait_for_it_as_running(monkeypatch):
    """Beside a forward of chunks alone (mixed_chunks=false) the running sequences wait, but they still run (they hold
    their KV and decode next): its step record counts them, so the time-weighted `running` metric does not fall when
    the chunks run alone (tests/test_sim_paths.py's unmixed case holds the cheaper paths to the same records)."""
    from batchgen.engine import apply_decision
    from test_sim_paths import vidur_like
    job, state = _one_gpu_with_running(4, "greedy", token_budget=250, mixed_chunks=False)
    plan = apply_decision(state, 0, job.policy.decide(snapshot(state)), InstanceProgress(1))
    assert plan.phase == "prefill" and plan.waiting == 4 and plan.chunk_ids.size == 3
    job = vidur_like("sglang_opt", n=60, mixed_chunks=False)
    after = []  # per run: sequences running on the instance once it ended, and those that ended in it

    def observe(plan, result):
        state = observe.state
        after.append((state.active[0].size, int(result.finished.sum() + result.chunk_finished.sum()), plan))
    import batchgen.sim.run as run
    real_prepare = run.prepare

    def prepare_and_watch(*a, **k):  # the observer reads the run's state
        prepared = real_prepare(*a, **k)
        observe.state = prepared.state
        return prepared
    monkeypatch.setattr(run, "prepare", prepare_and_watch)
    out = simulate(job, progress=False, on_step=observe)
    alone = [(r, a) for r, a in zip(out.records, after) if "chunks_only" in r.decision.flags]
    assert any(a[2].waiting for _, a in alone), "some forward of chunks alone ran while sequences decoded"
    for r, (active, ended, plan) in alone:  # no decode ran, so every sequence of the forward is still there
        assert r.running == plan.chunk_ids.size + plan.waiting == active + ended


def test_conservative_ratio_decays_per_forward_and_is_reestimated_after_a_preemption():
    """The ratio travels from one decision to the next in `Decision.carry` (the engine hands it to the next
    snapshot): the policy itself keeps nothing."""
    job, state = _one_gpu_with_running(4, "conservative", new_token_ratio_decay=0.002)
    p = job.policy
    first = p.decide(snapshot(state))
    assert first.carry["ratio"].tolist() == [0.7]
    again = p.decide(snapshot(state, carry=first.carry))  # no forward ran since: same ratio (and decision)
    assert again.carry["ratio"].tolist() == [0.7]
    assert p.decide(snapshot(state)).carry["ratio"].tolist() == [0.7]  # no carry: a job's first decision
    state.table.decoded[:4] = 200  # 200 decode forwards later
    later = p.decide(snapshot(state, carry=again.carry))
    assert later.carry["ratio"][0] == pytest.approx(0.3)
    state.table.decoded[:4] = 500  # later: at the floor
    floor = p.decide(snapshot(state, carry=later.carry))
    assert floor.carry["ratio"][0] == pytest.approx(0.1)
    # the running sequences outgrow the pool: the newest are preempted, and the ratio is SGLang's retract
    # estimate over those kept, (generated + 20 each) / max_tokens, at most 1
    state.table.decoded[:4] = 650
    d = p.decide(snapshot(state, carry=floor.carry))
    kept = 4 - d.evict_ids.size
    assert 0 < kept < 4
    assert d.carry["ratio"][0] == pytest.approx(min(1.0, (650 + 20) * kept / (1000 * kept + 1)))


def test_static_waits_for_the_whole_batch():
    job = make_job("static", n=6, inputs=np.full(6, 10), outputs=np.full(6, 100), cluster_overrides={"num_gpus": 1},
                   policy_overrides={"batch_size": 3})
    state = prepare(job).state
    run_on_gpu(state, np.arange(3), 0)
    state.pending[0].take_head_ids(np.empty(0, np.int64))
    d = job.policy.decide(snapshot(state))
    assert d.prefill_ids.size == 0  # the running batch is not done: nothing new joins
    assert d.padded and d.stop == "rank_drains"


def test_memory_pressure_makes_each_policy_yield_or_preempt_and_still_finish():
    inputs, outputs = np.full(40, 200), np.full(40, 600)
    for policy, counter in (("coroutine", "yields"), ("continuous", "recomputes"), ("static", "recomputes")):
        job = squeezed(make_job(policy, n=40, inputs=inputs, outputs=outputs, cluster_overrides={"num_gpus": 2}),
                       kv_tokens_per_gpu=4000)
        out = simulate(job)
        t = out.prepared.state.table
        assert np.array_equal(t.decoded, t.output_len)
        assert getattr(t, counter).sum() > 0, policy
        assert np.all(out.prepared.state.peak_pages <= out.prepared.state.gpu_pages)


def test_coroutine_partitions_only_long_stragglers():
    """Two stragglers remain: with contexts below partition_min_context the per-layer collective would cost
    more than the attention it splits, so they are not partitioned; lowering the threshold partitions them."""
    outputs = np.full(64, 50)
    outputs[:2] = 3000  # two stragglers
    short = simulate(make_job("coroutine", n=64, inputs=np.full(64, 500), outputs=outputs)).prepared.state.table
    assert short.partitions.sum() == 0
    forced = simulate(make_job("coroutine", n=64, inputs=np.full(64, 500), outputs=outputs,
                               policy_overrides={"partition_min_context": 1000})).prepared.state.table
    assert forced.partitions[:2].min() >= 1 and forced.partitions[2:].sum() == 0


def test_coroutine_recomputes_instead_of_overflowing_host_memory():
    """A host pool that holds a few sequences: the job still finishes, and the host is never over capacity."""
    import dataclasses
    job = make_job("coroutine", n=60, inputs=np.full(60, 300), outputs=np.full(60, 700),
                   cluster_overrides={"num_gpus": 2})
    probe = prepare(job)
    weights_node = host_weight_bytes(job.model, probe.latency, job.cluster.node_size)
    host_gb = job.cluster.host_mem_gb_per_node
    fraction = (weights_node + 6000 * job.model.kv_bytes_per_token) / (host_gb * 1e9)
    job = dataclasses.replace(job, memory=MemorySettings(host_memory_fraction=fraction))
    out = simulate(job)
    s, t = out.prepared.state, out.prepared.state.table
    assert s.host_kv_tokens[0] < 7000
    assert np.array_equal(t.decoded, t.output_len)
    assert np.all(s.peak_host <= s.host_kv_tokens)
    assert t.recomputes.sum() > 0


def test_drained_instance_steals_suspended_work_from_another():
    """Round-robin puts every long sequence on instance 0; instance 1 drains early and, with
    migrate_across_instances, takes suspended sequences from instance 0's host pools (over the network)."""
    outputs = np.where(np.arange(200) % 2 == 0, 2000, 50)
    runs = {}
    for steal in (True, False):
        job = make_job("coroutine", model="qwen3_30b_a3b", cluster="h100_64", n=200, inputs=np.full(200, 200),
                       outputs=outputs, cluster_overrides={"num_gpus": 16, "gpus_per_instance": 8},
                       policy_overrides={"b_moe": 4, "migrate_across_instances": steal})
        runs[steal] = simulate(job).prepared.state.table
    stolen = (runs[True].instance[::2] == 1) & (runs[True].migrations[::2] > 0)
    assert stolen.sum() > 0
    assert np.all(runs[False].instance[::2] == 0)
    assert runs[True].finish_time.max() < runs[False].finish_time.max()


def test_decide_is_a_pure_function_of_the_snapshot():
    """Same snapshot, same decision, and the state is untouched: policies keep no hidden state."""
    job = make_job("coroutine", n=30, inputs=np.full(30, 100), outputs=np.full(30, 400),
                   cluster_overrides={"num_gpus": 2})
    state = prepare(job).state
    run_on_gpu(state, np.arange(10), 0)
    before = (state.table.where.copy(), state.table.decoded.copy(), len(state.pending[0]))
    snap = snapshot(state)
    for policy, knobs in (("coroutine", {}), ("continuous", {}), ("continuous", {"admission": "conservative"}),
                          ("static", {})):
        p = make_job(policy, policy_overrides=knobs).policy
        a, b = p.decide(snap), p.decide(snap)
        assert np.array_equal(a.prefill_ids, b.prefill_ids) and np.array_equal(a.yield_ids, b.yield_ids)
        assert [x.ids.tolist() for x in a.admits] == [x.ids.tolist() for x in b.admits]
    assert np.array_equal(state.table.where, before[0]) and np.array_equal(state.table.decoded, before[1])
    assert len(state.pending[0]) == before[2]
    with pytest.raises(ValueError):
        snap.lengths.decoded[0] = 5  # the snapshot is read-only


def test_decisions_serialise_for_a_multi_process_backend():
    """Rank 0 will decide and broadcast decisions (pickled by torch.distributed): every field must round-trip,
    so the decision under test sets every one of them."""
    import dataclasses
    import pickle
    from batchgen.policy.base import Admit, Decision
    arr = lambda *v: np.array(v, np.int64)  # noqa: E731
    d = Decision(pin_ids=arr(1, 2), pin_ranks=arr(0, 1), evict_ids=arr(3), yield_ids=arr(4), offload_ids=arr(5),
                 move_ids=arr(6), move_ranks=arr(1), admits=[Admit(0, arr(7, 8), arr(1, 0), np.array([True, False]))],
                 partition_ids=arr(9), partition_degree=arr(2), prefill_ids=arr(10, 11), prefill_ranks=arr(0, 1),
                 prefill_pinned=True, prefill_to_host=True, host_sync=True, steps=17, stop="first_finish",
                 micro_batch=5, cpu_attention=True, padded=True, chunk_ids=arr(12), chunk_ranks=arr(1),
                 chunk_lens=arr(300), chunks_only=True, ffn_schedule="pipelined", carry={"ratio": np.array([0.5])})
    back = pickle.loads(pickle.dumps(d))
    for f in dataclasses.fields(Decision):
        a, b = getattr(d, f.name), getattr(back, f.name)
        assert f.name in ("admits", "carry") or not np.array_equal(a, getattr(Decision(), f.name)), f"{f.name} unset"
        if f.name == "carry":
            assert np.array_equal(a["ratio"], b["ratio"])
        elif f.name == "admits":
            assert [(x.node, x.ids.tolist(), x.ranks.tolist(), np.asarray(x.host_resident).tolist()) for x in a] \
                == [(x.node, x.ids.tolist(), x.ranks.tolist(), np.asarray(x.host_resident).tolist()) for x in b]
        else:
            assert np.array_equal(a, b), f.name


@pytest.mark.parametrize("long_prompt, fits", [(70, True), (78, False)])
def test_coroutine_moves_only_toward_less_loaded_ranks_and_in_an_order_the_executors_can_carry_out(long_prompt,
                                                                                                  fits):
    """The tail: 0 alone on GPU 1 (9 or 10 of 12 pages), 1 and 2 on GPU 0 (3 + 2 pages). The rebalance proposes
    no move: swapping them would leave the larger load as large (71 against 38 tokens either way round), and a
    sequence only goes toward a less loaded rank. The swap itself fits at the end either way; one move at a time
    it fits only with 0 in 9 pages (1 leaves for GPU 1 first, then 0 arrives, then 2); with 10 no order fits (0
    arrives only once 1 has left, and 1 only once 0 has), so `moves_fit` refuses it, as the state would."""
    from batchgen.engine import apply_decision
    from batchgen.policy.tail import moves_fit

    job = make_job("coroutine", n=3, inputs=np.array([long_prompt, 22, 14]), outputs=np.full(3, 8), page_tokens=8,
                   cluster_overrides={"num_gpus": 2, "gpus_per_node": 2, "gpus_per_instance": 2})
    prepared = prepare(job, kv_pages_per_gpu=12)
    state = prepared.state
    ids = np.arange(3)
    state.take_pending(0, ids)
    state.prefilled_to_gpu(0, ids, np.array([1, 0, 0]), lookahead_tokens=1)
    state.advance(ids, np.ones(3, np.int64), host_sync=False)
    assert state.pages_used.tolist() == [5, 9 if fits else 10]
    snap = snapshot(state)
    d = prepared.policy.decide(snap)
    assert not d.admits and not d.partition_ids.size and not d.move_ids.size
    swap = np.array([0, 1, 1])
    assert moves_fit(snap, snap.active_ids, swap, snap.active_rank) is fits
    if fits:
        apply_decision(state, 0, dataclasses.replace(d, move_ids=ids, move_ranks=swap), InstanceProgress(2))
        assert state.table.where[:3].tolist() == [0, 1, 1]
        state.check()


def test_split_by_budget_gives_each_rank_a_fifo_run_within_its_budget():
    """The candidates in order, each rank with budget a run that fits it (or is its one candidate) and that the
    next candidate would overflow; no rank with budget passed over while candidates remain."""
    from batchgen.policy.common import split_by_budget

    rng = np.random.default_rng(7)
    for _ in range(500):
        tokens = rng.integers(1, 50, rng.integers(0, 30))
        budget = rng.integers(-3, 120, rng.integers(0, 8))
        ranks = split_by_budget(tokens, budget)
        assert ranks.dtype == np.int64 and np.all(np.diff(ranks) >= 0) and ranks.size <= tokens.size
        start = 0
        for r in range(budget.size):
            n = int((ranks == r).sum())
            if budget[r] <= 0 or start == tokens.size:
                assert n == 0
                continue
            taken = int(tokens[start:start + n].sum())
            assert n >= 1 and (n == 1 or taken <= budget[r])
            assert start + n == tokens.size or taken + int(tokens[start + n]) > budget[r]
            start += n
        assert start == ranks.size


@pytest.mark.parametrize("key,value", [("refill_below", 7), ("refill_below", -0.1), ("partition_below", -1),
                                       ("prefill_ahead", 0), ("rebalance_ratio", 0.5), ("host_watermark", 0),
                                       ("host_watermark", "high"), ("migrate", 3), ("partition", "yes")])
def test_coroutine_refuses_a_knob_out_of_its_range(key, value):
    from batchgen.policy.coroutine import CoroutinePolicy

    with pytest.raises(ValueError, match=f"policy.{key} must be .*got {value!r}"):
        CoroutinePolicy(**{key: value})


@pytest.mark.parametrize("key,value", [("refill_below", 0), ("refill_below", 1), ("prefill_ahead", None),
                                       ("prefill_ahead", 2), ("rebalance_ratio", 1), ("partition_below", 0)])
def test_coroutine_takes_a_knob_at_the_edge_of_its_range(key, value):
    from batchgen.policy.coroutine import CoroutinePolicy

    assert getattr(CoroutinePolicy(**{key: value}), key) == value


@pytest.mark.parametrize("policy", ["continuous", "sglang_opt", "pd_disagg"])
@pytest.mark.parametrize("value", [1, 5, -0.1])
def test_admit_watermark_out_of_range_is_refused_before_the_run(policy, value):
    """At 1 or more nothing is ever admitted: the run stalled with the engine's no-progress error before."""
    from batchgen.policy import make_policy

    with pytest.raises(ValueError, match=f"policy.admit_watermark must be .*got {value}"):
        make_policy({"name": policy, "admit_watermark": value})
