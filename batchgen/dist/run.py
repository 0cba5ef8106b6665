"""Run a job with `backend=dist`: one process per GPU rank; the cluster's expert-parallel instances run
concurrently, each over its own process group (groups.py; rank 0 posts each instance's commands to its ranks
and collects them later: control.py).

`execute_dist(job, settings)` checks the setup first (a refused configuration starts no process), then either
joins the group torchrun set up (`torchrun --nproc-per-node=N -m batchgen.experiment backend=dist
backend.procs=N ...`: every process runs this; rank 0 returns the output, the others None) or starts the
processes itself (`launch`) and returns rank 0's output. Either way the processes die with their parent (the
launcher, or torchrun's agent). A batch job passes the tokens resumed from its checkpoint and a sink that rank
0 opens in its own process, the one writer of the results file (`batchgen.batch.sink`).

In every process: the model is built from the same weights (seed or directory), each MoE layer becomes an
`ExpertParallelMoE` over its instance's group (this rank keeps its contiguous block of experts), the process
holds its own `PagedKVCache` and host KV pool (each pool may grow to the node's host KV budget,
`backend.host_kv_gb`, or, unset, to the machine's free memory shared by its processes, as rank 0 found it at the
start: the state's per-node host accounting keeps the node's copies within one pool's budget), and gloo groups
per instance carry rank 0's commands and the replies
(control.py). Rank 0 also runs the engine and the policy over a `DistBackend` (backend.py).

A lost worker (recovery.py): with `backend.recover` (default) and rank 0 alive, rank 0 first fences the lost
ranks (a stalled process is killed: fence.py), then the survivors regroup, rebuild their parts over the new
group, keep the KV their caches hold, and the engine goes on over the unfinished sequences (the lost rank's
restored from its shared host copies or recomputed from prompt + generated tokens, whichever the latency model
prices lower: `backend.shared_host_copies`, shared_host.py); the output records each recovery
(`DistOutput.recoveries`) and the launcher accepts the dead rank's exit. Otherwise (recover=false, rank 0
lost, a refused smaller group) the run stops with one line saying who was lost and how many sequences had
finished, their tokens in `DistRunFailed.partial` (one-machine launcher: rank 0 reports each finished sequence
to its parent as it finishes, so they survive even rank 0). Under torchrun the elastic agent itself stops
every worker when one exits, so there recovery is torchrun's restart (--max-restarts) and a batch job's resume.

With several instances the instance that lost a worker is dropped whole: its other processes leave the run,
and the intact instances go on (their groups rebuilt, their KV kept); the dropped instance's sequences are
requeued over them. If rank 0's own instance lost a worker the run stops (rank 0 holds the engine).

Not supported yet (refused with a ConfigError naming it): tensor-parallel attention / two-batch overlap across
processes, an FFN per attention micro-batch (the offloading systems), weights streamed from host, repeats > 1,
dense models (nothing to spread over processes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from batchgen.core.ops import KVLedger
from batchgen.dist.backend import DistBackend
from batchgen.dist.comm import Comm
from batchgen.dist.ep_moe import check_pipeline, expert_parallel
from batchgen.dist.errors import DistConfigError, WorkerLost
from batchgen.dist.failure import Heartbeat
from batchgen.dist.fence import register
from batchgen.dist.groups import control_groups, instance_groups, retire
from batchgen.dist.launch import (ENV_VARS, DistContext, DistEnv, check_procs, die_with_parent, init_distributed,
                                  launch)
from batchgen.dist.outcome import PartialOutput, RunPieces, carry_totals, finished_report, fold_peaks, settle
from batchgen.dist.recovery import (Generation, Recovery, RecoveryRefused, await_decision, decide_survivors,
                                    instance_survivors, publish, requeue, watched)
from batchgen.dist.rejoin import RegroupAborted, attempt, fence_found_lost, fence_ranks, with_partial
from batchgen.dist.rendezvous import await_peers
from batchgen.dist.restore import restore_from_files
from batchgen.dist.settle import keep_plan, settle_caches
from batchgen.dist.settings import (DistSettings, check_dist, dist_host_pools, local_procs, oversubscription,
                                    under_torchrun)
from batchgen.dist.startup import agree_host_kv, first_build, lost_at_start, start_again
from batchgen.dist.shared_host import (SHM_DIR, PublishedIndex, SharedHostFiles, index_path, remove_rank, sweep,
                                      sweep_orphans)
from batchgen.dist.worker import RankWorker
from batchgen.engine import Engine, finished_ids
from batchgen.exec.fits import check_fits
from batchgen.exec.threads import available_cores
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import invariant
from batchgen.exec.run import (ExecOutput, ExecSettings, HostPools, _check_lengths, _checked_params,
                               _checked_prompts, build_model, cascades_as_performed, host_kw, host_pools, kv_pools,
                               model_config, text_decoder)
from batchgen.exec.runner import InstanceRunner
from batchgen.exec.sequences import SequenceTokens
from batchgen.exec.weight_stream import stream_spec_of
from batchgen.job import Job, effective_cluster, plan_prefill, prepare
from batchgen.memory import ConfigError


@dataclass
class DistOutput(ExecOutput):
    procs: int = 1
    rank_wall_s: list = field(default_factory=list)   # per process, its own clock, from model built to stop
    rank_busy_s: list = field(default_factory=list)   # computing (commands' seconds minus communication)
    rank_comm_s: list = field(default_factory=list)   # in all-to-alls and KV transfers (waits for peers included)
    rank_idle_s: list = field(default_factory=list)   # the rest: waiting for rank 0's next command
    rank_moves: list = field(default_factory=list)    # KV ops each rank carried out
    rank_cpu_s: list = field(default_factory=list)    # process CPU seconds (wall minus waiting for a core)
    # recovery.Recovery per lost worker the run went on without (which rank, when, what was requeued, who went
    # on). After one, the rank_* lists above hold the survivors' (launch ranks: recoveries[-1].survivors), each
    # over its whole run, and records' rank_busy / rank_comm are indexed by launch rank (a lost rank's 0)
    recoveries: list = field(default_factory=list)
    sink_counts: object = None  # what rank 0 wrote to the sink it was given (a batch job's records), if any
    restarts: list = field(default_factory=list)  # a process lost at start-up: the run started again without it
                                                  # (one line each: who, why, on how many processes; startup.py)


class DistRunFailed(RuntimeError):
    """A process of the run failed or died: the first line says which and why (a lost worker first), the rest
    holds each failed rank's error. `partial`: what rank 0 kept when it stopped the run itself
    (outcome.PartialOutput: every finished sequence's tokens), None when rank 0 itself died."""

    def __init__(self, bad: list, rank0=None, why: str = ""):
        self.results = bad
        rank0 = rank0 or next((r for r in bad if r.rank == 0), None)
        self.partial = None if rank0 is None else rank0.value or PartialOutput.from_reports(rank0.progress)
        lost = [r for r in bad if r.error and "WorkerLost" in r.error]
        first = (lost or bad)[0]
        lines = [l for l in (first.error or "").splitlines() if l.strip()]
        headline = lines[0] if lines else f"exit code {first.exitcode}"
        killed = [r.rank for r in bad if r.exitcode is not None and r.exitcode < 0]
        kept = self.partial.summary if self.partial is not None and self.partial.summary not in headline else ""
        super().__init__(f"backend=dist stopped: rank {first.rank}: {headline}"
                         + (f" (killed by a signal: rank{'s' if len(killed) > 1 else ''} "
                            f"{', '.join(map(str, killed))})" if killed else "") + (f"; {kept}" if kept else "")
                         + (f"; {why}" if why else "")
                         + "".join(f"\n--- rank {r.rank} (exit {r.exitcode}) ---\n{r.error or ''}" for r in bad))
        self.headline = str(self).splitlines()[0]


def execute_dist(job: Job, settings: DistSettings, *, prompts: list[np.ndarray] | None = None,
                 params=None, resumed: list[list[int]] | None = None, sink=None) -> DistOutput | None:
    """Run the job over settings.procs processes; rank 0's output (None on the other ranks under torchrun).
    `resumed`: tokens each sequence generated in an interrupted run (as `exec.run.execute`'s). `sink`: opened by
    rank 0 in its own process (`sink.open()`: a context manager with `on_finish(ids, tokens)`, called when
    sequences end, `after_run(tokens)`, after every step, and `counts`, returned as `DistOutput.sink_counts`):
    a batch job's results file is written by the process that holds the tokens (`batchgen.batch.sink`)."""
    if job.policy.attention_tp == "auto":  # TP attention is not built across processes: auto is DP attention here
        job = dataclasses.replace(job, policy=dataclasses.replace(job.policy, attention_tp=1))
    if getattr(job.policy, "prefill_parallel", "ep") == "auto":  # chosen once, before the processes build layers
        job = plan_prefill(job)
    job = cascades_as_performed(job, settings)
    if settings.shared_host_copies is True and not os.path.isdir(SHM_DIR):
        warnings.warn(f"backend.shared_host_copies: this machine has no {SHM_DIR}; host KV pools stay in process "
                      "memory, so a lost worker's sequences are recomputed, not restored")
        settings = dataclasses.replace(settings, shared_host_copies=False)
    check_dist(job, settings)
    device = str(settings.instance_devices(1)[0].type)
    if under_torchrun():
        # torchrun starts each worker in a session of its own: without this, an agent killed with SIGKILL would
        # leave its workers running (a batch job's rank 0 appending records while the job is rerun)
        die_with_parent(os.getppid())
        if settings.shared_host_copies:
            sweep_orphans()
        ctx = init_distributed(DistEnv.from_env(), device, settings.timeout_s)
        try:
            if settings.threads is not None and settings.threads != "auto":
                torch.set_num_threads(int(settings.threads))
            return rank_main(ctx, job, settings, prompts, params, resumed=resumed, sink=sink)
        finally:
            ctx.close()
    threads = None if settings.threads in (None, "auto") else int(settings.threads)
    crowded = oversubscription(settings.procs, threads, device, available_cores())
    if crowded:
        print(f"warning: {crowded}", file=sys.stderr, flush=True)
    if settings.shared_host_copies:
        sweep_orphans()  # what runs killed whole left in memory
    restarts = []
    while True:
        run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # names this run's shared host files (sweep_orphans)
        try:
            results = launch(rank_main, settings.procs, (job, settings, prompts, params, True, run_id, resumed, sink),
                             device=device, timeout_s=settings.timeout_s, threads=threads,
                             start_method=settings.start_method, join_timeout_s=max(600.0, 10 * settings.timeout_s),
                             rank0_stopped_s=settings.lost_after_s)
        finally:  # what killed processes left
            if settings.shared_host_copies:
                sweep(run_id)
        lost = lost_at_start(results) if settings.recover else None
        if lost is None:
            break
        job, settings, line = start_again(results, lost, job, settings, reduced_job, DistRunFailed)
        restarts.append(line)
        print(f"warning: {line}", file=sys.stderr, flush=True)
    bad = [r for r in results if not r.ok]
    out = results[0].value if results[0].ok else None
    if bad and out is not None:  # a worker the run recovered from is expected to have died
        lost = {r for rec in out.recoveries for r in rec.lost}
        bad = [r for r in bad if r.rank not in lost]
    if bad:
        raise DistRunFailed(bad, None if results[0].ok else results[0])
    out.restarts = restarts
    return out


def torchrun_run_id(ctx: DistContext) -> str:
    """The name of a torchrun run's shared host files, the same for the workers of one agent (on one node): the
    agent's pid first, as the one-machine launcher's pid names its runs, so that `sweep_orphans` removes them
    once the agent is gone; then the elastic run id, the store's port and the restart count."""
    key = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}-{ctx.env.master_port}-" \
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{os.getppid()}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def rank_main(ctx: DistContext, job: Job, settings: DistSettings, prompts, params,
              to_parent: bool = False, run_id: str | None = None, resumed=None, sink=None) -> DistOutput | None:
    with invariant.mode(settings.batch_invariant):  # every process computes as the settings say
        return _rank_main(ctx, job, settings, prompts, params, to_parent, run_id, resumed, sink)


