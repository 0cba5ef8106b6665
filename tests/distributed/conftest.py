"""Multi-process tests: workers are forked (no re-import of torch: starting one takes milliseconds instead of
seconds), one torch thread each, gloo on CPU. Build models and references in the test process with one thread
too (the thread count can change a GEMM's last bits); forked workers inherit them without pickling."""

import os
import signal

import pytest
import torch

from batchgen.dist import launch
from batchgen.dist import worker as worker_module
from batchgen.exec.models import moe as moe_module


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Mixtral saved as a Hugging Face directory, and the model (the reference for greedy outputs)."""
    from tests.exec.test_models import tiny_hf

    model = tiny_hf("mixtral")
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return model, path


@pytest.fixture
def loop_kernel(monkeypatch):
    """The loop expert kernel in this process and in the forked workers: an expert's GEMM sees the same rows in
    the same order with and without expert parallelism, so logits agree bit for bit."""
    monkeypatch.setitem(moe_module._GROUPED, ("cpu", torch.float32), False)


@pytest.fixture
def kill_at(monkeypatch):
    """kill_at(rank, n[, sig]): the process of launch rank `rank` sends itself `sig` (SIGKILL; SIGSTOP: a
    stalled process, alive but silent) at its n-th forward (the forked workers inherit the patch; the
    launcher's RANK is the launch rank, whatever a recovery renumbers)."""
    forward = worker_module.RankWorker._forward
    calls = {"n": 0}
    victim = {}

    def dying(self, part, cmd):
        calls["n"] += 1
        if int(os.environ.get("RANK", -1)) == victim["rank"] and calls["n"] == victim["n"]:
            os.kill(os.getpid(), victim["sig"])
        return forward(self, part, cmd)

    def arm(rank: int, n: int, sig: int = signal.SIGKILL) -> None:
        victim.update(rank=rank, n=n, sig=sig)
        monkeypatch.setattr(worker_module.RankWorker, "_forward", dying)

    return arm


def run_procs(fn, procs: int, *args, expect_ok: bool = True, **kw):
    """fn(ctx, *args) on `procs` forked processes; their return values by rank (all must succeed unless
    expect_ok is False, then the WorkerResults)."""
    kw.setdefault("join_timeout_s", 60)
    results = launch(fn, procs, args, start_method="fork", **kw)
    if not expect_ok:
        return results
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"rank {r.rank}: exit {r.exitcode}\n{r.error}" for r in bad)
    return [r.value for r in results]
