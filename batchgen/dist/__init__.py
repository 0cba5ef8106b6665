"""The worker side of the multi-process executor (issue 9): one process per rank, on torch.distributed.

Pieces, one module each:

- `launch`: join the world group from torchrun's environment (`DistEnv.from_env`, `init_distributed`) or start
  N processes on one machine (`launch`); gloo on CPU, NCCL on CUDA; every collective has a timeout; bad process
  counts are refused first (`check_procs`: procs < 1, more processes than experts, WORLD_SIZE != procs).
- `groups`: the world split into instances, one process group each (`instance_groups`), so instances run
  concurrently and their all-to-alls never wait on each other; per instance, a command and a reply group of
  rank 0 and its ranks (`control_groups`).
- `control`: rank 0's `CommandChannel`: commands posted to the instances they concern and collected later, so
  that one instance's forward runs while the next instance's is posted (and the wire both sides speak).
- `placement`: which rank of an instance owns which expert (contiguous blocks by default).
- `ep_moe`: `ExpertParallelMoE`, an MoE layer over an instance's ranks: route here, all-to-all the rows to
  the experts' owners, run the local shard (`SparseMoE.expert_shard` / `sorted_expert_rows`: the same kernels
  as the single-process layer), all-to-all back, combine; shared experts (DeepSeek-V3) run where the tokens are.
- `kv_transfer`: MIGRATE across processes: a sequence's KV packed from a `PagedKVCache`, sent with its
  header (sequence id, dtype, shape), adopted into the receiver's cache.
- `recovery`: after a lost worker, the survivors' new group (a generation), and the engine's state over them.
- `failure` + `comm`: a heartbeat per process and a `Comm` that asks it while waiting for every operation,
  without ever breaking the operation (gloo sends and receives are waited whole on a helper thread: a timed wait
  closes their pair), so a SIGKILLed peer becomes `WorkerLost(rank)` within a heartbeat or two (its pid is
  gone) and a stalled one after `backend.lost_after_s` of silence, never a hang; a slow peer is waited for.
- `rendezvous`: processes meet on the store under the heartbeat before creating groups (a generation's start,
  a regroup), so a member lost meanwhile is named at once instead of after a store timeout.

The executor built on them (`backend=dist`: `run` starts or joins the processes, `backend.DistBackend` is the
engine's backend on rank 0, `worker.RankWorker` each process's share) drives them as follows:

1. Start: torchrun or `launch` starts world = sum of instance sizes processes. Every process builds (or
   loads) the model, keeps its experts' shard per MoE layer (`ExpertParallelMoE` over its instance's group),
   starts a `Heartbeat`, and holds its own `PagedKVCache` and host copies. Rank 0 also runs the engine and
   the policy: it is a worker of instance 0 as well, so no process idles. The cluster's instances are
   consecutive blocks of ranks (GPU g is rank g), each with its own process group.
2. Each step: rank 0 turns the policy's decision into a plan of per-rank operation lists (yield, restore,
   evict ids; migrations (id, source rank, destination rank, to device, host copy kept, across nodes); partition
   groups; prefill and decode ids) and
   broadcasts it to the instance's processes (pickled, through a `Comm` on the instance's gloo command group,
   even when the data moves over NCCL, so that a dead peer is noticed there too). A forward is posted, then
   the instance's engine loop yields and the next instance's loop posts its own: the instances compute at the
   same time (control.py). A migration of a sequence one instance yielded and another resumes (a shared
   node's pool) goes to both instances as one ordered step, over the world group. Every worker then runs its
   own list in a fixed order: cache operations on its cache; migrations in plan order (the source `send_sequence`
   from its device pages or host copy, the destination `recv_sequence` into its device pages or host copy; both
   walk the same list, so sends and receives pair up without a global view); its sequences' attention; then
   every MoE layer through `ExpertParallelMoE` (a rank with no tokens this step still takes part: the
   all-to-alls are collective); sampling for its sequences.
3. Reports: each worker returns its sampled tokens and its timings (busy time, `Comm.comm_s` spent in
   collectives, idle: waiting for a command is idle) to rank 0 (gathered on the instance's reply group when
   rank 0 collects that forward); rank 0 updates the state and the metrics (tokens/s per GPU over processes
   that exist).
4. Failure: a process's `Comm` (the all-to-alls, KV transfers and the control channel alike) raises
   `WorkerLost` in the operation that needed the dead peer (or, waiting, as soon as any member is lost),
   asking the heartbeat between wait slices. `recovery`: rank 0 decides the survivors and publishes them in
   the store; they build a new group (a torch process group cannot drop a member), re-place the experts over
   themselves (weights built again from the same seed or directory), keep the KV their caches hold, and the
   engine goes on; the lost rank's sequences are recomputed from prompt + generated tokens. Restoring them
   instead would need host copies that outlive their process (shared memory per node): a host copy lives in
   its process and dies with it, so recompute is the only path built.

As built: rank 0 keeps every sequence's tokens and sends each forward's new tokens with the command, and every
decode iteration is one command (the stopping rules are decided on rank 0); a migrating sequence is released
on its source as soon as its send completed; one process keeps the plain MoE layer (no collectives); a lost
worker other than rank 0 is recovered from (backend.recover=false: the run stops with `WorkerLost` naming
it, run.DistRunFailed).

Not covered yet (refused before any process starts, or not built): tensor-parallel attention and two-batch
overlap across processes, an FFN per attention micro-batch (the offloading systems), weights streamed
from host, NCCL (the code selects it on CUDA; no GPU was
available to run it), loading only a rank's experts from a checkpoint (each rank builds the whole layer, then
keeps its shard).
"""

from batchgen.dist.comm import Comm
from batchgen.dist.ep_moe import ExpertParallelMoE
from batchgen.dist.errors import DistConfigError, WorkerLost
from batchgen.dist.failure import Heartbeat
from batchgen.dist.groups import InstanceGroup, instance_groups, instance_ranks
from batchgen.dist.launch import DistContext, DistEnv, WorkerResult, check_procs, init_distributed, launch
from batchgen.dist.placement import ExpertPlacement

__all__ = ["Comm", "DistConfigError", "DistContext", "DistEnv", "ExpertParallelMoE", "ExpertPlacement",
           "Heartbeat", "InstanceGroup", "WorkerLost", "WorkerResult", "check_procs", "init_distributed",
           "instance_groups", "instance_ranks", "launch"]