def _rank_main(ctx: DistContext, job: Job, settings: DistSettings, prompts, params,
               to_parent: bool = False, run_id: str | None = None, resumed=None, sink=None) -> DistOutput | None:
    """One process of the run: build its part, then rank 0 drives the engine and the others serve.
    `to_parent`: the output is pickled back to the launcher (the tokenizer's decode function stays here).
    The heartbeat runs throughout: a peer that dies is found within seconds (WorkerLost), not after timeout_s;
    with settings.recover the survivors then go on in a new group (recovery.py), each with its own heartbeat."""
    heartbeat = Heartbeat.for_context(ctx, interval_s=settings.heartbeat_s, dead_after_s=_dead_after(settings))
    heartbeat.start()
    current = [Generation(0, ctx, heartbeat, tuple(range(ctx.world_size)))]  # the latest, for the finally
    files = None
    if settings.shared_host_copies:
        files = SharedHostFiles(run_id or torchrun_run_id(ctx), ctx.rank)
    try:
        if ctx.store is not None:
            register(ctx.store, ctx.rank)  # for rank 0 to fence this process if it is ever found lost
        params = _checked_params(job, settings, params, _done_before(job, resumed))
        settings, built = first_build(current[0], lambda: _first_part(current[0], job, settings, params, files))
        if ctx.rank != 0:
            return _serve(current, built[0], job, settings, params, files)
        if sink is None:  # opened only now: a start that fails writes nothing (execute_dist may start again)
            return _drive(current, built, job, settings, prompts, params, to_parent, files, resumed)
        with sink.open() as opened:
            out = _drive(current, built, job, settings, prompts, params, to_parent, files, resumed, opened)
        out.sink_counts = opened.counts
        return out
    finally:
        current[-1].heartbeat.stop()
        if files is not None:
            files.close()


