"""Continuing a `backend=dist` run on the surviving processes after a worker other than rank 0 died.

A torch process group cannot drop a member, so the survivors build a new one: a *generation*. Generation 0 is
the group the launcher (or torchrun) made; each recovery starts the next:

1. Every survivor finds the loss on its own (`Comm` raises `WorkerLost` in the operation that needed the dead
   peer, or, waiting for a command, as soon as the heartbeat marks any member lost).
2. Rank 0 decides who survives (everyone its heartbeat does not call lost: `decide_survivors`) and publishes
   the list in the rendezvous store under the next generation's key (`publish`); the others wait for that key
   (`await_decision`), bounded by the collective timeout and abandoned at once if rank 0's heartbeat stops (a
   dead rank 0 takes the store, the engine and the outputs with it: that is not recoverable). Rank 0 may
   instead publish a refusal (the survivors cannot hold the model, by the same memory plan the run was
   checked with): everyone then stops with that one line.
   Before it goes on, rank 0 fences every lost rank (fence.py): a process still running on its machine
   (stalled, not dead) is killed, so that it neither rewrites the host copies rank 0 is about to read nor
   keeps the launcher waiting after the run; only a rank known dead (or released, below) is restored from.
3. `regroup`: every old group is destroyed (gloo lets pending operations on it go) but its objects are
   retired, not freed (`groups.retire`), and the survivors, renumbered in launch-rank order (rank 0 stays 0),
   join a new default group over a `PrefixStore` of the same store with the generation in its prefix; a new
   heartbeat runs under its own prefix with the new numbering. The old heartbeat runs on until every survivor
   has rebuilt its part and settled its cache (steps 4 and 5) and rank 0 commits the new generation
   (rejoin.py): a survivor lost before that sends them all back to step 2 without it (the next generation
   number, the old numbering); one lost after it is found by the engine's next step, a recovery from the
   committed generation.
4. Each survivor builds its part again (run.py): the model from the same seed or directory (deterministic), its
   expert shard of the new contiguous placement over the survivors (`ExpertParallelMoE` over the new group, or
   the plain layer when one process is left); it keeps its KV cache when the smaller group's memory plan gives
   the same pool (else a fresh one).
5. The caches are the truth (`settle_caches`, settle.py): the loss was caught mid-step, so a planned yield, restore or
   migration may or may not have happened. Each survivor reports what its cache holds; rank 0 keeps a sequence
   where one survivor holds exactly the KV its tokens imply (`keep_plan`: prompt + generated - 1 tokens, on
   device or as a host copy; the interrupted forward's one extra slot is dropped and written again, with the
   same token, by the next forward); every survivor drops the rest.
6. Rank 0 (`requeue`): a fresh `ClusterState` of the smaller cluster, remapped: finished sequences stay finished
   (tokens, times, counters kept); kept ones run on, or wait suspended, on their survivor (pages and host copies
   as its cache holds them; the new `KVLedger` says which cache); every other unfinished one (the lost rank's,
   and part-written prompts) waits at the head of the queue with the tokens it had generated (`decoded` kept):
   the engine's recompute path (the one eviction uses) prefills prompt + generated again, and sampling goes on
   at step len(generated) with the same per-(sequence, step) draws, so outputs equal an undisturbed run's. The
   engine restarts on it (the policy planned again for the survivors), on the same clock.
7. Restore or recompute (`batchgen.dist.restore`, rank 0, with `backend.shared_host_copies`): each rank's host pool is a
   shared-memory file that outlives it, with an index of its complete host copies (shared_host.py). For every
   unfinished sequence that no survivor kept and whose copy in a lost rank's index holds exactly prompt +
   generated - 1 tokens, the survivors' latency model prices restoring it (`choose`: its KV over the host link,
   `kv_restore` x layers) against recomputing it (a prefill of prompt + generated tokens on one rank, as the
   simulator prices a forward); the cheaper wins. Rank 0 reads a restored one from the dead rank's file and
   adopts it as a host copy in its own cache (within the node's host room); it waits suspended there like a
   kept sequence with a host copy (counted as `restored`, not `kept`). The rest are recomputed as above.

8. Several instances (`instance_survivors`): the instance that lost a worker is dropped whole, so that the
   others keep their size, expert placement and KV; its live processes are released (`await_decision` returns
   None and they leave the run, handing their shared host files over to rank 0: `SharedHostFiles.hand_over`),
   its sequences are requeued and dealt over the remaining instances' queues.
   Every process of the run, not only the dead one's peers, abandons its step as soon as the heartbeat reports
   the loss (comm.Comm._check_lost): instance 0 may be mid-forward with rank 0, which stops to recover (the
   groups of an abandoned step are retired with their generation, never freed: step 3).
   A loss in rank 0's own instance stops the run (rank 0 holds the engine).

What this does NOT do, said plainly:

- Restored sequences all go to rank 0 (the reader must be on the dead rank's machine, and rank 0 is the one
  survivor whose machine is known; the policy may migrate them later). Without shared host copies (or on
  another machine) recompute is the only path.
- The policy's own carried state (`Decision.carry`) starts afresh in the new engine.
- NCCL: the code aborts the old communicators before destroying them; it has not run on a GPU.
- Under torchrun the elastic agent stops every worker when one exits: recovery needs the one-machine launcher.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from batchgen.core.ops import KVLedger
from batchgen.core.queues import IdQueue
from batchgen.core.sequences import FINISHED, PENDING, SUSPENDED
from batchgen.core.state import ClusterState
from batchgen.dist.errors import WorkerLost
from batchgen.dist.failure import Heartbeat
from batchgen.dist.groups import retire
from batchgen.dist.launch import DistContext, DistEnv, join_group
from batchgen.dist.rendezvous import await_peers

KEY = "batchgen/recover/gen{}"


class RecoveryRefused(RuntimeError):
    """The run cannot continue on the survivors (rank 0 says why); the first line is the whole story."""


@dataclass
class Recovery:
    """One recovery, as a researcher reads it in the output (ranks are launch ranks)."""

    generation: int          # the group generation it started (1 for the first recovery)
    lost: list[int]          # the ranks found lost
    survivors: list[int]     # the ranks that went on, in their new rank order
    at_s: float              # rank 0's engine clock when it caught the loss
    cause: str               # what showed it (WorkerLost's message)
    finished_before: int     # sequences that had finished (kept: tokens, times, counters)
    kept: int                # unfinished sequences whose KV a survivor kept (running or suspended there)
    requeued: int            # unfinished sequences with KV or generated tokens, recomputed from prompt + generated
    on_lost_rank: int        # of them, those whose KV (device or host copy) was in a lost rank's process
    regroup_s: float = 0.0   # from the catch to the new engine's start: decision, new group, model rebuilt
    restored: int = 0        # unfinished sequences adopted from a lost rank's shared host copy (not recomputed)
    restorable: int = 0      # lost sequences with a complete shared host copy (restored + those cheaper to
                             # recompute + those the host room left out)
    released: list[int] = field(default_factory=list)  # live ranks that left with their instance (several
                                                        # instances: the one that lost a worker is dropped whole)
    fenced: list[int] = field(default_factory=list)  # lost ranks still running (stalled, not dead): rank 0 killed
                                                      # them before going on (fence.py)
    at_unix: float = 0.0     # the catch on the wall clock (time.time()), to line it up with an outside event (a
                             # kill: benchmarks/dist_faults.py); the engine went on at at_unix + regroup_s


@dataclass
class Generation:
    """One process group's lifetime: this process's membership in it, its heartbeat, and which launch rank each
    of its ranks is."""

    number: int
    ctx: DistContext
    heartbeat: Heartbeat
    members: tuple[int, ...]  # members[r]: the launch rank of this generation's rank r

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def size(self) -> int:
        return self.ctx.world_size


# ---- who survives ------------------------------------------------------------------------------------------
def decide_survivors(gen: Generation, err: WorkerLost, settle_s: float | None = None) -> list[int]:
    """Rank 0: the ranks of `gen` that go on (ascending; rank 0 first). The rank the error named and every rank
    the heartbeat calls lost are out; after an error that named no rank, wait for the heartbeat to find one.
    `settle_s` (default one heartbeat interval): a short wait so that processes killed together (one node's)
    are dropped together rather than in two recoveries."""
    hb = gen.heartbeat
    peers = [r for r in range(gen.size) if r != gen.rank]
    lost = set(hb.lost(peers))
    if err.rank is not None and err.rank != gen.rank:
        lost.add(err.rank)
    if not lost:
        found = hb.wait_for_loss(peers)
        if found is not None:
            lost.add(found)
    if not lost:
        raise RecoveryRefused(f"a peer failed ({err}) but no rank stopped beating: cannot tell whom to drop")
    time.sleep(hb.interval_s if settle_s is None else settle_s)
    lost |= set(hb.lost(peers))
    return [r for r in range(gen.size) if r not in lost]


def instance_survivors(alive: list[int], size: int, num_instances: int, members: tuple[int, ...]) -> list[int]:
    """Rank 0, several instances: the ranks of the instances that lost nobody (instances are consecutive blocks
    of `size` ranks). The instance that lost a worker is dropped whole, so that the others keep their size,
    their expert placement and their KV; its live processes are released. Raises RecoveryRefused when rank 0's
    own instance lost one (rank 0 runs the engine and cannot leave)."""
    if num_instances == 1:
        return alive
    intact = [i for i in range(num_instances) if all(r in alive for r in range(i * size, (i + 1) * size))]
    if 0 not in intact:
        dead = [members[r] for r in range(size) if r not in alive]
        raise RecoveryRefused(f"rank 0's instance lost rank {', '.join(map(str, dead))}: rank 0 runs the engine and "
                              f"cannot leave with its instance, and its survivors cannot form an instance of {size} "
                              "processes (only another instance's loss is recovered from)")
    return [r for i in intact for r in range(i * size, (i + 1) * size)]


def publish(gen: Generation, survivors: list[int] | None, reason: str = "", released: list[int] = (),
            number: int | None = None) -> None:
    """Rank 0: generation `number`'s members (ranks of `gen`; default the next generation) and the live ranks
    that leave with a dropped instance, or None with the reason the run stops."""
    gen.ctx.store.set(KEY.format(gen.number + 1 if number is None else number),
                      json.dumps({"survivors": survivors, "reason": reason, "released": list(released)}))


def await_decision(gen: Generation, err: WorkerLost, timeout_s: float, number: int | None = None
                   ) -> list[int] | None:
    """A worker after WorkerLost: rank 0's list of survivors for the next generation (None: this rank is
    released with its dropped instance, and leaves the run). Raises the WorkerLost
    itself when rank 0 is the lost one (nobody is left to decide), RecoveryRefused when rank 0 stops the run or
    leaves this rank out, WorkerLost naming rank 0 when no decision comes within `timeout_s`."""
    if err.rank == 0:
        raise err
    key = KEY.format(gen.number + 1 if number is None else number)
    hb, store = gen.heartbeat, gen.ctx.store
    deadline = time.monotonic() + timeout_s
    while True:
        if hb.lost([0]):
            raise WorkerLost(0, f"{hb.cause(0)}, while waiting for rank 0's recovery decision (after: {err})")
        try:
            if store.check([key]):
                break
        except Exception as e:  # noqa: BLE001 (rank 0 hosts the store; it is gone with it)
            raise WorkerLost(0, f"the store stopped answering ({e}) while waiting for the recovery decision") \
                from None
        if time.monotonic() >= deadline:
            raise WorkerLost(0, f"no recovery decision from rank 0 within {timeout_s:g} s (after: {err})")
        time.sleep(hb.interval_s / 4)
    decision = json.loads(store.get(key))
    survivors = decision["survivors"]
    if survivors is None:
        raise RecoveryRefused(f"rank 0 stopped the run after {err}: {decision['reason']}")
    if gen.rank in decision.get("released", ()):
        return None
    if gen.rank not in survivors:
        raise RecoveryRefused(f"rank 0 left rank {gen.members[gen.rank]} out of the recovered group (it was found "
                              f"lost: {err})")
    return survivors


# ---- the new group -----------------------------------------------------------------------------------------
def regroup(gen: Generation, survivors: list[int], *, interval_s: float, dead_after_s: float,
            number: int | None = None) -> Generation:
    """Leave every group of `gen` and join the survivors' new one, generation `number` (default the next; this
    process must be among them), with a new heartbeat. `gen`'s heartbeat watches the whole regroup, and is left
    running for the caller to stop once the new generation is committed (rejoin.py), so that a survivor lost at
    any moment ends it within seconds with WorkerLost (in `gen`'s numbering), never with a store timeout: the
    survivors first meet on the store (rendezvous.py); the group is created on a thread while this one polls the
    heartbeat (a creation waits on the store for every member, unbounded by any heartbeat); and they meet once
    more after starting the new heartbeat, so that the new generation begins only when every member beats in it
    (a member that never beat in it could never be found lost there)."""
    number = gen.number + 1 if number is None else number
    what = f"the regroup into generation {number}"
    store = gen.ctx.store
    await_peers(store, f"batchgen/regroup/gen{number}", gen.rank, survivors, gen.heartbeat, gen.ctx.timeout_s, what)
    if gen.ctx.backend == "nccl":  # a communicator whose peer died may block a plain destroy
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
    if dist.is_initialized():
        retire(dist.group.WORLD)
        dist.destroy_process_group()
    # group names count from 0 on every member: an abandoned attempt's creation (rejoin.py) counted one here
    dist.distributed_c10d._world.group_count = 0
    old = gen.ctx
    new_rank = survivors.index(gen.rank)
    env = DistEnv(new_rank, len(survivors), old.env.local_rank, old.env.master_addr, old.env.master_port)
    # its own connection to the store: a creation stuck on a lost member's key holds its connection until the
    # collective timeout, and every other call on that connection (the fencing's, the error's) would wait too
    client = dist.TCPStore(old.env.master_addr, old.env.master_port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=old.timeout_s))
    pg_store = dist.PrefixStore(f"{old.namespace}batchgen/pg/gen{number}", client)
    watched(lambda: join_group(old.backend, pg_store, new_rank, len(survivors),
                                datetime.timedelta(seconds=old.timeout_s), old.device),
             gen, survivors, f"while the survivors created their new group ({what})")
    ctx = DistContext(env, old.device, old.backend, old.timeout_s, old.store_host_rank, store, old.report,
                      old.namespace)
    heartbeat = Heartbeat.for_context(ctx, interval_s=interval_s, dead_after_s=dead_after_s,
                                      prefix=f"batchgen/hb/gen{number}").start()
    # on a loss here the new heartbeat is left running, not stopped: a stopped one would tell the members that
    # went on that this process finished, and they would wait for it; its end (the process stops) is a loss
    await_peers(store, f"batchgen/joined/gen{number}", gen.rank, survivors, gen.heartbeat, old.timeout_s, what)
    return Generation(number, ctx, heartbeat, tuple(gen.members[r] for r in survivors))


def watched(create, gen: Generation, survivors: list[int], when: str) -> None:
    """Run `create` (a process group's creation) on a thread; raise WorkerLost as soon as `gen`'s heartbeat
    finds a survivor lost. The thread, blocked on the store for the lost member's key, is retired (groups.py):
    it ends at the collective timeout, or with the process."""
    outcome: list = []

    def run():
        try:
            create()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
            outcome.append(e)

    thread = threading.Thread(target=run, name="regroup", daemon=True)
    thread.start()
    hb, peers = gen.heartbeat, [r for r in survivors if r != gen.rank]
    while thread.is_alive():
        lost = hb.lost(peers)
        if lost:
            retire(thread)
            raise WorkerLost(lost[0], f"{hb.cause(lost[0])}, {when}")
        thread.join(hb.interval_s / 5)
    if outcome and outcome[0] is not None:
        raise outcome[0]


# ---- the engine's state over the survivors -------------------------------------------------------------------
def requeue(old: ClusterState, generated: list[list[int]], done: np.ndarray, new: ClusterState, now: float,
            lost_gpus: list[int], keep: list[dict] | None = None) -> tuple[int, int, int, int]:
    """Fill `new` (a fresh state of the smaller cluster, every sequence pending) from `old` (the state when the
    loss was caught, possibly mid-step), the tokens actually generated and what the survivors' caches kept
    (`keep`, per new rank, from `keep_plan`; None: nothing kept).

    Finished sequences stay finished (`done`: the stopping rules ended them, possibly in the interrupted step,
    whose finish time is then `now`). A kept sequence belongs to its survivor's instance and runs device-resident
    on that survivor (pages as its cache
    holds them; a host copy counted where its cache has one) or waits suspended on that survivor's node, and the
    new ledger says which cache holds it. Every other unfinished one is pending with `decoded` = its generated
    tokens: those that had KV or tokens at the head of the queue (as an eviction leaves them: recomputed from
    prompt + generated), the others behind them in their old queue order.
    Returns (finished, kept, requeued, requeued whose KV was in a lost rank's process)."""
    to, tn = old.table, new.table
    n = len(tn)
    gen = np.array([len(g) for g in generated], np.int64)
    done = np.asarray(done, bool)
    if not np.all(done[to.where == FINISHED]):
        raise AssertionError("a sequence the state finished is not finished by its tokens")
    tn.input_len[:] = to.input_len
    tn.output_len[:] = np.where(done, gen, to.output_len)
    tn.decoded[:] = gen
    for name in ("yields", "migrations", "recomputes", "partitions"):
        getattr(tn, name)[:] = getattr(to, name)
    tn.first_token_time[:] = np.where(np.isnan(to.first_token_time) & (gen > 0), now, to.first_token_time)
    tn.finish_time[:] = np.where(done, np.where(np.isnan(to.finish_time), now, to.finish_time), np.nan)
    tn.where[:] = np.where(done, FINISHED, PENDING)
    tn.instance[:] = 0
    instance_of = new.topo.gpu_instance
    new.num_finished = int(done.sum())
    kept = np.zeros(n, bool)
    ledger = KVLedger.of(new)
    node = new.topo.gpu_node
    for rank, mine in enumerate(keep or []):
        if not mine:
            continue
        ids = np.fromiter(mine, np.int64, len(mine))
        dev = np.array([mine[int(s)][0] for s in ids], bool)
        pages = np.array([mine[int(s)][2] for s in ids], np.int64)
        copy = np.array([mine[int(s)][3] for s in ids], bool)
        kept[ids] = True
        ledger.holder[ids], ledger.on_device[ids] = rank, dev
        tn.kv_gpu[ids] = rank  # the survivor's cache holds it (its pages, or its host copy)
        run, park = ids[dev], ids[~dev]
        tn.instance[ids] = instance_of[rank]  # the instance whose ranks include the survivor that holds it
        if run.size:
            new._join_gpu(int(instance_of[rank]), run, np.full(run.size, rank), lookahead_tokens=0, reserve=False)
            new._set_pages(run, pages[dev])
        if park.size:
            tn.where[park] = SUSPENDED
            new.suspended[int(node[rank])].push(park)
            if new.sharing:
                new.parked(park, 1)
        with_copy = ids[copy]
        if with_copy.size:
            tn.host_node[with_copy] = node[rank]
            new._host_add(np.full(with_copy.size, node[rank]), tn.input_len[with_copy] + tn.decoded[with_copy])
    had_kv = (to.where >= 0) | (to.where == SUSPENDED) | (gen > 0) | (to.prefilled > 0)
    requeued = ~done & ~kept & had_kv
    tn.recomputes[requeued] += 1
    # held by a lost rank: running there, or its KV (device pages or host copy) in that process's cache, as the
    # ledger of the ops so far has it
    holder = KVLedger.of(old).holder
    on_lost = requeued & (np.isin(to.where, lost_gpus) | np.isin(holder, lost_gpus))
    queued = [q.to_array() for q in (*old.pending, *old.pinned)]
    order = np.concatenate(queued) if queued else np.empty(0, np.int64)
    waiting = order[~done[order] & ~requeued[order] & ~kept[order]]
    rest = np.setdiff1d(np.flatnonzero(~done & ~requeued & ~kept), waiting)  # e.g. a prefill to host mid-step
    line = np.concatenate([np.flatnonzero(requeued), rest, waiting])
    # several instances: dealt round-robin in that order, as the launch split the input (each keeps the order)
    share = np.arange(line.size) % new.topo.num_instances
    tn.instance[line] = share
    new.pending = [IdQueue(line[share == i]) for i in range(new.topo.num_instances)]
    new.pinned = [IdQueue() for _ in range(new.topo.num_gpus)]
    new.check()
    if sum(len(q) for q in new.pending) + int(kept.sum()) != n - new.num_finished:
        raise AssertionError("requeue lost track of a sequence")
    return new.num_finished, int(kept.sum()), int(requeued.sum()), int(on_lost.sum())
