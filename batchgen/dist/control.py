"""The control channel of a `backend=dist` run: commands addressed to the instances that execute them, posted by
rank 0 without waiting and collected later, so that the instances of a cluster run concurrently.

Why post and collect are apart: rank 0 runs every instance's engine loop in one thread (`Engine.run_in_turn`).
A forward is posted to its instance's processes, then the loop yields, and the next instance's loop posts its
own forward before anyone waits for a reply: each instance's processes compute at the same time, each over its
own process group (`groups.instance_groups`). Rank 0 is a worker of instance 0 as well; its own share of a
command is queued here and run when the command is collected (after the other instances' forwards went out).

The wire: per instance, a command group and a reply group, both of rank 0 and the instance's ranks
(`groups.control_groups`). A command is broadcast from rank 0 (its length, then its pickled bytes; rank 0
issues both asynchronously and does not wait); a reply (forward, stop) is gathered on rank 0 (lengths with an
all-gather, then the padded bytes). Collectives rather than point to point, because gloo closes a pair whose
send or receive is waited in slices that expire, and a worker may wait for its next command (or for rank 0 to
collect its reply) for as long as another instance's forward takes.

Why it cannot deadlock: every process executes the commands addressed to it in the order rank 0 posted them
(one command group per instance, broadcasts in order), rank 0 included (`_queue` is drained in posting order,
and before any reply is awaited). Every blocking operation inside a command (an all-to-all of the instance's
group, a migration's send and receive) pairs up with the same command on its peers; by induction over the
posting order, every command completes.

A command that names GPUs of two instances (a migration of a sequence one instance yielded and another resumes on
a shared node) goes to both instances, as one ordered step. Before it is posted, rank 0 collects any forward
still open on those instances (`quiesce`), so both ends of the migration are waiting for a command when it
arrives and meet at once (the KV goes point to point, where a long wait would break the pair).
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist

from batchgen.dist.comm import Comm

if TYPE_CHECKING:
    from batchgen.dist.worker import Command, RankWorker

REPLY_KINDS = ("forward", "stop")  # the commands each addressed rank answers (rank 0 collects the replies)


# ---- the wire, both sides ---------------------------------------------------------------------------------------
def _wait(comm: Comm, work, what: str) -> None:
    """A collective waited in slices under the heartbeat (Comm's own waiting, for operations Comm has no
    method for)."""
    comm._wait(work, what, comm._peers(), time.perf_counter())


def receive_command(commands: Comm) -> Any:
    """A worker: the next command rank 0 broadcast to its instance."""
    size = torch.empty(1, dtype=torch.int64)
    commands.broadcast(size, 0, what="command length")
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    commands.broadcast(data, 0, what="command")
    return pickle.loads(data.numpy().tobytes())


def broadcast_command(commands: Comm, cmd: Any) -> None:
    """Rank 0, waiting until every member has it (`receive_command`): for exchanges outside the run's posting
    order, such as a recovery's, when nothing else is in flight."""
    data = torch.frombuffer(bytearray(pickle.dumps(cmd)), dtype=torch.uint8)
    commands.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0, what="command length")
    commands.broadcast(data, 0, what="command")


def send_reply(replies: Comm, value: Any) -> None:
    """A worker: its reply, gathered on rank 0 (`gather_replies`)."""
    _gather(replies, pickle.dumps(value))


def gather_replies(replies: Comm) -> dict[int, Any]:
    """Rank 0: every other member's reply, by global rank."""
    payloads = _gather(replies, b"")
    return {r: pickle.loads(p) for r, p in zip(replies.ranks, payloads) if r != 0}


def _gather(comm: Comm, payload: bytes) -> list[bytes] | None:
    n = comm.size
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(n)]
    work = dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=comm.group, async_op=True)
    _wait(comm, work, "reply lengths")
    lengths = [int(s.item()) for s in sizes]
    width = max(max(lengths), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    root = comm.rank == 0
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(n)] if root else None
    work = dist.gather(mine, out, dst=comm.ranks[0], group=comm.group, async_op=True)
    _wait(comm, work, "replies")
    if not root:
        return None
    return [t[:k].numpy().tobytes() for t, k in zip(out, lengths)]


# ---- rank 0 ---------------------------------------------------------------------------------------------------
@dataclass
class Ticket:
    """A posted command: its place in the posting order, the instances it went to, rank 0's own result, and the
    replies once collected."""

    seq: int
    kind: str
    instances: tuple[int, ...]
    mine: Any = None
    replies: list | None = None


@dataclass
class _Outgoing:
    work: Any
    comm: Comm
    what: str
    keep: list = field(default_factory=list)  # the tensors being broadcast live until the broadcast completed