def _first_part(gen: Generation, job: Job, settings: DistSettings, params, files):
    """Generation 0: the settings every process agrees on, and this process's part (`_build_rank`)."""
    if gen.ctx.store is not None:
        settings = agree_host_kv(gen.ctx, job, settings, gen.heartbeat)
    return settings, _build_rank(gen, job, settings, params, files=files)


def _dead_after(settings: DistSettings) -> float:
    return settings.lost_after_s


def reduced_job(job: Job, procs: int) -> Job:
    """The job over `procs` survivors: the same workload and policy on a cluster of that many GPUs (whole nodes
    kept where the survivors fill them, else one node; several instances keep their size: the survivors are
    whole instances, `instance_survivors`)."""
    c = job.cluster
    node = c.gpus_per_node if procs <= c.gpus_per_node or procs % c.gpus_per_node == 0 else procs
    return dataclasses.replace(job, cluster=dataclasses.replace(c, num_gpus=procs, gpus_per_node=node))


def _build_rank(gen: Generation, job: Job, settings: DistSettings, params,
                before: RankWorker | None = None, files: SharedHostFiles | None = None
                ) -> tuple[RankWorker, bool, bool]:
    """This process's part over generation `gen`'s group: the model from the same weights, its expert shard of
    the contiguous placement over the group, its KV cache, the control group; and whether the cache is the one
    of `before` (this process's worker of the previous generation, whose totals carry over): kept, KV and all,
    when the smaller group's memory plan gives the same pool (the same on every survivor: the same job)."""
    config = model_config(job, settings)
    dtype = settings.torch_dtype([gen.ctx.device])
    host = dist_host_pools(job, settings)
    pools = kv_pools(job, settings, config, dtype, host)
    pool = (pools.pool_bytes, pools.staging_pages, pools.max_context, host.budget_pages)
    model = build_model(job, settings, gen.ctx.device, dtype).eval()
    if gen.ctx.store is not None:  # group creation below waits on the store for every member: meet first
        await_peers(gen.ctx.store, f"batchgen/ready/gen{gen.number}", gen.rank, range(gen.size), gen.heartbeat,
                    settings.timeout_s, f"the start of generation {gen.number}")
    cluster = effective_cluster(job)  # instances: consecutive blocks of ranks, one process group each
    sizes = [cluster.instance_size] * cluster.num_instances
    made: list = []  # created on a thread under the heartbeat: each creation waits on the store for every member
    watched(lambda: made.extend([instance_groups(sizes, settings.timeout_s),
                                 control_groups(sizes, settings.timeout_s)]),
            gen, list(range(gen.size)), f"while the processes created their groups (generation {gen.number})")
    instance, controls = made
    comm = Comm(instance.group, gen.heartbeat)  # this instance's all-to-alls and migrations
    world = Comm(heartbeat=gen.heartbeat) if cluster.num_instances > 1 else comm  # migrations between instances
    # rank 0's commands to each instance and their replies (gloo, even when the data moves over NCCL)
    channels = [None if g is None else (Comm(g[0], gen.heartbeat), Comm(g[1], gen.heartbeat))
                for g in controls]
    control, replies = channels[instance.index]
    is_moe = any(model.moe(layer) is not None for layer in range(model.num_layers))
    runner = InstanceRunner(model)
    if comm.size > 1:  # one process keeps the plain layer (the same math, no collectives to wait in)
        runner.prefill_ring = expert_parallel(model, comm, settings.ep_pipeline, gen.ctx.device,
                                              getattr(job.policy, "prefill_parallel", "ep") == "dp")
        runner.collective = True
    kept = before is not None and getattr(before.cache, "pool", None) == pool
    if kept:
        cache = before.cache
    else:
        cache = PagedKVCache.from_budget(**pools.geometry, page_size=job.page_tokens,
                                         budget_bytes=pools.pool_bytes, dtype=dtype, device=gen.ctx.device,
                                         max_context=pools.max_context, staging_pages=pools.staging_pages,
                                         host_alloc=None if files is None else files.alloc,
                                         host_budget_pages=host.budget_pages)
        cache.pool = pool  # what it was sized from (a recovery keeps it when the survivors' plan gives the same)
    worker = RankWorker(gen.rank, cache, runner, comm, control, params, settings.weights_seed, gen.ctx.device,
                        world=world, replies=replies, channels=channels if gen.rank == 0 else None)
    worker.host_files = files
    if before is not None:
        carry_totals(before, worker)
        retire(before)  # its groups may hold a thread inside an abandoned collective: never freed (recovery.py)
    return worker, is_moe, kept


