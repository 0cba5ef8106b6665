"""A batch job, fully specified: what to run (model, workload), where (cluster) and how (policy, settings)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from batchgen.core.sequences import SequenceTable
from batchgen.core.state import ClusterState, Topology
from batchgen.latency import Efficiency, LatencyModel, LatencySettings, build_latency
from batchgen.memory import (ConfigError, MemoryBudget, MemorySettings, batch_shape_of, check_prompts_fit,
                             plan_memory)
from batchgen.plan.planner import Plan, WorkloadStats, needs_plan, plan_job
from batchgen.policy.base import Policy
from batchgen.specs import ClusterSpec, ModelSpec
from batchgen.workload import Workload


@dataclass(frozen=True)
class Job:
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    policy: Policy
    memory: MemorySettings = field(default_factory=MemorySettings)
    efficiency: Efficiency = field(default_factory=Efficiency)
    latency: LatencySettings = field(default_factory=LatencySettings)
    page_tokens: int = 64
    routing_skew: float = 0.0
    check_invariants: bool = False

    def __post_init__(self):
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.routing_skew < 0:
            raise ValueError(f"routing_skew must be >= 0 (0 routes uniformly), got {self.routing_skew}")


@dataclass
class Prepared:
    """What every backend builds from a job before running it; building it validates the job."""

    latency: LatencyModel
    budget: MemoryBudget
    state: ClusterState
    cluster: ClusterSpec  # as run: a dense model's GPUs are each their own instance
    policy: Policy | None = None  # the job's policy with its "auto" knobs resolved by the plan: run this one
    plan: Plan | None = None      # the static plan, when the policy had "auto" knobs


def topology(cluster: ClusterSpec) -> Topology:
    gpus = np.arange(cluster.num_gpus)
    return Topology(gpu_node=gpus // cluster.node_size, gpu_instance=gpus // cluster.instance_size,
                    num_nodes=cluster.num_nodes, num_instances=cluster.num_instances)


def effective_cluster(job: Job) -> ClusterSpec:
    """The cluster as it runs: a dense model has no experts to spread, so every GPU runs its own replica,
    data parallel, and no GPU waits for another (tensor parallelism is not modelled yet). A policy with an
    `instance_gpus(num_gpus, node_size)` method sizes the instances itself (PD-disaggregation's units)."""
    if not job.model.is_moe:
        if callable(getattr(job.policy, "instance_gpus", None)):
            raise ConfigError(f"policy {job.policy.name} lays out expert-parallel units; {job.model.name} is dense "
                              "(every GPU runs its own replica): use an MoE model or another policy")
        return dataclasses.replace(job.cluster, gpus_per_instance=1)
    layout = getattr(job.policy, "instance_gpus", None)  # a policy that sizes its instances (PD's units)
    if callable(layout):
        return dataclasses.replace(job.cluster, gpus_per_instance=layout(job.cluster.num_gpus, job.cluster.node_size))
    return job.cluster


def prepare(job: Job, kv_pages_per_gpu: int | None = None, pool_fix: str | None = None) -> Prepared:
    """kv_pages_per_gpu: the KV pool a real backend allocated, instead of the one planned from the specs
    (`pool_fix`: the setting that enlarges it, for the error when a sequence cannot fit it).

    A policy whose b_attn / b_moe / kv_residency / attention are "auto" is planned first (batchgen.plan): the
    plan's choice replaces the "auto" knobs (`Prepared.policy`) and decides which expert weights stream
    (`plan_memory`'s streamed_layers); explicit knobs are kept and restrict the plan."""
    m, c = job.model, effective_cluster(job)
    lat = build_latency(job.latency, m, c.gpu, job.efficiency, ep_ranks=c.instance_size, gpus_per_node=c.node_size,
                        routing_skew=job.routing_skew, use_fp8=m.weight_bytes == 1, host=c.host)
    w = job.workload
    policy, plan = job.policy, None
    if getattr(policy, "attention", None) == "cpu" and m.attention == "mla":
        raise ConfigError(f"policy.attention=cpu is not offered for {m.name}: its MLA latent KV must be "
                          "up-projected on the GPU before attention; use policy.attention=gpu or auto")
    max_context = int((w.input_lens + w.output_lens).max()) if len(w) else 0
    resolve = getattr(policy, "resolve_for_job", None)
    if len(w) and callable(resolve):  # a system that sizes its own schedule (the offloading systems' searches)
        from batchgen.policy.offload.search import Rig
        policy = resolve(Rig.of(m, c, lat, job.memory, w, job.page_tokens))
    if len(w) and needs_plan(policy):
        try:
            plan = plan_job(m, c, lat, job.memory, policy, WorkloadStats.of(w), page_tokens=job.page_tokens)
        except ConfigError:
            # weights that fit nowhere are the likelier cause: the memory plan says so more precisely
            plan_memory(m, c, lat, job.memory, page_tokens=job.page_tokens,
                        can_stream_weights=policy.can_stream_weights, uses_host_kv=policy.uses_host_kv,
                        policy_name=policy.name)
            raise
        policy = plan.resolve(policy)
    budget = plan_memory(m, c, lat, job.memory, page_tokens=job.page_tokens,
                         can_stream_weights=policy.can_stream_weights, uses_host_kv=policy.uses_host_kv,
                         policy_name=policy.name, batch_shape=batch_shape_of(policy, max_context),
                         max_context=max_context, streamed_layers=plan.streamed_layers if plan else None)
    if kv_pages_per_gpu is not None:
        budget = dataclasses.replace(budget, kv_pages_per_gpu=int(kv_pages_per_gpu))
    if len(w):
        check_prompts_fit(m, w.input_lens, w.output_lens, budget, policy.uses_host_kv,
                          host_resident=getattr(policy, "kv_residency", "device") in ("host", "mixed"),
                          **({"pool_fix": pool_fix} if pool_fix else {}))
    topo = topology(c)
    state = ClusterState(SequenceTable(w.input_lens, w.output_lens), topo, page_tokens=job.page_tokens,
                         gpu_pages=np.full(c.num_gpus, budget.kv_pages_per_gpu),
                         host_kv_tokens=np.full(c.num_nodes, budget.host_kv_tokens_per_node),
                         kv_bytes_per_token=m.kv_bytes_per_token, kv_split_by_heads=m.attention != "mla")
    # The upper-level split of the input over instances: round-robin keeps their loads statistically equal; a
    # policy that gives instances roles routes prompts itself (PD-disaggregation: to its prefill units only).
    route = getattr(policy, "route", None)
    state.assign_instances(route(len(w), c.num_instances) if callable(route) else np.arange(len(w)) % c.num_instances)
    return Prepared(lat, budget, state, c, policy, plan)
