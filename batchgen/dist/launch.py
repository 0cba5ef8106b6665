"""Starting the processes of a multi-process run and joining them into one process group.

Two ways in, one result (a `DistContext` per process):

- torchrun (`torchrun --nproc-per-node=N -m ...`) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
  MASTER_PORT: `DistEnv.from_env()` reads them and `init_distributed` joins the group.
- One machine without torchrun: `launch(fn, procs)` picks a free port, starts `procs` processes itself
  (torch.multiprocessing), and each runs `fn(ctx, *args)` once joined; return values and errors come back to the
  caller per rank, and a process that dies (SIGKILL, out of memory) is reported by its exit code instead of
  taking the survivors down with it (torch.multiprocessing.spawn's join kills the others on the first death,
  which would hide how the survivors handled the loss). Before every process has joined the group, one that
  ends, or stays stopped by a signal, is reported at once to every process's result (`lost_at_start`: the others
  would wait for it in the group's creation, where no heartbeat runs yet), and processes left stopped after every
  other one ended are killed. The processes die with the launcher (Linux: the
  kernel sends them SIGKILL when it exits): a launcher killed by SIGKILL or the OOM killer leaves no process
  behind computing, or appending to a batch job's results file while the job is rerun.

The rendezvous store is created here rather than through `init_method="env://"` so that the failure detector
(`failure.Heartbeat`) can open its own connection to it. gloo on CPU, NCCL on CUDA; every collective of the
group has `timeout_s`, so a peer that stops answering never blocks a collective forever (the heartbeat finds a
dead one much sooner, see `failure.py`).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from batchgen.dist.errors import DistConfigError
from batchgen.dist.groups import retired

_PROGRESS = "progress"  # tags a progress message on the results queue (rank, _PROGRESS, pickled payload)
_JOINED = "joined"  # (rank, _JOINED, None): the process is in the group
_STARTED = "started"  # (0, _STARTED, None): rank 0's engine is about to take its first step
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_procs(procs: int, *, num_experts: int | None = None, world_size: int | None = None) -> None:
    """Refuse a process count that cannot work, before anything starts."""
    if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
        raise DistConfigError(f"backend.procs must be a positive integer, got {procs!r}")
    if num_experts is not None and procs > num_experts:
        raise DistConfigError(f"{procs} processes but the model has {num_experts} experts per layer: every process "
                              f"must own at least one expert; use at most {num_experts} processes")
    if world_size is not None and world_size != procs:
        raise DistConfigError(f"torchrun started {world_size} processes (WORLD_SIZE) but backend.procs={procs}; "
                              f"set backend.procs={world_size} or start {procs} processes")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job: what torchrun puts in the environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        env = os.environ if environ is None else environ
        missing = [v for v in ENV_VARS if v not in env]
        if missing:
            raise DistConfigError(f"not started by torchrun: {', '.join(missing)} unset; run under `torchrun "
                                  "--nproc-per-node=N` or let the one-machine launcher start the processes")
        try:
            e = cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), env["MASTER_ADDR"],
                    int(env["MASTER_PORT"]))
        except ValueError as err:
            raise DistConfigError(f"torchrun variables must be integers: {err}") from None
        e.check()
        return e

    def check(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise DistConfigError(f"RANK={self.rank} must be in 0..WORLD_SIZE-1 (WORLD_SIZE={self.world_size})")
        if self.local_rank < 0 or not 0 < self.master_port < 65536:
            raise DistConfigError(f"LOCAL_RANK={self.local_rank} must be >= 0 and MASTER_PORT={self.master_port} "
                                  "a port number")


@dataclass
class DistContext:
    """One process's membership: its rank, its device, the world group's backend and collective timeout,
    and the rendezvous store's address (for the heartbeat's own connection)."""

    env: DistEnv
    device: torch.device
    backend: str
    timeout_s: float
    store_host_rank: int | None  # the rank hosting the store (0), None when torchrun's agent hosts it
    store: Any = None            # this process's handle on the rendezvous store (recovery builds new groups on it)
    # the one-machine launcher's channel to its parent: report(payload) sends a progress message that outlives
    # this process (WorkerResult.progress); None under torchrun, which has no such parent
    report: Callable[[Any], None] | None = None
    # the start of this attempt's keys in the store: torchrun's agent keeps its store across the restarts of
    # --max-restarts, so an attempt's keys (gloo's addresses, heartbeats) must not be read by the next one. The
    # attempt is counted in the store, per rank (every attempt starts each rank once): TORCHELASTIC_RESTART_COUNT
    # is not it, since an agent whose own workers did not fail restarts them without counting a restart
    namespace: str = ""
    # the one-machine launcher's: called by rank 0 as its engine is about to take its first step (until then a
    # stopped rank 0, which hosts the store, is a loss at start-up: launch's rank0_stopped_s)
    started: Callable[[], None] | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(env: DistEnv, device: str | torch.device = "cpu", timeout_s: float = 60.0) -> DistContext:
    """Join the world group. CUDA: one device per process, cuda:LOCAL_RANK. timeout_s bounds every collective."""
    env.check()
    if timeout_s <= 0:
        raise DistConfigError(f"collective timeout must be positive, got {timeout_s} s")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available() or env.local_rank >= torch.cuda.device_count():
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise DistConfigError(f"local rank {env.local_rank} needs CUDA device {env.local_rank}, this machine "
                                  f"has {have}; start at most {have} processes per node or use device=cpu")
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise DistConfigError(f"device {device} is not supported for multi-process runs: use cpu or cuda")
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=env.rank == 0 and not agent_store, timeout=timeout)
    namespace = ""
    if agent_store:  # a restarted attempt must not meet the last one's keys (see DistContext.namespace)
        namespace = f"batchgen/start{store.add(f'batchgen/starts/rank{env.rank}', 1)}/"
        store = dist.PrefixStore(namespace.rstrip("/"), store)
    backend = backend_for(device)
    join_group(backend, dist.PrefixStore("batchgen/pg", store), env.rank, env.world_size, timeout, device)
    return DistContext(env, device, backend, timeout_s, None if agent_store else 0, store, namespace=namespace)


def join_group(backend: str, store, rank: int, world_size: int, timeout: datetime.timedelta,
               device: torch.device) -> None:
    """init_process_group, then a barrier: gloo's mesh connects pair by pair, so a rank that returned from
    init may still have peers mid-handshake; without the barrier a rank that finishes at once (rank 0 hosts
    the store) can close its side and fail a peer's init with 'Connection closed by peer' instead of letting
    that peer run and report its own outcome."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    dist.barrier()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (the OS picks it); the launcher's rank 0 binds it for the store moments later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- the one-machine launcher ---------------------------------------------------------------------------