def _rebuild(gen: Generation, job: Job, settings: DistSettings, params, before: RankWorker,
             files: SharedHostFiles | None, decide=None) -> tuple[RankWorker, list[dict] | None]:
    """A survivor's part over a new generation, its kept cache settled (settle.py: rank 0 decides with
    `decide`), all before rank 0 commits the generation (rejoin.attempt): a loss while the survivors settle is a
    loss during the regroup, and sends them back to regroup again without it. After the commit nothing waits on
    a peer until the engine's first command, which finds a later loss as any step does. Returns the worker and
    the keep plan (None: a fresh cache, nothing kept)."""
    worker, _, kept = _build_rank(gen, job, settings, params, before, files)
    return worker, settle_caches(worker, decide) if kept else None


def _attempt(current: list, survivors: list[int], number: int, settings: DistSettings, build):
    """Regroup into generation `number` and build there (rejoin.attempt); the new generation becomes current once
    committed. Raises RegroupAborted."""
    gen, built = attempt(current[-1], survivors, number, build, interval_s=settings.heartbeat_s,
                         dead_after_s=_dead_after(settings))
    current.append(gen)
    return gen, built


def _serve(current: list, worker: RankWorker, job: Job, settings: DistSettings, params, files=None) -> None:
    """A worker (rank > 0): serve rank 0's commands; after a lost peer (recover=true), wait for rank 0's list of
    survivors, join their new group, rebuild and serve again (again without a survivor lost meanwhile)."""
    gen = current[-1]
    while True:
        try:
            worker.serve()
            return None
        except WorkerLost as err:
            if not settings.recover:
                raise
            number = gen.number + 1
            while True:  # attempts at the next generation, each without the ranks lost in the one before
                survivors = await_decision(gen, err, settings.timeout_s, number)
                if survivors is None:  # its instance lost a member and was dropped: this process leaves the run,
                    if files is not None:  # its host copies left for rank 0 to restore from (it may be reading)
                        files.hand_over()
                    return None
                try:
                    gen, (worker, _) = _attempt(current, survivors, number, settings, lambda g, old=worker:
                                                _rebuild(g, reduced_job(job, g.size), settings, params, old, files))
                    break
                except RegroupAborted as again:
                    err, number = again.cause, number + 1
        if files is not None:  # the index names what the settled (or fresh) cache holds
            files.publish(worker.cache)


