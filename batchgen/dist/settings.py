"""backend=dist's settings, and everything it refuses before a process starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from batchgen.dist.ep_moe import check_pipeline
from batchgen.dist.errors import DistConfigError
from batchgen.dist.launch import ENV_VARS, check_procs
from batchgen.exec.fits import check_fits
from batchgen.exec.run import ExecSettings, HostPools, _check_lengths, host_pools, kv_pools, model_config
from batchgen.exec.weight_stream import stream_spec_of
from batchgen.job import Job, effective_cluster, prepare


@dataclass(frozen=True)
class DistSettings(ExecSettings):
    procs: int = 1                 # processes = GPUs of the cluster, all instances (cluster.num_gpus must equal it)
    timeout_s: float = 120.0       # bound on every collective (a peer that stops answering never hangs a run)
    heartbeat_s: float = 0.5       # heartbeat interval
    # a peer is declared lost (WorkerLost) only when its process is gone or its heartbeat has been silent this
    # long: a slow peer (a loaded machine) is slow, not lost; a stalled one is found after this many seconds
    lost_after_s: float = 10.0
    start_method: str = "fork"     # the one-machine launcher: fork (fast; the parent holds no group) or spawn
    threads: int | str | None = 1  # torch intra-op threads per process
    recover: bool = True           # a lost worker (not rank 0): go on over the survivors (recovery.py); false: stop
    # each rank's host KV pool in a /dev/shm file with a published index (shared_host.py): a lost rank's host
    # copies can be restored instead of recomputed (whichever the latency model prices lower)
    shared_host_copies: bool = True
    # the MoE all-to-alls pipelined over this many groups of each rank's experts, overlapping the experts'
    # compute (ep_moe.py; 1 = synchronous; None = batchgen.dist.ep_moe.DEFAULT_PIPELINE)
    ep_pipeline: int | None = None


def under_torchrun() -> bool:
    return all(v in os.environ for v in ENV_VARS)


def oversubscription(procs: int, threads: int | str | None, device: str, cores: int) -> str | None:
    """A warning when the processes (times their threads, on a CPU) need more cores than this machine gives
    them: they then take turns on the cores, and the run is slower than fewer processes would make it
    (benchmarks/results/code_figures.md) with no error to say why. None when they fit."""
    per = threads if isinstance(threads, int) and not isinstance(threads, bool) else 1
    need = procs * per if device == "cpu" else procs
    if need <= cores:
        return None
    what = f"{procs} processes x {per} thread{'s' if per > 1 else ''}" if device == "cpu" else f"{procs} processes"
    return (f"backend.procs={procs}: {what} need {need} cores but this machine gives {cores}; they will take turns "
            f"and the run will be slower than with fewer: use backend.procs<={max(cores // per, 1)}")


def check_dist(job: Job, settings: DistSettings, *, launched: bool = True) -> None:
    """Everything backend=dist refuses, before a process starts (`launched` False: a recovery's smaller group,
    whose size is not torchrun's WORLD_SIZE)."""
    config = model_config(job, settings)
    check_procs(settings.procs, world_size=int(os.environ["WORLD_SIZE"]) if launched and under_torchrun() else None)
    if not config.num_experts:
        raise DistConfigError("backend=dist spreads the experts of an MoE model over processes; this model is "
                              "dense (no experts): use backend=exec")
    cluster = effective_cluster(job)
    if cluster.num_gpus != settings.procs:
        raise DistConfigError(f"backend.procs={settings.procs} but the cluster has {cluster.num_gpus} GPUs: one "
                              f"process per GPU (set cluster.num_gpus={settings.procs})")
    # each instance spreads the experts over its own processes (cluster.gpus_per_instance of them)
    check_procs(cluster.instance_size, num_experts=config.num_experts)
    policy = prepare(job).policy
    if policy.ffn_schedule != "combined":  # DistBackend.execute would refuse its first step
        raise DistConfigError(f"policy {policy.name} runs an FFN per attention micro-batch (ffn_schedule="
                              f"{policy.ffn_schedule}), which would give the processes different numbers of "
                              "all-to-alls: backend=dist runs one expert batch per layer; use backend=exec for "
                              "this policy")
    if policy.two_batch_overlap:
        raise DistConfigError(f"policy {policy.name} runs two-batch overlap, not supported under backend=dist yet:"
                              " set policy.two_batch_overlap=false")
    if policy.attention_tp not in (1, "auto"):
        raise DistConfigError(f"tensor-parallel attention (policy.attention_tp={policy.attention_tp}) is not "
                              "supported under backend=dist yet: set policy.attention_tp=1")
    if settings.repeats != 1:
        raise DistConfigError(f"backend.repeats={settings.repeats}: backend=dist runs the job once (repeats=1)")
    if settings.start_method not in ("fork", "spawn"):
        raise DistConfigError(f"backend.start_method={settings.start_method!r}: choose fork or spawn")
    if not settings.heartbeat_s > 0:
        raise DistConfigError(f"backend.heartbeat_s={settings.heartbeat_s}: give a positive number of seconds")
    if not settings.lost_after_s > settings.heartbeat_s:
        raise DistConfigError(f"backend.lost_after_s={settings.lost_after_s}: give more seconds than "
                              f"backend.heartbeat_s={settings.heartbeat_s} (a peer silent that long is lost)")
    if not isinstance(settings.shared_host_copies, bool):
        raise DistConfigError(f"backend.shared_host_copies={settings.shared_host_copies!r}: give true or false")
    if settings.ep_pipeline is not None:
        check_pipeline(settings.ep_pipeline, "backend.ep_pipeline")
    if settings.timeout_s <= 0:
        raise DistConfigError(f"backend.timeout_s={settings.timeout_s}: give a positive number of seconds")
    if isinstance(settings.device, (list, tuple)):
        raise DistConfigError("backend.device: one device type for every process (cpu, or cuda: one GPU each)")
    devices = settings.instance_devices(1)
    dtype = settings.torch_dtype(devices)
    _check_lengths(job, config)
    pools = kv_pools(job, settings, config, dtype)
    if stream_spec_of(pools.budget, job.model):
        raise DistConfigError("the memory plan streams weights from host, not supported under backend=dist yet: "
                              "raise the device memory or use backend=exec")
    host = dist_host_pools(job, settings)
    if launched:  # on a CPU, every process on this machine builds the whole model first
        local = local_procs(settings)
        cpu = devices[0].type == "cpu"  # (GPUs: only the host KV pools are counted here)
        check_fits(job, settings.model_path, settings.kv_budget_mb, devices if cpu else [], dtype, local,
                   weight_copies=local, host_kv_bytes=host.explicit_bytes * local,
                   extra_per_copy=dp_prefill_bytes(config, dtype, cluster.instance_size)
                   if policy.prefill_parallel == "dp" else 0.0,
                   host_kv=f"backend.host_kv_gb={settings.host_kv_gb} GB per node, a host KV pool in each of "
                           f"{local} processes (each may grow to it)" if host.explicit_bytes else "")
    kv_pools(job, settings, config, dtype, host)  # every sequence against the host KV a pool holds too


def dp_prefill_bytes(config, dtype: torch.dtype, instance_size: int) -> float:
    """Bytes a process keeps beyond the whole model it built under data-parallel prefill (dist/dp_prefill.py): the
    host copy is the built layers' experts themselves, and beside them its expert shard (every MoE layer's) and
    two ring slots of one layer's experts."""
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * torch.tensor([], dtype=dtype).element_size()
    moe_layers = config.num_layers - config.num_dense_layers
    held = -(-config.num_experts // instance_size)
    return float(per_expert * (held * moe_layers + 2 * config.num_experts))


def local_procs(settings: DistSettings) -> int:
    """Processes of the run on this machine."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", settings.procs)) if under_torchrun() else settings.procs


def dist_host_pools(job: Job, settings: DistSettings) -> HostPools:
    """Each process's host KV pool: its budget and the host KV per node the state is given (`exec.run.host_pools`,
    one pool here of the machine's processes')."""
    config = model_config(job, settings)
    devices = settings.instance_devices(1)
    local = local_procs(settings)
    cpu = devices[0].type == "cpu"
    return host_pools(job, settings, config, settings.torch_dtype(devices), devices, 1, local,
                      local if cpu else 1, weight_copies=local if cpu else 1)
