"""Coroutine's all-to-all overlapped across attention micro-batches (`policy.comm_overlap`): its closed form, what
the simulator and the planner price with it, and the backends and layouts that refuse it."""

import numpy as np
import pytest

from batchgen.memory import ConfigError
from batchgen.plan.decode import overlapped_all_to_all
from batchgen.engine.loop import check_supported
from batchgen.policy.base import Capabilities
from batchgen.policy.coroutine import CoroutinePolicy
from batchgen.sim.run import simulate
from conftest import make_job


class _Linear:
    """A latency model whose all-to-all is a fixed latency per phase plus a cost per token (both phases)."""

    def all_to_all(self, total):
        return 2.0 * (1.0 + 0.01 * np.asarray(total, float))


def test_one_micro_batch_leaves_the_all_to_all_serial():
    exposed = overlapped_all_to_all(_Linear(), np.array([800.0]), np.array([5.0]), np.array([3.0]), np.array([1.0]))
    assert exposed == pytest.approx(_Linear().all_to_all(800.0))


def test_long_attention_hides_all_but_one_dispatch_and_one_combine():
    """4 micro-batches of 200 tokens: a phase of one is 1 + 2 = 3 s; attention of 40 s (10 s each) hides the
    other three dispatches, and the combines after the first overlap the next layer: 2 x 3 s exposed."""
    exposed = overlapped_all_to_all(_Linear(), np.array([800.0]), np.array([40.0]), np.array([3.0]),
                                    np.array([4.0]))
    assert exposed == pytest.approx([6.0])


def test_short_attention_pays_every_micro_batch_latency():
    """Attention of 0.4 s cannot hide four 3 s dispatches: the chain is 0.1 + 4 x 3 + E + 3, the communication
    stream 8 x 3 = 24 s longer still, so 24 s less the compute's 0.4 + E are exposed: more than the serial 2 x
    (1 + 8) = 18 s, since each micro-batch pays the collective's latency."""
    experts = np.array([3.0])
    exposed = overlapped_all_to_all(_Linear(), np.array([800.0]), np.array([0.4]), experts, np.array([4.0]))
    assert exposed == pytest.approx([24.0 - 0.4 - 3.0])
    assert exposed > _Linear().all_to_all(800.0)


def _moe_job(**knobs):
    return make_job("coroutine", "tiny_moe", "h100_8", n=120, check_invariants=False,
                    policy_overrides={"attention_tp": 1, "kv_residency": "device", "b_moe": 32, **knobs})


def test_the_simulator_prices_the_overlap_where_there_are_micro_batches():
    """Four micro-batches per rank: the overlap changes the price (and only that: the decisions are the same);
    one micro-batch per rank: nothing to overlap, the same BCT."""
    def bct(**knobs):
        out = simulate(_moe_job(**knobs), progress=False)
        return float(np.nanmax(out.prepared.state.table.finish_time)), len(out.records)

    (serial, steps), (overlapped, steps_o) = bct(b_attn=8), bct(b_attn=8, comm_overlap=True)
    assert steps == steps_o and overlapped != pytest.approx(serial, rel=1e-9)
    one, one_o = bct(b_attn=32), bct(b_attn=32, comm_overlap=True)
    assert one_o[0] == pytest.approx(one[0], rel=1e-9)


def test_a_backend_that_does_not_perform_it_refuses_it():
    """backend=exec (one process: no all-to-all to overlap) declares no comm_overlap; backend=dist performs it
    (tests/distributed/test_ep_overlap.py)."""
    with pytest.raises(ConfigError, match="policy.comm_overlap=false"):
        check_supported(CoroutinePolicy(comm_overlap=True), Capabilities(comm_overlap=False))


def test_host_resident_kv_refuses_it_before_the_run():
    with pytest.raises(ConfigError, match="device-resident decode only"):
        simulate(_moe_job(kv_residency="host", b_attn=8, comm_overlap=True), progress=False)