def _done_before(job: Job, resumed) -> list[int]:
    return [len(r) for r in resumed] if resumed is not None else [0] * len(job.workload)


def _drive(current: list, built, job: Job, settings: DistSettings, prompts, params, to_parent: bool,
           files: SharedHostFiles | None = None, resumed=None, sink=None) -> DistOutput:
    """Rank 0: the engine and the policy over a DistBackend; after a lost worker (recover=true), decide the
    survivors, regroup, and run the engine again over the unfinished sequences (recovery.requeue). `sink`: an
    opened sink (see `execute_dist`), told of every finished sequence and every step."""
    start, cpu_start = time.perf_counter(), time.process_time()
    gen = current[-1]
    world = gen.size
    config = model_config(job, settings)
    done_before = _done_before(job, resumed)
    worker, is_moe, _ = built
    prompts = _checked_prompts(job, settings, config, prompts, done_before)
    prepared = prepare(job, kv_pages_per_gpu=worker.cache.num_pages, prefix_fetch=True, resume_prefix=True,
                       **host_kw(dist_host_pools(job, settings)))
    tokens = SequenceTokens(prompts, params, config.eos_token_ids, text_decoder(settings.model_path, params),
                            resumed=resumed)
    pieces, recoveries, clock, launched = RunPieces(several=prepared.cluster.num_instances > 1), [], None, prepared
    report = gen.ctx.report
    if gen.ctx.started is not None:  # from now on a stopped rank 0 is no longer a loss at start-up (launch.py)
        gen.ctx.started()

    def on_step(plan, result) -> None:  # finished outputs reach the launcher at once: they outlive rank 0
        ended = finished_ids(plan, result)
        if report is not None and ended.size:
            report(finished_report(tokens, ended))
        if sink is not None:
            if ended.size:
                sink.on_finish(ended, tokens)
            sink.after_run(tokens)
    while True:
        backend = DistBackend(prepared.state, worker, tokens, gen.size, is_moe, job_seed=settings.weights_seed,
                              comm_overlap=prepared.policy.comm_overlap,
                              dp_prefill=getattr(prepared.policy, "prefill_parallel", "ep") == "dp")
        if clock is None:
            clock = backend._t0
        else:  # one clock over the generations: records and finish times line up
            backend._t0 = clock
            recoveries[-1].regroup_s = backend.now() - recoveries[-1].at_s
        engine = None
        try:
            engine = Engine(prepared.policy, backend, gpus_per_node=prepared.cluster.node_size,
                            check_invariants=job.check_invariants, on_step=on_step)
            engine.run_in_turn()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            engine.finish()
            totals = backend.shutdown()
            pieces.add(engine, backend, gen.members, world)
            break
        except WorkerLost as err:
            caught, caught_unix = backend.now(), time.time()
            if engine is not None:
                pieces.add(engine, backend, gen.members, world)
            done = np.array([st.finished for st in tokens.stops], bool)
            partial = PartialOutput.of(tokens, done, pieces.records)
            if not settings.recover:  # a stalled worker would keep the launcher waiting: make it dead first
                fence_found_lost(gen, err)
                stopped = WorkerLost(err.rank, err.cause)
                stopped.args = (f"{stopped}; {partial.summary}",)
                raise with_partial(stopped, partial) from err
            before, number, dead, fenced, cause = gen, gen.number + 1, [], [], str(err)
            while True:  # attempts at the next generation, each without the ranks lost in the one before
                survivors, released, refusal = None, [], ""
                try:
                    alive = decide_survivors(before, err)
                    cluster = effective_cluster(job)
                    survivors = instance_survivors(alive, cluster.instance_size, cluster.num_instances,
                                                   before.members)
                    released = [r for r in alive if r not in survivors]
                    job_next = reduced_job(job, len(survivors))
                    check_dist(job_next, dataclasses.replace(settings, procs=len(survivors)), launched=False)
                except (RecoveryRefused, ConfigError) as e:
                    refusal = str(e).splitlines()[0]
                publish(before, None if refusal else survivors, refusal, [] if refusal else released, number)
                if refusal:
                    fence_found_lost(before, err)
                    raise with_partial(RecoveryRefused(f"cannot go on after {cause}: {refusal}; {partial.summary}"),
                                       partial) from err
                lost_ranks = [r for r in range(before.size) if r not in survivors]
                d, f = fence_ranks([before.members[r] for r in lost_ranks if r not in released
                                    and before.members[r] not in dead], before.ctx.store)
                dead, fenced = dead + d, fenced + f
                table, split = prepared.state.table, KVLedger.of(prepared.state).split
                try:
                    gen, (worker, keep) = _attempt(
                        current, survivors, number, settings, lambda g, old=worker, j=job_next: _rebuild(
                            g, j, settings, params, old, files,
                            lambda inv: keep_plan(table, tokens.generated, done, inv, split)))
                    break
                except RegroupAborted as again:  # another survivor lost meanwhile: regroup without it
                    err, number, cause = again.cause, number + 1, f"{cause}; then {again.cause}"
            keep = keep if keep is not None else [{} for _ in survivors]
            next_prepared = prepare(job_next, kv_pages_per_gpu=worker.cache.num_pages, prefix_fetch=True,
                                    resume_prefix=True, **host_kw(dist_host_pools(job_next, settings)))
            restored = restorable = 0
            if files is not None:
                # from processes known dead (fenced) or released (alive, done writing: they hand their files over)
                readable = dead + [before.members[r] for r in released]
                restored, restorable = restore_from_files(files, [before.members[r] for r in lost_ranks],
                                                          readable, worker.cache, keep, next_prepared, table,
                                                          tokens.generated, done, split)
                files.publish(worker.cache)
            finished, held, requeued, on_lost = requeue(prepared.state, tokens.generated, done,
                                                        next_prepared.state, caught, lost_ranks, keep)
            # (one instance: a GPU index is a rank of its generation)
            if prepared is not launched:
                fold_peaks(launched.state, prepared.state, before.members)
            recoveries.append(Recovery(gen.number, [before.members[r] for r in lost_ranks if r not in released],
                                       list(gen.members), caught, cause, finished, held - restored, requeued,
                                       on_lost, restored=restored, restorable=restorable,
                                       released=[before.members[r] for r in released], fenced=fenced,
                                       at_unix=caught_unix))
            prepared = next_prepared
        except BaseException:
            backend.abort()  # the workers leave their loops instead of waiting for a command that never comes
            raise
    if to_parent:
        tokens.decode = None
    if prepared is not launched:  # the output describes the cluster as launched, every sequence's result
        settle(launched.state, prepared.state, gen.members)
    return DistOutput(job, launched, pieces.records, wall, pieces.events, backend="dist", tokens=tokens,
                      kv_moves=dict(pieces.moves), kv_traffic=dict(pieces.traffic),
                      kv_account=backend.account,  # every rank's, over its whole run (carry_totals)
                      capabilities=backend.capabilities, device=str(gen.ctx.device),
                      dtype=str(settings.torch_dtype([gen.ctx.device])).removeprefix("torch."),
                      threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
                      cpu_share=cpu / (wall * torch.get_num_threads()), procs=settings.procs,
                      rank_wall_s=[t.wall_s for t in totals], rank_busy_s=[t.busy_s for t in totals],
                      rank_comm_s=[t.comm_s for t in totals], rank_idle_s=[t.idle_s for t in totals],
                      rank_moves=[t.moves for t in totals], rank_cpu_s=[t.cpu_s for t in totals],
                      recoveries=recoveries)
