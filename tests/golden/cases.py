"""The fixed jobs whose decision traces and finish times are kept as golden files (tests/golden/*.npz).

They cover every policy, dense and MoE models, one GPU and 128, host-resident KV, migration, partition,
preemption and chunked prefill, so that a change to the engine core that changes a decision or a time anywhere
shows here, named by job, instance and boundary. `python tests/golden/record.py` writes them again; a commit
that changes one says why.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest.make_job
from conftest import make_job  # noqa: E402

POLICIES = ("coroutine", "continuous", "static", "sglang_opt", "flexgen", "moe_lightning", "zero_inference")


def vidur_like(policy, n=150, **knobs):
    """A scaled-down Vidur comparison job: Llama-2-7B (dense) on one A100, conversation-like lengths."""
    rng = np.random.default_rng(1)
    inputs, outputs = rng.integers(8, 3000, n), rng.integers(1, 600, n)
    return make_job(policy, "llama2_7b", "a100_8", inputs, outputs, policy_overrides=knobs,
                    cluster_overrides={"num_gpus": 1, "gpus_per_instance": None})


def cluster_128(policy, n=3000, **knobs):
    """Qwen3-30B-A3B on 128 H100s (two 64-GPU instances), long-tailed outputs."""
    rng = np.random.default_rng(7)
    inputs = rng.integers(64, 2048, n)
    outputs = np.minimum(rng.lognormal(5.5, 1.0, n).astype(np.int64) + 1, 4096)
    return dataclasses.replace(make_job(policy, "qwen3_30b_a3b", "h100_128", inputs, outputs,
                                        policy_overrides=knobs), check_invariants=False)


def sim_scale_like(n=20000, **knobs):
    """benchmarks/sim_scale.py's job, smaller: coroutine, Qwen3-30B-A3B on 128 H20 as two 64-GPU instances,
    LongBench 12K -> 4K; work stealing across nodes and instances, host copies that travel with it; as configured
    (its prefill planned: data parallel), or with `knobs` (expert-parallel prefill: the benchmark's own job)."""
    from omegaconf import OmegaConf

    from batchgen.confdir import conf_dir
    from batchgen.job import Job
    from batchgen.policy import make_policy
    from batchgen.setup import policy_config
    from batchgen.specs import load_cluster, load_model
    from batchgen.workload import build_workload

    model = load_model("qwen3_30b_a3b")
    wcfg = OmegaConf.load(conf_dir() / "workload" / "longbench_12k_4k.yaml")
    wcfg.num_sequences = n
    return Job(model, load_cluster("h20_128"), build_workload(wcfg, seed=0),
               make_policy(policy_config("coroutine", model, **knobs)))


def offload_moe(policy, n=40):
    """Mixtral-8x7B on one 24 GB A5000 with host memory: the offloading systems' own setting."""
    rng = np.random.default_rng(3)
    return make_job(policy, "mixtral_8x7b", "a5000_1", rng.integers(128, 1024, n), rng.integers(16, 256, n))


CASES = {
    **{f"{p}-a100": (lambda p=p: vidur_like(p)) for p in POLICIES},
    **{f"{p}-mixtral-a5000": (lambda p=p: offload_moe(p)) for p in ("coroutine", "flexgen", "moe_lightning",
                                                                     "zero_inference")},
    **{f"{p}-128": (lambda p=p: cluster_128(p)) for p in ("coroutine", "continuous", "static", "sglang_opt")},
    "pd_disagg-tiny-2x4": lambda: make_job("pd_disagg", "tiny_moe", "h100_8", n=80),
    "continuous-whole-prompts": lambda: vidur_like("continuous", chunked_prefill=False),
    "continuous-conservative": lambda: vidur_like("continuous", n=80, admission="conservative", token_budget=512),
    # several ranks and instances, host-resident KV, migration and partition
    "coroutine-host-2x8": lambda: make_job(
        "coroutine", "qwen3_30b_a3b", "h20_16", np.full(40, 3000), np.arange(1, 41) * 40,
        policy_overrides={"kv_residency": "mixed", "b_moe": 8, "partition_min_context": 1024}),
    "coroutine-128-partition": lambda: cluster_128("coroutine", partition_min_context=512),
    "coroutine-h20-128-longbench": sim_scale_like,
    "coroutine-h20-128-longbench-ep": lambda: sim_scale_like(prefill_parallel="ep"),
    "coroutine-a100-yielding": lambda: vidur_like("coroutine", kv_residency="device"),
    "coroutine-a100-offloading": lambda: vidur_like("coroutine", kv_residency="mixed"),
    "static-tiny-8": lambda: make_job("static", "tiny_moe", "h100_8", n=80),
    "continuous-tiny-8": lambda: make_job("continuous", "tiny_moe", "h100_8", n=80,
                                          policy_overrides={"token_budget": 300}),
    # one rank short of KV pages: preemption (greedy), a tight pool, chunks alone
    "continuous-a100-preempting": lambda: vidur_like("continuous", n=120),
    "sglang_opt-a100-small-pool": lambda: vidur_like("sglang_opt", n=120),
    "sglang_opt-a100-unmixed": lambda: vidur_like("sglang_opt", n=120, mixed_chunks=False),
}
KV_PAGES = {"continuous-a100-preempting": 400, "sglang_opt-a100-small-pool": 400, "coroutine-a100-yielding": 400,
            "coroutine-a100-offloading": 300}  # pages per GPU
