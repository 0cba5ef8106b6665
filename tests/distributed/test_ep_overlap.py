"""The expert all-to-all overlapped across attention micro-batches (ep_overlap.py): each micro-batch dispatched
as it is sent, the experts once over all of them, each micro-batch combined on its own. Its output equals the
one-exchange layer's over the same rows, bit for bit with the per-expert GEMM loop (every expert sees its rows in
the same order), and every rank sends as many micro-batches as the group agreed (empty ones where it has fewer)."""

import os
import time

import pytest
import torch

from batchgen.dist import Comm, ExpertParallelMoE

from .conftest import run_procs
from .test_ep_moe import SPLITS, check_equal, kernel, layer, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

# each rank's rows cut into micro-batches (sizes); ranks differ in how many they have, and one has none at all
CUTS = {2: [[15, 0, 25], [13]], 4: [[20], [], [5, 5, 9], [14]]}


def _overlapped(ctx, moe, x, splits, cuts):
    torch.set_grad_enabled(False)
    comm = Comm()
    ep = ExpertParallelMoE(moe, comm)
    mine = torch.split(x, splits)[comm.rank]
    whole = ep(mine)
    whole_counts = ep.last_tokens_per_expert
    parts = torch.split(mine, cuts[comm.rank]) if cuts[comm.rank] else []
    (m,) = ep.agree([len(parts)])
    calls = comm.calls
    exchange = ep.overlapped(m)
    for j in range(m):
        exchange.send(parts[j] if j < len(parts) else mine.new_empty(0, mine.shape[1]))
    exchange.run()
    out = [exchange.take(j) for j in range(len(parts))]
    exchange.finish()
    got = torch.cat(out) if out else mine.new_empty(0, mine.shape[1])
    return m, comm.calls - calls, got, whole, ep.last_tokens_per_expert, whole_counts


@pytest.mark.parametrize("procs", [2, 4])
def test_micro_batched_exchange_gives_the_one_exchange_layers_output(layer, procs, kernel):
    moe, x = layer
    ref, ref_counts = reference(moe, x)
    got = run_procs(_overlapped, procs, moe, x, SPLITS[procs], CUTS[procs])
    m = max(len(c) for c in CUTS[procs])
    assert [g[0] for g in got] == [m] * procs
    assert [g[1] for g in got] == [3 * m] * procs  # per micro-batch: counts, dispatch, combine
    out, whole = torch.cat([g[2] for g in got]), torch.cat([g[3] for g in got])
    if kernel == "loop":
        assert torch.equal(out, whole), f"max abs diff {(out - whole).abs().max().item()}"
    check_equal(out, ref, kernel)
    assert [n for g in got for n in g[4]] == [n for g in got for n in g[5]] == ref_counts


def _too_many(ctx, moe, x):
    torch.set_grad_enabled(False)
    ep = ExpertParallelMoE(moe, Comm())
    exchange = ep.overlapped(0)
    with pytest.raises(RuntimeError, match="agreed on 0"):
        exchange.send(x[:2])
    return True


def test_a_micro_batch_beyond_the_agreed_count_is_refused(layer):
    moe, x = layer
    assert run_procs(_too_many, 1, moe, x) == [True]


def test_a_dist_job_performs_it_with_the_outputs_of_one_exchange(saved, loop_kernel, tmp_path, monkeypatch):
    """coroutine with comm_overlap over 2 processes (yields and migrations forced by a small KV budget): every
    forward ran the overlapped layers, and the greedy outputs are transformers' and the executor's."""
    from batchgen.exec import runner as runner_module
    from .test_dist_backend import coroutine_job, same_as_exec

    marks = tmp_path / "overlapped"
    marks.mkdir()
    real = runner_module.overlapped_layers

    def counted(*args, **kw):  # runs in the forked workers: each call leaves a file
        (marks / f"{os.getpid()}-{time.perf_counter_ns()}").touch()
        return real(*args, **kw)

    monkeypatch.setattr(runner_module, "overlapped_layers", counted)
    out = same_as_exec(saved, *coroutine_job(2, kv_residency="device", comm_overlap=True), 2)
    assert len(list(marks.iterdir())) >= 2 * len(out.records)  # both processes, every forward


def test_partitioned_stragglers_go_first_and_keep_the_outputs(tmp_path_factory, loop_kernel):
    """With a PARTITIONed straggler every layer runs the head-shard exchange, then the partitioned rows' dispatch,
    then the micro-batches': the greedy outputs stay transformers' and the executor's."""
    import dataclasses

    from batchgen.dist.run import DistSettings, execute_dist
    from batchgen.exec.run import ExecSettings, execute
    from tests.exec.test_exec_parity import hf_greedy, kv_mb_for
    from .test_partition_dist import saved, straggler_job

    model, path = saved("mixtral", tmp_path_factory)
    job, outputs = straggler_job(2, 1, 2)
    job = dataclasses.replace(job, policy=dataclasses.replace(job.policy, comm_overlap=True))
    out = execute_dist(job, DistSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000),
                                         procs=2, timeout_s=30.0))
    ref = execute(straggler_job(2, 1, 2)[0],
                  ExecSettings(device="cpu", model_path=str(path), kv_budget_mb=kv_mb_for(path, 2000), threads=1))
    assert out.prepared.state.table.partitions[0] >= 1 and out.kv_traffic["partition_exchange_layers"] > 0
    for sid in range(len(outputs)):
        got = out.tokens.generated[sid]
        assert got == ref.tokens.generated[sid] == hf_greedy(model, out.tokens.prompts[sid], int(outputs[sid])), sid
