"""`cluster.gpus_per_instance=auto`: the instance size as one more planned knob. Every size the cluster can be
cut into is planned as `prepare` would plan it (TP-attention degree, B_attn, B_moe, residency, streamed weights,
prefill chunk and, where it is auto, the prefill's parallelism), and its whole batch predicted from that plan
(`batchgen.job.predict`: the prompts' forwards, then the outputs at the plan's decode throughput); the size with
the shortest prediction runs, the smaller one within the planner's tie (fewer GPUs wait for each other at every
layer). The paper ran 128 GPUs as two 64-GPU instances because the all-to-all grows with the instance; here that
trade is priced, not assumed."""

from __future__ import annotations

import dataclasses

from batchgen.job import Job, predict
from batchgen.memory import ConfigError
from batchgen.plan.planner import TIE, needs_plan
from batchgen.specs import ClusterSpec


def instance_sizes(cluster: ClusterSpec) -> list[int]:
    """Every instance size the cluster takes: a divisor of its GPUs that is whole nodes or divides a node."""
    node = cluster.node_size
    return [s for s in range(1, cluster.num_gpus + 1)
            if cluster.num_gpus % s == 0 and (s % node == 0 or node % s == 0)]


def plan_instances(job: Job) -> Job:
    """The job on the instance size whose predicted batch is shortest, with every size's prediction in
    `Job.instance_plan`. Raises ConfigError for a policy the planner does not plan, or when no size fits."""
    if not job.model.is_moe:  # every GPU runs its own replica whatever the setting
        return job
    if not (len(job.workload) and needs_plan(job.policy)) or callable(job.policy.instance_gpus):
        raise ConfigError(f"cluster.gpus_per_instance=auto is planned with the policy's own knobs, and policy "
                          f"{job.policy.name} has none left to plan: set cluster.gpus_per_instance to a number of "
                          f"GPUs (one of {', '.join(map(str, instance_sizes(job.cluster)))}) or null (one instance)")
    rows, last = [], None
    for size in instance_sizes(job.cluster):
        trial = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_instance=size))
        try:
            t = predict(trial)
        except ConfigError as e:
            last = e
            continue
        rows.append((size, t.prefill_s, t.decode_s))
    if not rows:
        raise ConfigError(f"cluster.gpus_per_instance=auto: no instance size of {job.cluster.num_gpus} GPUs fits "
                          f"{job.model.name}; the whole cluster as one instance: {last}")
    best = min(p + d for _, p, d in rows)
    size = next(s for s, p, d in rows if p + d <= best * (1 + TIE))
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_instance=size),
                               instance_plan=tuple(rows))
