"""A backend declares only what it performs: the executor runs each forward whole (one process has no all-to-all
for a second micro-batch to hide), so it declares no two-batch overlap, and a policy that asks for it is refused
before any weight is built, with the knob to change."""

import numpy as np
import pytest

from batchgen.exec.backend import exec_capabilities
from batchgen.exec.models import ExecModelConfig
from batchgen.exec.run import ExecSettings, execute
from batchgen.memory import ConfigError
from batchgen.specs import load_model
from conftest import make_job


def test_the_executor_declares_no_two_batch_overlap():
    caps = exec_capabilities(ExecModelConfig.from_spec(load_model("tiny_moe")))
    assert caps.two_batch_overlap is False
    assert caps.layerwise_offload is False and caps.host_resident_decode and caps.cpu_attention


def test_two_batch_overlap_on_a_multi_gpu_instance_is_refused_before_any_weight(monkeypatch):
    from batchgen.exec import run as exec_run

    def no_weights(*args, **kwargs):
        raise AssertionError("refused too late: the weights were being built")

    monkeypatch.setattr(exec_run, "build_model", no_weights)
    job = make_job("sglang_opt", n=4, inputs=np.full(4, 20), outputs=np.full(4, 4), page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"two_batch_overlap": True})
    with pytest.raises(ConfigError, match=r"backend=exec .*two_batch_overlap=false"):
        execute(job, ExecSettings(device="cpu", threads=1))


@pytest.mark.usefixtures("one_thread")
def test_sglang_opt_without_overlap_runs_whole_forwards():
    job = make_job("sglang_opt", n=6, inputs=np.full(6, 20), outputs=np.full(6, 6), page_tokens=8,
                   cluster_overrides={"num_gpus": 2}, policy_overrides={"two_batch_overlap": False})
    out = execute(job, ExecSettings(device="cpu", threads=1, kv_budget_mb=1))
    assert all(len(g) == 6 for g in out.tokens.generated)
    assert "tbo_forwards" not in out.kv_traffic and out.capabilities.two_batch_overlap is False
