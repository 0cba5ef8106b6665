"""A batch job, fully specified: what to run (model, workload), where (cluster) and how (policy, settings)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from batchgen.core.cascade import CascadeRule
from batchgen.core.sequences import SequenceTable
from batchgen.core.state import ClusterState, Topology
from batchgen.latency import Efficiency, LatencyModel, LatencySettings, build_latency
from batchgen.memory import (ConfigError, MemoryBudget, MemorySettings, batch_shape_of, check_prompts_fit,
                             dp_prefill_copy, group_budget, plan_memory, prefill_ring_bytes)
from batchgen.plan.planner import AUTO, PREFILL_CHUNKS, TIE, Plan, WorkloadStats, needs_plan, plan_job
from batchgen.pricing.batch import BatchTime, batch_time
from batchgen.pricing.costs import cascade_pays
from batchgen.policy.base import Policy
from batchgen.specs import ClusterSpec, ModelSpec
from batchgen.workload import Workload


@dataclass(frozen=True)
class Job:
    """A policy whose knobs are left to its engine's defaults (`Policy.for_gpu`) has them set here, from the
    cluster's GPU, so that everything built from the job sees whole numbers."""

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
    # cluster.gpus_per_instance=auto: each size priced, (GPUs per instance, predicted prefill s, decode s), and
    # `cluster` holds the size chosen (batchgen.instances); () when the cluster's size was given
    instance_plan: tuple = ()
    # policy.prefill_parallel=auto: each way priced, (ep or dp, chunk per rank, predicted prefill s, decode s), and
    # `policy` holds the one chosen (`plan_prefill`); () when the policy's way was given or there was no choice
    prefill_plan: tuple = ()

    def __post_init__(self):
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.routing_skew < 0:
            raise ValueError(f"routing_skew must be >= 0 (0 routes uniformly), got {self.routing_skew}")
        for_gpu = getattr(self.policy, "for_gpu", None)
        if callable(for_gpu):
            object.__setattr__(self, "policy", for_gpu(self.cluster.gpu))


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
    data parallel, and no GPU waits for another. A policy with an `instance_gpus(num_gpus, node_size)` method
    sizes the instances itself (PD-disaggregation's units). With tensor-parallel attention (`policy.attention_tp`
    > 1, or auto resolved so) each scheduler rank is a group of that many GPUs: the cluster as the scheduler
    sees it has one "GPU" per group (`group_cluster`)."""
    return group_cluster(_gpu_cluster(job), resolve_attention_tp(job))


def _gpu_cluster(job: Job) -> ClusterSpec:
    layout = job.policy.instance_gpus  # a policy that sizes its instances (PD's units); None: it does not
    if not job.model.is_moe:
        if callable(layout):
            raise ConfigError(f"policy {job.policy.name} lays out expert-parallel units; {job.model.name} is dense "
                              "(every GPU runs its own replica): use an MoE model or another policy")
        return dataclasses.replace(job.cluster, gpus_per_instance=1)
    if callable(layout):
        return dataclasses.replace(job.cluster, gpus_per_instance=layout(job.cluster.num_gpus, job.cluster.node_size))
    return job.cluster


def group_cluster(cluster: ClusterSpec, degree: int) -> ClusterSpec:
    """`cluster` with every `degree` consecutive GPUs (a TP-attention group, within a node) as one rank."""
    if degree == 1:
        return cluster
    return dataclasses.replace(cluster, num_gpus=cluster.num_gpus // degree,
                               gpus_per_node=max(cluster.node_size // degree, 1),
                               gpus_per_instance=cluster.instance_size // degree)


def _latency(job: Job, c: ClusterSpec, degree: int) -> LatencyModel:
    m = job.model
    kw = dict(ep_ranks=c.instance_size, gpus_per_node=c.node_size, routing_skew=job.routing_skew,
              use_fp8=m.weight_bytes == 1, host=c.host)
    lat = build_latency(job.latency, m, c.gpu, job.efficiency, **kw)
    if degree == 1:
        return lat
    from batchgen.latency.roofline import Roofline
    from batchgen.latency.tp_attention import TPAttention, shard_spec

    return TPAttention(lat, Roofline(shard_spec(m, degree), c.gpu, job.efficiency, **kw), degree)


def resolve_attention_tp(job: Job, host_prefixes: bool = True) -> int:
    """The TP-attention degree the job runs with: the policy's `attention_tp` (1 without the knob), or for
    "auto" data-parallel attention (1) when its weights, activations and longest sequence fit, and otherwise,
    of the degrees that fit, the one whose groups hold the most KV in the instance (as SGLang users run --tp
    without --enable-dp-attention when DP attention does not fit). The smallest degree that fits can leave a
    pool of two sequences: with MLA each group replicates the latent, so fewer, larger groups can hold more.
    Raises ConfigError for a degree the instance or the model's heads cannot take, or when none fits.
    `host_prefixes`: the backend's host copies share their prefix on a node (the plan counts them so)."""
    want = job.policy.attention_tp
    m, c = job.model, _gpu_cluster(job)
    if want == 1:
        return 1
    from batchgen.latency.tp_attention import attention_degrees

    degrees = attention_degrees(m, c.instance_size) if m.is_moe else (1,)
    if want != "auto":
        if want not in degrees:
            raise ConfigError(f"policy.attention_tp={want} does not fit {m.name} on {c.instance_size}-GPU instances: "
                              f"choose one of {', '.join(map(str, degrees))} (it must divide the instance's GPUs "
                              "and the model's heads and intermediates), or auto")
        return int(want)
    if len(job.workload) and needs_plan(job.policy):
        return _planned_degree(job, c, degrees, host_prefixes)
    tried, pool = [], {}
    for t in degrees:
        try:
            budget = _budget(job, _latency(job, c, t), c, dataclasses.replace(job.policy, attention_tp=t))
        except ConfigError as e:
            tried.append(f"attention_tp={t}: {e}")
            continue
        if t == 1:
            return 1
        pool[t] = budget.kv_pages_per_gpu * (c.instance_size // t)  # the instance's KV: its groups' pools
    if pool:  # the largest KV pool, the fewest all-reduce peers on a tie
        return max(pool, key=lambda t: (pool[t], -t))
    raise ConfigError(f"policy.attention_tp=auto: {m.name} fits no TP-attention degree on {c.instance_size}-GPU "
                      f"instances of {c.gpu.name}; " + "; ".join(tried[-1:])
                      + f". With attention_tp={degrees[-1]} it fits from memory.gpu_memory_fraction="
                      f"{_fraction_needed(job, _latency(job, c, degrees[-1]), c, degrees[-1]):.3f}")


def plan_stats(job: Job, policy, host_prefixes: bool = True) -> WorkloadStats:
    """What the planner reads of the job's workload, with its prefixes shared as the run shares them."""
    return WorkloadStats.of(job.workload, job.page_tokens, shares_prefixes(policy, job.workload), host_prefixes)


def _planned_degree(job: Job, c: ClusterSpec, degrees: tuple[int, ...], host_prefixes: bool = True) -> int:
    """A planned policy's (coroutine's) degree is one more planned knob: the plan of each degree that fits, and
    the degree whose plan predicts the most decode throughput over the batch (the smaller degree within the
    planner's tie). DP attention that fits only by streaming experts every iteration can lose to TP groups that
    keep them resident (DeepSeek-R1 on 8 x H20)."""

    stats = plan_stats(job, job.policy, host_prefixes)
    best = None
    for t in degrees:
        policy = dataclasses.replace(job.policy, attention_tp=t)
        lat = _latency(job, c, t)
        try:
            plan = plan_job(job.model, c, lat, job.memory, policy, stats, page_tokens=job.page_tokens)
            _budget(job, lat, c, plan.resolve(policy), plan.streamed_layers)
        except ConfigError:
            continue
        if best is None or plan.batch_tokens_per_s > best[1] * (1 + TIE):
            best = (t, plan.batch_tokens_per_s)
    # none fits: the most sharded degree, whose plan then fails with the memory plan's own explanation
    return degrees[-1] if best is None else best[0]


def _fraction_needed(job: Job, lat: LatencyModel, c: ClusterSpec, degree: int) -> float:
    """The smallest memory.gpu_memory_fraction at which weights, activations, the fixed reserve and the KV of
    the workload's longest sequence (one GPU's share of it) fit: what an SGLang user tunes --mem-fraction-static
    up to before out-of-memory."""
    from batchgen.memory import activation_bytes

    m, w = job.model, job.workload
    longest = int((w.input_lens + w.output_lens).max()) + job.page_tokens if len(w) else job.page_tokens
    policy = dataclasses.replace(job.policy, attention_tp=degree)
    shape = batch_shape_of(policy, longest)
    act = activation_bytes(m, shape, longest) if shape is not None else 0.0
    kv = longest * m.kv_bytes_per_token / (degree if m.attention == "gqa" else 1)
    need = lat.weight_bytes_per_rank() + act + job.memory.activation_reserve_gb * 1e9 + kv
    return need / c.gpu.hbm_bytes


def memory_of(job: Job, policy) -> MemorySettings:
    """The job's memory settings, with the policy's own gpu_memory_fraction where it sets one (sglang_opt: an
    expert's --mem-fraction-static, tuned to just below out-of-memory)."""
    fraction = getattr(policy, "gpu_memory_fraction", 0)
    return dataclasses.replace(job.memory, gpu_memory_fraction=fraction) if fraction else job.memory


def _budget(job: Job, lat: LatencyModel, c: ClusterSpec, policy, streamed_layers=None, kv_pages=None,
            pool_fix=None, host_kv_tokens=None, host_fix=None) -> MemoryBudget:
    """The memory budget as the scheduler sees it (per rank, a TP group's pages for TP attention), with the
    workload's longest sequence checked against it."""
    m, w = job.model, job.workload
    max_context = int((w.input_lens + w.output_lens).max()) if len(w) else 0
    budget = group_budget(plan_memory(m, c, lat, memory_of(job, policy), page_tokens=job.page_tokens,
                                      can_stream_weights=policy.can_stream_weights, uses_host_kv=policy.uses_host_kv,
                                      policy_name=policy.name, batch_shape=batch_shape_of(policy, max_context),
                                      max_context=max_context, streamed_layers=streamed_layers,
                                      prefill_ring=prefill_ring_bytes(m, lat, policy)), lat)
    if kv_pages is not None:
        budget = dataclasses.replace(budget, kv_pages_per_gpu=int(kv_pages))
    if host_kv_tokens is not None:
        budget = dataclasses.replace(budget, host_kv_tokens_per_node=min(budget.host_kv_tokens_per_node,
                                                                          int(host_kv_tokens)))
    if len(w):
        check_prompts_fit(m, w.input_lens, w.output_lens, budget, policy.uses_host_kv,
                          host_resident=getattr(policy, "kv_residency", "device") in ("host", "mixed"),
                          **({"pool_fix": pool_fix} if pool_fix else {}),
                          **({"host_fix": host_fix} if host_fix else {}))
    return budget


def planned(job: Job, host_prefixes: bool = True) -> tuple:
    """The first half of `prepare`: (the GPU cluster, the latency model, the cluster as the scheduler sees it, the
    policy with its "auto" knobs resolved, the plan or None). `host_prefixes`: as `prepare`'s."""
    m, w, gpus = job.model, job.workload, _gpu_cluster(job)
    dp = job.policy.prefill_parallel
    if dp == AUTO:
        raise ValueError("policy.prefill_parallel=auto is chosen over the whole batch first (plan_prefill)")
    if dp == "dp" and job.policy.attention_tp not in (1, "auto"):
        raise ConfigError(f"policy.prefill_parallel=dp runs each GPU's prompts through every expert on its own, "
                          f"which tensor-parallel attention groups (attention_tp={job.policy.attention_tp}) do not: "
                          "set policy.attention_tp=1, or policy.prefill_parallel=ep")
    degree = 1 if dp == "dp" else resolve_attention_tp(job, host_prefixes)  # dp prefill: dp attention
    lat = _latency(job, gpus, degree)
    c = group_cluster(gpus, degree)
    policy, plan = job.policy, None
    if degree > 1 or policy.attention_tp == "auto":
        policy = dataclasses.replace(policy, attention_tp=degree)
    if policy.two_batch_overlap and not (m.is_moe and gpus.instance_size > 1):
        # SGLang's two-batch overlap hides the expert all-to-all (over the instance's GPUs, whatever its TP
        # groups); without one (a dense model, or one GPU per instance) the engine runs whole forwards
        policy = dataclasses.replace(policy, two_batch_overlap=False)
    if getattr(policy, "attention", None) == "cpu" and m.attention == "mla":
        raise ConfigError(f"policy.attention=cpu is not offered for {m.name}: its MLA latent KV must be "
                          "up-projected on the GPU before attention; use policy.attention=gpu or auto")
    resolve = policy.resolve_for_job
    if len(w) and callable(resolve):  # a system that sizes its own schedule (the offloading systems' searches)
        from batchgen.policy.offload.search import Rig
        policy = resolve(Rig.of(m, c, lat, memory_of(job, policy), w, job.page_tokens))
    if len(w) and needs_plan(policy):
        try:
            plan = plan_job(m, gpus, lat, job.memory, policy, plan_stats(job, policy, host_prefixes),
                            page_tokens=job.page_tokens)
        except ConfigError:
            # weights that fit nowhere are the likelier cause: the memory plan says so more precisely
            plan_memory(m, gpus, lat, job.memory, page_tokens=job.page_tokens,
                        can_stream_weights=policy.can_stream_weights, uses_host_kv=policy.uses_host_kv,
                        policy_name=policy.name)
            raise
        policy = plan.resolve(policy)
    return gpus, lat, c, policy, plan


# policy.prefill_parallel=auto: expert parallel (the all-to-all on every prompt token, the chunk as the planner sizes
# it) against data parallel at each of these chunks per rank where the chunk is auto (every rank through every
# expert, the experts it lacks streamed in: no all-to-all, but a ring of two layers' experts taken from the KV pool
# and a copy per layer that only a large chunk hides); below 8,192 tokens the copy outlasts the compute
DP_CHUNKS = PREFILL_CHUNKS[:3]


def predict(job: Job) -> BatchTime:
    """The job's batch on its own plan, as `prepare` would plan it (the prefill's parallelism chosen first where
    it is auto); raises ConfigError when it does not fit."""
    if getattr(job.policy, "prefill_parallel", "ep") == AUTO:
        job = plan_prefill(job)
        if job.prefill_plan:
            return _chosen(job)
    return _predict(job)[1]


def _chosen(job: Job) -> BatchTime:
    """The prediction `plan_prefill` recorded for the way it chose."""
    policy = job.policy
    return next(BatchTime(p, d) for mode, chunk, p, d in job.prefill_plan
                if mode == policy.prefill_parallel and (mode == "ep" or chunk == policy.prefill_tokens_per_rank))


def shares_prefixes(policy, workload) -> bool:
    """Whether the run shares prompt prefixes: the policy caches them and the workload has prefix groups."""
    group = workload.prefix_group
    return bool(getattr(policy, "prefix_cache", False) and group is not None and (group >= 0).any())


def _predict(job: Job) -> tuple:
    """(the policy with its auto knobs resolved, the batch predicted on its plan)."""
    gpus, lat, c, policy, plan = planned(job)
    budget = _budget(job, lat, gpus, policy, plan.streamed_layers)
    stream_s = float(lat.h2d(budget.streamed_bytes_per_iter)) if budget.streamed_bytes_per_iter else 0.0
    dp_stream_s = (dp_prefill_copy(job.model, lat, budget.streamed_bytes_per_iter)[1]
                   if policy.prefill_parallel == "dp" else None)  # as the simulator prices it
    w = job.workload
    mean_input = float(w.input_lens.mean())
    if shares_prefixes(policy, w):
        mean_input = w.prefill_tokens()["prefill_tokens_distinct"] / len(w)  # each group's prefix computed once
    return policy, batch_time(
        lat, sequences=len(w), mean_input=mean_input, mean_output=float(w.output_lens.mean()),
        ranks=c.instance_size, instances=c.num_instances, chunk=int(policy.prefill_tokens_per_rank),
        micro_batch=int(plan.b_attn), decode_tokens_per_s=plan.batch_tokens_per_s, weight_stream_s=stream_s,
        dp_stream_s=dp_stream_s)


def plan_prefill(job: Job) -> Job:
    """The job with `policy.prefill_parallel=auto` resolved to the shortest predicted batch (expert parallel
    within the tie), its chunk too for data parallel where the chunk is auto, and every prediction in
    `Job.prefill_plan` as (mode, chunk, prefill s, decode s). Raises expert parallel's ConfigError when nothing
    fits. Where every GPU of an instance holds every expert (one GPU per instance, or a dense model), both ways
    are one: expert parallel, nothing predicted."""
    policy = job.policy
    if not job.model.is_moe or _gpu_cluster(job).instance_size == 1:
        return dataclasses.replace(job, policy=dataclasses.replace(policy, prefill_parallel="ep"))
    chunks = DP_CHUNKS if policy.prefill_tokens_per_rank == AUTO else (policy.prefill_tokens_per_rank,)
    trials = [dataclasses.replace(policy, prefill_parallel="ep")]
    trials += [dataclasses.replace(policy, prefill_parallel="dp", prefill_tokens_per_rank=c) for c in chunks]
    rows, first_error = [], None
    for trial in trials:
        try:
            resolved, t = _predict(dataclasses.replace(job, policy=trial))
        except ConfigError as e:
            first_error = first_error or e
            continue
        rows.append((resolved, t))
    if not rows:
        raise first_error
    best = min(t.total_s for _, t in rows)
    chosen = next(p for p, t in rows if t.total_s <= best * (1 + TIE))
    keep = chosen.prefill_tokens_per_rank if chosen.prefill_parallel == "dp" else policy.prefill_tokens_per_rank
    return dataclasses.replace(
        job, policy=dataclasses.replace(policy, prefill_parallel=chosen.prefill_parallel, prefill_tokens_per_rank=keep),
        prefill_plan=tuple((p.prefill_parallel, int(p.prefill_tokens_per_rank), t.prefill_s, t.decode_s)
                           for p, t in rows))


def prefill_as_performed(job: Job, dp_prefill: bool) -> Job:
    """The job as a backend runs it: `policy.prefill_parallel=auto` where the backend performs no data-parallel
    prefill (`Capabilities.dp_prefill`) means expert parallel, the one way it has."""
    if dp_prefill or getattr(job.policy, "prefill_parallel", "ep") != AUTO:
        return job
    return dataclasses.replace(job, policy=dataclasses.replace(job.policy, prefill_parallel="ep"))


def prepare(job: Job, kv_pages_per_gpu: int | None = None, pool_fix: str | None = None,
            host_kv_tokens: int | None = None, host_fix: str | None = None, host_prefixes: bool = False,
            prefix_fetch: bool = False, resume_prefix: bool = False) -> Prepared:
    """kv_pages_per_gpu: the KV pool (per scheduler rank: a TP-attention group's) a real backend allocated, instead of
    the one planned from the specs (`pool_fix`: the setting that enlarges it, for the error when a sequence cannot fit
    it). host_kv_tokens: the host KV a real backend's pool of a node surely holds; the state's per node is the smaller
    of it and the cluster spec's (`host_fix`: the setting that enlarges it, for the same error). host_prefixes: the
    backend holds a group's prefix once in a node's host memory (batchgen.core.host_prefixes); prefix_fetch: it
    copies a prefix from a sibling GPU where the policy asks (batchgen.core.prefix_fetch); resume_prefix: a host copy
    resumed onto another GPU of its node takes its group's prefix there.

    A policy whose b_attn / b_moe / kv_residency / attention are "auto" is planned first (batchgen.plan): the
    plan's choice replaces the "auto" knobs (`Prepared.policy`) and decides which expert weights stream
    (`plan_memory`'s streamed_layers); explicit knobs are kept and restrict the plan. `prefill_parallel=auto` is
    chosen before, over the whole batch (`plan_prefill`)."""
    if getattr(job.policy, "prefill_parallel", "ep") == AUTO:
        job = plan_prefill(job)
    gpus, lat, c, policy, plan = planned(job, host_prefixes)
    if plan is not None and job.instance_plan:
        plan = dataclasses.replace(plan, instance_sizes=job.instance_plan)
    if plan is not None and job.prefill_plan:
        plan = dataclasses.replace(plan, prefill_modes=job.prefill_plan)
    m, w = job.model, job.workload
    if policy.comm_overlap and getattr(policy, "kv_residency", "device") != "device":
        raise ConfigError(f"policy.comm_overlap prices device-resident decode only; this job's KV is "
                          f"{policy.kv_residency}-resident: set policy.kv_residency=device, or "
                          "policy.comm_overlap=false")
    budget = _budget(job, lat, gpus, policy, plan.streamed_layers if plan else None, kv_pages_per_gpu, pool_fix,
                     host_kv_tokens, host_fix)
    topo = topology(c)
    state = ClusterState(SequenceTable(w.input_lens, w.output_lens), topo, page_tokens=job.page_tokens,
                         gpu_pages=np.full(c.num_gpus, budget.kv_pages_per_gpu),
                         host_kv_tokens=np.full(c.num_nodes, budget.host_kv_tokens_per_node),
                         kv_bytes_per_token=m.kv_bytes_per_token, kv_split_by_heads=m.attention != "mla")
    if shares_prefixes(policy, w):
        state.share_prefixes(w.prefix_group, w.prefix_len, CascadeRule(
            getattr(policy, "cascade_attention", "off"), m.num_heads, m.num_kv_heads, m.attention == "mla",
            lat.gpu.sm_count, cascade_pays(lat)), host=host_prefixes, tails=getattr(policy, "prefix_tail", False),
            fetch=prefix_fetch and getattr(policy, "prefix_fetch", False), resume_anywhere=resume_prefix,
            tree=w.prefix_tree)
    # The upper-level split of the input over instances: round-robin keeps their loads statistically equal; a
    # policy that gives instances roles routes prompts itself (PD-disaggregation: to its prefill units only).
    route = policy.route
    state.assign_instances(route(len(w), c.num_instances) if callable(route) else np.arange(len(w)) % c.num_instances)
    return Prepared(lat, budget, state, c, policy, plan)
