"""Run a job with `backend=dist`: one process per GPU rank; the cluster's expert-parallel instances run
concurrently, each over its own process group (groups.py; rank 0 posts each instance's commands to its ranks
and collects them later: control.py).

`execute_dist(job, settings)` checks the setup first (a refused configuration starts no process), then either
joins the group torchrun set up (`torchrun --nproc-per-node=N -m batchgen.experiment backend=dist
backend.procs=N ...`: every process runs this; rank 0 returns the output, the others None) or starts the
processes itself (`launch`) and returns rank 0's output.

In every process: the model is built from the same weights (seed or directory), each MoE layer becomes an
`ExpertParallelMoE` over its instance's group (this rank keeps its contiguous block of experts), the process holds
its own `PagedKVCache`, and a second gloo group carries rank 0's commands (worker.py). Rank 0 also runs the
engine and the policy over a `DistBackend` (backend.py).

Not supported yet (refused with a ConfigError naming it): PARTITION / tensor-parallel attention / two-batch overlap across processes, weights
streamed from host, repeats > 1, dense models (nothing to spread over processes).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from batchgen.dist.backend import DistBackend
from batchgen.dist.comm import Comm
from batchgen.dist.ep_moe import ExpertParallelMoE
from batchgen.dist.errors import DistConfigError, WorkerLost
from batchgen.dist.failure import Heartbeat
from batchgen.dist.control import CommandChannel
from batchgen.dist.groups import control_groups, instance_groups
from batchgen.dist.launch import ENV_VARS, DistContext, DistEnv, check_procs, init_distributed, launch
from batchgen.dist.worker import RankWorker
from batchgen.engine import Engine
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.run import (ExecOutput, ExecSettings, _check_lengths, _checked_params, _checked_prompts,
                               build_model, kv_pools, model_config, text_decoder)
from batchgen.exec.runner import InstanceRunner
from batchgen.exec.sequences import SequenceTokens
from batchgen.exec.weight_stream import stream_spec_of
from batchgen.job import Job, effective_cluster, prepare


@dataclass(frozen=True)
class DistSettings(ExecSettings):
    procs: int = 1                 # processes = GPUs of the cluster, all instances (cluster.num_gpus must equal it)
    timeout_s: float = 120.0       # bound on every collective (a peer that stops answering never hangs a run)
    heartbeat_s: float = 0.5       # heartbeat interval; a peer silent for 6 intervals is lost (WorkerLost)
    start_method: str = "fork"     # the one-machine launcher: fork (fast; the parent holds no group) or spawn
    threads: int | str | None = 1  # torch intra-op threads per process


@dataclass
class DistOutput(ExecOutput):
    procs: int = 1
    rank_wall_s: list = field(default_factory=list)   # per process, its own clock, from model built to stop
    rank_busy_s: list = field(default_factory=list)   # computing (commands' seconds minus communication)
    rank_comm_s: list = field(default_factory=list)   # in all-to-alls and KV transfers (waits for peers included)
    rank_idle_s: list = field(default_factory=list)   # the rest: waiting for rank 0's next command
    rank_moves: list = field(default_factory=list)    # KV ops each rank carried out
    rank_cpu_s: list = field(default_factory=list)    # process CPU seconds (wall minus waiting for a core)


class DistRunFailed(RuntimeError):
    """A process of the run failed or died: the first line says which and why (a lost worker first), the rest
    holds each failed rank's error."""

    def __init__(self, bad: list):
        self.results = bad
        lost = [r for r in bad if r.error and "WorkerLost" in r.error]
        first = (lost or bad)[0]
        lines = [l for l in (first.error or "").splitlines() if l.strip()]
        headline = lines[0] if lines else f"exit code {first.exitcode}"
        killed = [r.rank for r in bad if r.exitcode is not None and r.exitcode < 0]
        super().__init__(f"backend=dist stopped: rank {first.rank}: {headline}"
                         + (f" (killed by a signal: rank{'s' if len(killed) > 1 else ''} "
                            f"{', '.join(map(str, killed))})" if killed else "")
                         + "".join(f"\n--- rank {r.rank} (exit {r.exitcode}) ---\n{r.error or ''}" for r in bad))
        self.headline = str(self).splitlines()[0]


def under_torchrun() -> bool:
    return all(v in os.environ for v in ENV_VARS)


def check_dist(job: Job, settings: DistSettings) -> None:
    """Everything backend=dist refuses, before a process starts."""
    config = model_config(job, settings)
    check_procs(settings.procs, world_size=int(os.environ["WORLD_SIZE"]) if under_torchrun() else None)
    if not config.num_experts:
        raise DistConfigError("backend=dist spreads the experts of an MoE model over processes; this model is "
                              "dense (no experts): use backend=exec")
    cluster = effective_cluster(job)
    if cluster.num_gpus != settings.procs:
        raise DistConfigError(f"backend.procs={settings.procs} but the cluster has {cluster.num_gpus} GPUs: one "
                              f"process per GPU (set cluster.num_gpus={settings.procs})")
    # each instance spreads the experts over its own processes (cluster.gpus_per_instance of them)
    check_procs(cluster.instance_size, num_experts=config.num_experts)
    policy = prepare(job).policy  # (an FFN per micro-batch, the offload systems' schedule, is chosen per
    # decision: DistBackend.execute refuses it at the first step, and the run stops with that one line)
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


