"""On the executor the plan line names the hardware its predictions price, and says when that is not the device
the run measures on (a CPU run with the config's cluster=h100_8 must not read as 355,786 tok/s on a CPU)."""

from __future__ import annotations

from types import SimpleNamespace

from batchgen.experiment import plan_line
from batchgen.specs import load_cluster

TEXT = "plan: b_attn=32 b_moe=4; predicted 26,710 decode tok/s per instance"


def out_on(backend: str, device: str, cluster: str = "h100_8"):
    spec = load_cluster(cluster)
    return SimpleNamespace(backend=backend, device=device, job=SimpleNamespace(cluster=spec))


def test_a_cpu_run_priced_as_a_gpu_says_so_and_how_to_price_the_cpu():
    line = plan_line(TEXT, out_on("exec", "cpu"))
    assert line.startswith("plan (priced as h100, cluster.gpu): b_attn=32")
    assert "not this run's cpu" in line and "cluster.gpu=cpu_epyc_milan_2c" in line
    assert "\n" not in line


def test_a_gpu_run_priced_as_a_gpu_names_it_only():
    line = plan_line(TEXT, out_on("exec", "cuda:0"))
    assert line == TEXT.replace("plan:", "plan (priced as h100, cluster.gpu):")


def test_the_simulator_line_is_unchanged():
    assert plan_line(TEXT, out_on("sim", "")) == TEXT