@dataclass
class WorkerResult:
    """How one process ended: its return value, or the error it raised (formatted), or only its exit code
    (killed by a signal: exitcode is minus the signal number)."""

    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None

    progress: list = field(default_factory=list)  # what the process reported while running (DistContext.report)
    # (launch rank, how it ended) of the process lost before every process had joined the group, when one was:
    # nothing ran, so the caller may start again without it
    lost_at_start: tuple[int, str] | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """This process gets SIGKILL when its parent exits (Linux; elsewhere nothing happens). The parent here is
    the thread that started the process: `launch` runs on the caller's thread, which waits for the processes.
    A parent already gone by now (it died between the fork and this call) ends this process at once."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _worker(rank: int, procs: int, port: int, fn: Callable, args: tuple, device: str, timeout_s: float,
            threads: int | None, results, parent: int | None = None) -> None:
    if parent is not None:
        die_with_parent(parent)
    if threads is not None:
        torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(procs), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx, code = None, 0
    try:
        ctx = init_distributed(DistEnv.from_env(), device, timeout_s)
        results.put((rank, _JOINED, None))
        ctx.report = lambda payload: results.put((rank, _PROGRESS, pickle.dumps(payload)))
        ctx.started = lambda: results.put((rank, _STARTED, None))
        # plain pickle, by value: torch's queue would pass tensors as shared-memory handles, which die with
        # the process that made them
        results.put((rank, pickle.dumps(fn(ctx, *args)), None))
    except BaseException as e:  # reported to the launcher, which decides; the process then exits nonzero
        # (with what the error kept, `e.partial`: a stopped run's finished outputs)
        partial = getattr(e, "partial", None)
        results.put((rank, None if partial is None else pickle.dumps(partial),
                     f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        code = 1
    finally:
        if ctx is not None:
            try:
                ctx.close()
            except Exception:  # a group whose peer died may refuse a clean shutdown; the process ends anyway
                pass
    if retired():  # freeing a recovery's old groups could wait out a collective's timeout (groups.retire)
        results.close()
        results.join_thread()  # the result is sent before the process ends
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


def launch(fn: Callable, procs: int, args: tuple = (), *, device: str = "cpu", timeout_s: float = 60.0,
           threads: int | None = 1, start_method: str = "spawn", join_timeout_s: float = 600.0,
           num_experts: int | None = None, rank0_stopped_s: float | None = None) -> list[WorkerResult]:
    """Run `fn(ctx, *args)` in `procs` new processes joined into one group; one WorkerResult per rank.

    threads: torch intra-op threads per process (1: one core each; None leaves torch's default).
    start_method: "spawn" (safe anywhere; fn must be importable) or "fork" (no re-import of torch, much faster
    to start; fine when the parent holds no process group and no CUDA context). Processes still running after
    join_timeout_s are killed and reported with exitcode None and an error saying so."""
    check_procs(procs, num_experts=num_experts)
    mp = torch.multiprocessing.get_context(start_method)
    results = mp.Queue()
    port = free_port()
    workers = [mp.Process(target=_worker, args=(r, procs, port, fn, args, device, timeout_s, threads, results,
                                                os.getpid()), daemon=False) for r in range(procs)]
    for w in workers:
        w.start()
    got: dict[int, tuple[Any, str | None]] = {}
    deadline = time.monotonic() + join_timeout_s
    progress: dict[int, list] = {r: [] for r in range(procs)}

    joined: set[int] = set()
    started: set[int] = set()

    def take(item) -> None:
        rank, value, error = item
        if isinstance(value, str) and value == _PROGRESS:
            progress[rank].append(pickle.loads(error))
        elif isinstance(value, str) and value == _JOINED:
            # the group's creation ends in a barrier (join_group): one process back from it means every one is in
            # the group, even one whose own message lags (its queue's feeder thread had not written it when the
            # process was stopped right after, on a loaded machine)
            joined.update(range(procs))
        elif isinstance(value, str) and value == _STARTED:
            started.add(rank)
        else:
            got[rank] = (value, error)

    failed_start = None  # (rank, how) of a process that ended, or stopped, before joining the group
    stopped_since: dict[int, float] = {}
    left_stopped = 0.0  # since when every process still alive has been stopped by a signal
    while time.monotonic() < deadline:
        try:  # drain while waiting: a child blocks at exit until its queued result has been read
            take(results.get(timeout=0.05))
            continue
        except queue.Empty:
            pass
        if not any(w.is_alive() for w in workers):
            break
        if len(joined) < procs:  # the others would wait for it in the group's creation until timeout_s
            dead = [r for r, w in enumerate(workers) if r not in joined and not w.is_alive()]
            if dead:
                failed_start = (dead[0], f"ended (exit code {workers[dead[0]].exitcode})", _BEFORE_JOINED)
                break
            now = time.monotonic()
            for r, w in enumerate(workers):
                if r not in joined and _stopped(w.pid):
                    stopped_since.setdefault(r, now)
                else:
                    stopped_since.pop(r, None)
            late = [r for r, t in stopped_since.items() if now - t >= STOPPED_AT_START_S]
            if late:
                failed_start = (late[0], f"was stopped (a signal: SIGSTOP or SIGTSTP) for {STOPPED_AT_START_S:g} s",
                                _BEFORE_JOINED)
                break
        elif rank0_stopped_s and 0 not in started and _stopped(workers[0].pid):
            # before the first step, rank 0 stopped: it hosts the store, whose calls outside the heartbeat's
            # watch (the start's) would wait for the collective timeout
            stopped_since.setdefault(0, time.monotonic())
            if time.monotonic() - stopped_since[0] >= rank0_stopped_s:
                failed_start = (0, f"was stopped (a signal) for {rank0_stopped_s:g} s",
                                "before the first step; it hosts the store")
                break
        elif all(_stopped(w.pid) for w in workers if w.is_alive()):  # nobody left to go on with them
            left_stopped = left_stopped or time.monotonic()
            if time.monotonic() - left_stopped >= STOPPED_AT_START_S:
                break
        else:
            left_stopped = 0.0
            stopped_since.pop(0, None)
    overdue = [r for r, w in enumerate(workers) if w.is_alive()]
    for r in overdue:
        workers[r].kill()
    for w in workers:
        w.join(5)
    while True:
        try:
            take(results.get_nowait())
        except queue.Empty:
            break
    out = []
    for r, w in enumerate(workers):
        value, error = got.get(r, (None, None))
        value = None if value is None else pickle.loads(value)
        if r in overdue and failed_start is not None:
            out.append(WorkerResult(r, None, value, f"stopped: rank {failed_start[0]} {failed_start[1]} during "
                                    f"start-up ({failed_start[2]}); nothing ran", progress[r]))
        elif r in overdue and left_stopped:
            out.append(WorkerResult(r, None, value, "stopped by a signal after every other process had ended: killed",
                                    progress[r]))
        elif r in overdue:
            out.append(WorkerResult(r, None, value, f"still running after {join_timeout_s} s: killed",
                                    progress[r]))
        else:
            out.append(WorkerResult(r, w.exitcode, value, error, progress[r]))
    if failed_start is not None:
        for res in out:
            res.lost_at_start = failed_start[:2]
    return out


_BEFORE_JOINED = "before every process had joined the group"
STOPPED_AT_START_S = 1.0  # a process stopped this long before the group exists is lost (the others wait in its
                          # creation, where no heartbeat runs yet)


def _stopped(pid: int | None) -> bool:
    """Whether the process is stopped by a signal (Linux /proc: state T); False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError, TypeError):
        return False
