"""A process lost at start-up, before the first step: nothing has run, so the run starts again without it.

Before the engine's first step no sequence has a token and no cache holds KV, so there is nothing to carry over:
starting every process afresh on the survivors' count is the whole recovery, and a cheaper one to get right
than regrouping half-built processes. Two windows, both ending with the one-machine launcher's `launch`
returning, after which `execute_dist` starts the run again on N - lost processes (if the job fits them, by the
same check a run is refused with before it starts; otherwise it stops with one line saying why):

- before every process has joined the world group (`launch.init_distributed`): no heartbeat runs yet, and the
  others wait in the group's creation, so the launcher itself watches its children: one that ended, or stays
  stopped by a signal for `launch.STOPPED_AT_START_S`, ends the start (`WorkerResult.lost_at_start`);
- after it, while each process builds its part of generation 0 (`first_build`): the heartbeat finds the loss
  within seconds (a dead process at once, a stalled one after backend.lost_after_s), rank 0 fences the lost ranks
  (a stalled one is killed) and every process ends with `LostAtStart`, its `StartupLoss` sent to the launcher.
  A stopped rank 0 hosts the store, so calls the others make on it outside the heartbeat's watch would wait out
  the collective timeout: the launcher ends the start when rank 0 stays stopped for backend.lost_after_s before
  it says its engine is about to start (`DistContext.started`).

Under torchrun the processes end the same way and torchrun's agent decides (--max-restarts starts them all again).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import dataclass

import torch.distributed as dist

from batchgen.dist.errors import DistConfigError, WorkerLost
from batchgen.dist.failure import Heartbeat
from batchgen.dist.launch import DistContext
from batchgen.dist.settings import DistSettings, check_dist, dist_host_pools
from batchgen.job import Job
from batchgen.memory import ConfigError


class LostAtStart(RuntimeError):
    """A process was lost while the processes built their parts, before the first step: nothing ran."""


@dataclass
class StartupLoss:
    """What a process that ended with LostAtStart tells the launcher (as a stopped run's `partial`)."""

    lost: list[int]  # launch ranks found lost
    cause: str

    @property
    def summary(self) -> str:
        return "nothing ran"


def first_build(gen, build):
    """`build()` (this process's part of generation 0); a peer lost meanwhile ends this process with LostAtStart
    carrying a StartupLoss (rank 0 first fences every lost rank: a stalled process must not keep the launcher
    waiting)."""
    from batchgen.dist.rejoin import fence_ranks, with_partial

    try:
        return build()
    except WorkerLost as err:
        peers = [r for r in range(gen.size) if r != gen.rank]
        lost = sorted(set(gen.heartbeat.lost(peers)) | ({err.rank} if err.rank in peers else set()))
        if gen.rank == 0 and gen.ctx.store is not None:
            fence_ranks(lost, _own_store(gen.ctx))
        names = ", ".join(map(str, lost)) or "a peer"
        raise with_partial(LostAtStart(f"rank {names} lost during start-up, before the first step ({err.cause}); "
                                       "nothing ran"), StartupLoss(lost, str(err))) from err


def _own_store(ctx: DistContext):
    """A connection of its own to the rendezvous store: a group creation stuck on a lost member's key holds the
    process's usual one until the collective timeout, and every other call on it would wait as long."""
    client = dist.TCPStore(ctx.env.master_addr, ctx.env.master_port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=ctx.timeout_s))
    return dist.PrefixStore(ctx.namespace.rstrip("/"), client) if ctx.namespace else client


def lost_at_start(results) -> set[int] | None:
    """The launch ranks lost at start-up, from the one-machine launcher's results (None: no start-up loss; the
    run either went on or failed later)."""
    for r in results:
        if r.lost_at_start is not None:
            return {r.lost_at_start[0]}
    if results[0].ok:
        return None
    if isinstance(results[0].value, StartupLoss):  # rank 0 decides (the others may call it lost once it ended)
        return set(results[0].value.lost)
    if not any(isinstance(r.value, StartupLoss) for r in results):
        return None
    # rank 0 itself lost: it, and whoever died by a signal (a process rank 0 fenced, or killed from outside)
    return {0} | {r.rank for r in results if r.exitcode is not None and r.exitcode < 0}


def start_again(results, lost: set[int], job, settings, reduce, failed):
    """The job and settings to start again on the processes not lost at start-up, and the line that says so;
    raises `failed` (run.DistRunFailed) with the reason when they cannot hold the job (the same check that
    refuses a run before it starts)."""
    bad = [r for r in results if not r.ok]
    procs, why = settings.procs - len(lost), failed(bad).headline
    try:
        if procs < 1:
            raise DistConfigError("no process is left")
        job_n, settings_n = reduce(job, procs), dataclasses.replace(settings, procs=procs)
        check_dist(job_n, settings_n, launched=False)
    except ConfigError as e:
        raise failed(bad, why=f"cannot start again on the other {procs} processes: {str(e).splitlines()[0]}") \
            from None
    return job_n, settings_n, f"{why.removeprefix('backend=dist stopped: ')}; started again on {procs} processes"


def agree_host_kv(ctx: DistContext, job: Job, settings: DistSettings, heartbeat: Heartbeat) -> DistSettings:
    """Without backend.host_kv_gb, every process takes the budget rank 0 finds in the machine's free memory now
    (each process's own look could differ), through the rendezvous store; with it, the settings as they are."""
    if settings.host_kv_gb is not None:
        return settings
    key = "batchgen/host_kv_gb"
    if ctx.rank == 0:  # its pages, and half a page more than float rounding can take away
        host = dist_host_pools(job, settings)
        gb = 0.0 if host.per_pool_bytes is None else (host.budget_pages + 0.5) * host.page_bytes / 1e9
        ctx.store.set(key, repr(gb))
    else:  # polled under the heartbeat: a rank 0 lost before it wrote the key is found within seconds
        deadline = time.monotonic() + settings.timeout_s
        while not ctx.store.check([key]):
            if heartbeat.lost([0]) or time.monotonic() > deadline:
                raise WorkerLost(0, f"{heartbeat.cause(0)}, before it said the host KV budget")
            time.sleep(heartbeat.interval_s / 5)
        gb = float(ctx.store.get(key).decode())
    return settings if gb == 0.0 else dataclasses.replace(settings, host_kv_gb=gb)