def execute_dist(job: Job, settings: DistSettings, *, prompts: list[np.ndarray] | None = None,
                 params=None) -> DistOutput | None:
    """Run the job over settings.procs processes; rank 0's output (None on the other ranks under torchrun)."""
    if job.policy.attention_tp == "auto":  # TP attention is not built across processes: auto is DP attention here
        job = dataclasses.replace(job, policy=dataclasses.replace(job.policy, attention_tp=1))
    check_dist(job, settings)
    device = str(settings.instance_devices(1)[0].type)
    if under_torchrun():
        ctx = init_distributed(DistEnv.from_env(), device, settings.timeout_s)
        try:
            if settings.threads is not None and settings.threads != "auto":
                torch.set_num_threads(int(settings.threads))
            return rank_main(ctx, job, settings, prompts, params)
        finally:
            ctx.close()
    threads = None if settings.threads in (None, "auto") else int(settings.threads)
    results = launch(rank_main, settings.procs, (job, settings, prompts, params, True), device=device,
                     timeout_s=settings.timeout_s, threads=threads, start_method=settings.start_method,
                     join_timeout_s=max(600.0, 10 * settings.timeout_s))
    bad = [r for r in results if not r.ok]
    if bad:
        raise DistRunFailed(bad)
    return results[0].value


def rank_main(ctx: DistContext, job: Job, settings: DistSettings, prompts, params,
              to_parent: bool = False) -> DistOutput | None:
    """One process of the run: build its part, then rank 0 drives the engine and the others serve.
    `to_parent`: the output is pickled back to the launcher (the tokenizer's decode function stays here).
    The heartbeat runs throughout: a peer that dies is found within seconds (WorkerLost), not after timeout_s."""
    heartbeat = Heartbeat.for_context(ctx, interval_s=settings.heartbeat_s, dead_after_s=6 * settings.heartbeat_s)
    heartbeat.start()
    try:
        return _rank_run(ctx, job, settings, prompts, params, to_parent, heartbeat)
    finally:
        heartbeat.stop()


def _rank_run(ctx: DistContext, job: Job, settings: DistSettings, prompts, params, to_parent: bool,
              heartbeat: Heartbeat) -> DistOutput | None:
    start, cpu_start = time.perf_counter(), time.process_time()
    config = model_config(job, settings)
    dtype = settings.torch_dtype([ctx.device])
    pools = kv_pools(job, settings, config, dtype)
    done_before = [0] * len(job.workload)
    params = _checked_params(job, settings, params, done_before)
    model = build_model(job, settings, ctx.device, dtype).eval()
    cluster = effective_cluster(job)  # instances: consecutive blocks of ranks, one process group each
    sizes = [cluster.instance_size] * cluster.num_instances
    instance = instance_groups(sizes, settings.timeout_s)
    comm = Comm(instance.group, heartbeat)  # this instance's all-to-alls and migrations
    world = Comm(heartbeat=heartbeat) if cluster.num_instances > 1 else comm  # migrations between instances
    # rank 0's commands to each instance and their replies (gloo, even when the data moves over NCCL)
    channels = [None if g is None else (Comm(g[0], heartbeat), Comm(g[1], heartbeat))
                for g in control_groups(sizes, settings.timeout_s)]
    control, replies = channels[instance.index]
    is_moe = any(model.moe(layer) is not None for layer in range(model.num_layers))
    runner = InstanceRunner(model)
    if comm.size > 1:  # one process keeps the plain layer (the same math, no collectives to wait in)
        for layer in range(model.num_layers):
            moe = model.moe(layer)
            if moe is not None:
                model.layers[layer].mlp = ExpertParallelMoE(moe, comm)
        runner.collective = True
    cache = PagedKVCache.from_budget(**pools.geometry, page_size=job.page_tokens, budget_bytes=pools.pool_bytes,
                                     dtype=dtype, device=ctx.device, max_context=pools.max_context,
                                     staging_pages=pools.staging_pages)
    worker = RankWorker(ctx.rank, cache, runner, comm, control, params, settings.weights_seed, ctx.device,
                        world=world, replies=replies)
    if ctx.rank != 0:
        worker.serve()
        return None
    prompts = _checked_prompts(job, settings, config, prompts, done_before)
    prepared = prepare(job, kv_pages_per_gpu=cache.num_pages)
    tokens = SequenceTokens(prompts, params, config.eos_token_ids, text_decoder(settings.model_path, params))
    channel = CommandChannel(worker, [c for c, _ in channels], [r for _, r in channels],
                             [tuple(prepared.state.instance_gpus(i).tolist()) for i in range(len(sizes))])
    backend = DistBackend(prepared.state, worker, tokens, settings.procs, is_moe, job_seed=settings.weights_seed,
                          channel=channel)
    try:
        engine = Engine(prepared.policy, backend, gpus_per_node=prepared.cluster.node_size,
                        check_invariants=job.check_invariants)
        engine.run_in_turn()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        engine.finish()
    except WorkerLost:
        raise  # the survivors find rank 0 gone from its heartbeat
    except BaseException:
        backend.abort()  # the workers leave their loops instead of waiting for a command that never comes
        raise
    totals = backend.shutdown()
    moves = dict(backend.moves)
    if to_parent:
        tokens.decode = None
    return DistOutput(job, prepared, engine.records, wall, backend.events, backend="dist", tokens=tokens,
                      kv_moves=moves, kv_traffic=dict(backend.traffic), capabilities=backend.capabilities,
                      device=str(ctx.device), dtype=str(dtype).removeprefix("torch."),
                      threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
                      cpu_share=cpu / (wall * torch.get_num_threads()), procs=settings.procs,
                      rank_wall_s=[t.wall_s for t in totals], rank_busy_s=[t.busy_s for t in totals],
                      rank_comm_s=[t.comm_s for t in totals], rank_idle_s=[t.idle_s for t in totals],
                      rank_moves=[t.moves for t in totals], rank_cpu_s=[t.cpu_s for t in totals])


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)