class CommandChannel:
    """On rank 0: `post(cmd, instances)` sends `cmd` to those instances' processes (rank 0's share, as a worker
    of instance 0, queued; or run at once when the command has no reply), `collect(ticket)` runs rank 0's
    queued shares up to it and returns every addressed rank's reply, in rank order."""

    def __init__(self, worker: "RankWorker", commands: list[Comm], replies: list[Comm],
                 instance_ranks: list[tuple[int, ...]]):
        if worker.rank != 0:
            raise ValueError("the command channel is rank 0's: the other ranks receive (RankWorker.serve)")
        if not (len(commands) == len(replies) == len(instance_ranks)) or 0 not in instance_ranks[0]:
            raise ValueError("one command and one reply group per instance; rank 0 belongs to instance 0")
        self.worker, self.commands, self.replies, self.instance_ranks = worker, commands, replies, instance_ranks
        self._seq = 0
        self._queue: deque[tuple["Command", Ticket]] = deque()  # rank 0's own shares, in posting order
        self._outgoing: list[_Outgoing] = []
        self._open: dict[int, Ticket] = {}  # per instance: a posted command whose replies are not collected yet

    def post(self, cmd: "Command", instances: Iterable[int]) -> Ticket:
        instances = tuple(sorted(set(int(i) for i in instances)))
        if cmd.kind in REPLY_KINDS and any(i in self._open for i in instances):
            raise RuntimeError(f"instance(s) {[i for i in instances if i in self._open]} still owe the replies of "
                               f"a command: collect it before posting a {cmd.kind}")
        self._seq += 1
        ticket = Ticket(self._seq, cmd.kind, instances)
        self._send(cmd, instances)
        if cmd.kind in REPLY_KINDS:
            self._open.update({i: ticket for i in instances})
        if 0 in instances:
            self._queue.append((cmd, ticket))
            if cmd.kind not in REPLY_KINDS:
                self.drain(ticket)  # KV ops, host copies: done now (earlier queued shares first)
        self._reap()
        return ticket

    def quiesce(self, instances: Iterable[int]) -> None:
        """Collect now whatever those instances still owe (the replies wait in their tickets): afterwards their
        processes wait for a command."""
        for i in sorted(set(instances)):
            if i in self._open:
                self.collect(self._open[i])

    def drain(self, upto: Ticket | None = None) -> None:
        """Run rank 0's queued shares in posting order, up to `upto` (all without it)."""
        while self._queue and (upto is None or self._queue[0][1].seq <= upto.seq):
            cmd, ticket = self._queue.popleft()
            ticket.mine = self.worker.handle(cmd)

    def collect(self, ticket: Ticket) -> list:
        """Every addressed rank's reply to `ticket`'s command (a forward or stop), in rank order."""
        if ticket.kind not in REPLY_KINDS:
            raise ValueError(f"a {ticket.kind} command has no reply to collect")
        if ticket.replies is None:
            self.drain(ticket)
            replies = []
            for i in ticket.instances:
                got = gather_replies(self.replies[i]) if self.replies[i].size > 1 else {}
                replies += [ticket.mine if r == 0 else got[r] for r in self.instance_ranks[i]]
                del self._open[i]
            ticket.replies = replies
            self._reap()
        return ticket.replies

    def abort(self, cmd: "Command") -> None:
        """Every worker leaves its loop (rank 0 failed): sent to every instance, rank 0's share not run. The
        replies other instances still owe are taken first (their forwards need no rank 0), so that their
        workers reach the abort instead of waiting for rank 0 until its heartbeat stops (and the run's error
        would name the lost rank 0 instead of what failed)."""
        for i, ticket in sorted(self._open.items()):
            if 0 not in self.instance_ranks[i] and self.replies[i].size > 1:
                gather_replies(self.replies[i])
        self._open.clear()
        self._queue.clear()
        self._send(cmd, range(len(self.commands)))
        self.finish_sends()

    def finish_sends(self) -> None:
        """Wait for every posted command to have left (the end of the run)."""
        while self._outgoing:
            o = self._outgoing.pop(0)
            _wait(o.comm, o.work, o.what)

    # ---- broadcasts on the command groups ---------------------------------------------------------------------
    def _send(self, cmd: "Command", instances: Iterable[int]) -> None:
        targets = [i for i in instances if self.commands[i].size > 1]  # instance 0 of one process: rank 0 only
        if not targets:
            return
        data = torch.frombuffer(bytearray(pickle.dumps(cmd)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for i in targets:
            comm = self.commands[i]
            for tensor, what in ((size, f"{cmd.kind} command length"), (data, f"{cmd.kind} command")):
                work = dist.broadcast(tensor, src=0, group=comm.group, async_op=True)
                self._outgoing.append(_Outgoing(work, comm, what, [tensor]))

    def _reap(self) -> None:
        """Forget the broadcasts that completed (their receivers have the command)."""
        self._outgoing = [o for o in self._outgoing if not o.work.is_completed()]
