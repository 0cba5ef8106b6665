"""Data-parallel prefill over expert-parallel processes (dist/dp_prefill.py): while the ring is active each
process runs its own rows through every expert, the ones it does not hold copied from its host copy into a ring
slot, with no collective; the layer gives the one-process layer's output on those rows. A dist job performs it
in the forwards that prefill, and its greedy outputs are transformers' and the executor's."""

import os
import time

import pytest
import torch

from batchgen.dist import Comm, ExpertParallelMoE
from batchgen.dist.dp_prefill import PrefillRing

from .conftest import run_procs
from .test_ep_moe import SPLITS, check_equal, kernel, layer  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


def _data_parallel(ctx, moe, x, splits):
    torch.set_grad_enabled(False)
    comm = Comm()
    ring = PrefillRing(moe, "cpu")
    ep = ExpertParallelMoE(moe, comm, ring=ring)
    mine = torch.split(x, splits)[comm.rank]
    calls = comm.calls
    ring.active = True
    got = ep(mine)
    ring.active = False
    return got, comm.calls - calls, ring.copied_bytes, len(ep.local_experts)


@pytest.mark.parametrize("procs", [2, 4])
def test_each_process_runs_its_rows_through_every_expert_alone(layer, procs, kernel):
    moe, x = layer
    got = run_procs(_data_parallel, procs, moe, x, SPLITS[procs])
    for (out, calls, copied, held), rows in zip(got, torch.split(x, SPLITS[procs])):
        with torch.no_grad():
            check_equal(out, moe(rows), kernel)  # the whole layer on this process's rows
        assert calls == 0  # no collective
        per_expert = sum(getattr(moe, n)[0].numel() * getattr(moe, n).element_size()
                         for n in ("w_gate", "w_up", "w_down"))
        assert copied == (moe.num_experts - held) * per_expert  # the experts it does not hold, from host


def test_a_dist_job_prefills_data_parallel_with_the_same_outputs(saved, loop_kernel, tmp_path, monkeypatch):
    """coroutine with prefill_parallel=dp over 2 processes (yields and migrations forced by a small KV budget):
    the forwards that prefill filled the ring, the others ran the all-to-all, and the greedy outputs are
    transformers' and the executor's."""
    from batchgen.dist import dp_prefill
    from .test_dist_backend import coroutine_job, same_as_exec

    marks = tmp_path / "filled"
    marks.mkdir()
    real = dp_prefill.PrefillRing.fill

    def counted(self, *args, **kw):  # runs in the forked workers: each layer's fill leaves a file
        (marks / f"{os.getpid()}-{time.perf_counter_ns()}").touch()
        return real(self, *args, **kw)

    monkeypatch.setattr(dp_prefill.PrefillRing, "fill", counted)
    out = same_as_exec(saved, *coroutine_job(2, kv_residency="device", prefill_parallel="dp"), 2)
    prefills = sum(1 for r in out.records if r.phase == "prefill")
    assert prefills and out.prepared.policy.prefill_parallel == "dp"
    moe_layers = saved[0].config.num_hidden_layers  # tiny_moe: every layer is MoE
    assert len(list(marks.iterdir())) == 2 * prefills * moe_layers  # both processes, every prefill forward's layers
