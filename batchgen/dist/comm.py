"""A process group's point-to-point and collective operations, each waited under the failure detector and
timed.

Waiting must never break the operation it waits for; between checks the heartbeat is asked whether one of the
group's peers is lost, so a dead peer becomes `WorkerLost(rank)` within seconds whoever the operation was waiting
on, while a slow peer is simply waited for (up to the group's own collective timeout, init_distributed's
timeout_s). How each kind is waited:

- gloo collectives: `Work.wait(timeout)` in slices. An expired slice raises "Operation timed out!" and leaves the
  collective running on gloo's worker thread (resumable: checked with a peer 1.5 s late and 200 ms slices).
- gloo send and receive: never a timed wait. gloo passes the timeout into the transfer itself and closes the
  pair when it expires ("Timed out waiting 200ms for send operation to complete", then "Application timeout
  caused pair closure" on every later use, and "Connection closed by peer" on the other side): a slice that
  expired under load broke the very connection it polled, and both ends declared the other lost.
  So a helper thread waits with the group's long timeout while this thread asks the heartbeat every slice.
- NCCL: `is_completed` is polled (a timed-out wait may abort the communicator), then waited.

Without a heartbeat the group's own collective timeout is the bound.

`comm_s` adds up the wall time spent inside operations, waiting for slower peers included: the
communication-and-wait share of a step, for per-rank busy/communication/idle accounting.

Overlap (`start_all_to_all_single`, then `wait`): the operation is issued and runs in the background (gloo: on
the group's worker thread; NCCL: on its stream) while the caller computes; `comm_s` counts the time spent
issuing it and the time spent in `wait` (the part the computation did not hide, waiting for a slower peer
included), not the computation in between, which is busy time. One `calls` per operation, when waited.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from batchgen.dist.errors import WorkerLost
from batchgen.dist.failure import Heartbeat

_SLICE_TIMEOUT = "Operation timed out!"  # Work.wait(timeout) expiring; the operation goes on
_GLOO_TIMEOUT = "Timed out waiting"  # gloo giving up after the group's collective timeout


@dataclass
class Pending:
    """An operation issued and not waited yet (`Comm.start_all_to_all_single`): what `Comm.wait` needs to wait
    for it under the failure detector and to account its time."""
    work: Any  # the torch.distributed Work
    what: str
    peers: list[int]
    issue_s: float  # seconds spent issuing it (communication time, added when it is waited)
    done: bool = False


class Comm:
    def __init__(self, group: dist.ProcessGroup | None = None, heartbeat: Heartbeat | None = None,
                 slice_s: float | None = None):
        self.group = dist.group.WORLD if group is None else group
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(self.group))
        self.rank = dist.get_rank(self.group)  # within the group
        self.size = len(self.ranks)
        self.heartbeat = heartbeat
        slice_s = slice_s if slice_s is not None else (heartbeat.interval_s if heartbeat is not None else 1.0)
        self._slice = datetime.timedelta(seconds=slice_s)
        self._poll = dist.get_backend(self.group) == "nccl"
        self.comm_s = 0.0
        self.calls = 0

    # ---- operations (ranks are group-local) ---------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, what: str = "all-to-all") -> None:
        self.wait(self.start_all_to_all_single(output, input, output_split_sizes, input_split_sizes, what))

    def start_all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                                output_split_sizes: Sequence[int] | None = None,
                                input_split_sizes: Sequence[int] | None = None,
                                what: str = "all-to-all") -> Pending:
        """Issue an all-to-all and return at once; `output` is filled (and `input` may be reused) only after
        `wait` returns. Every rank of the group must issue the group's operations in the same order."""
        t0 = time.perf_counter()
        work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=self.group,
                                      async_op=True)
        return Pending(work, what, self._peers(), time.perf_counter() - t0)

    def wait(self, pending: Pending) -> None:
        """Wait for an operation `start_*` issued (under the failure detector, in slices); its issue time and the
        time spent here count as communication."""
        if pending.done:
            raise RuntimeError(f"{pending.what}: waited twice")
        pending.done = True
        self.comm_s += pending.issue_s
        self._wait(pending.work, pending.what, pending.peers, time.perf_counter())

    def send(self, tensor: torch.Tensor, dst: int, what: str = "send") -> None:
        t0 = time.perf_counter()
        work = dist.isend(tensor, dst=self.ranks[dst], group=self.group)
        self._wait(work, what, [self.ranks[dst]], t0, p2p=True)

    def recv(self, tensor: torch.Tensor, src: int, what: str = "recv") -> None:
        t0 = time.perf_counter()
        work = dist.irecv(tensor, src=self.ranks[src], group=self.group)
        self._wait(work, what, [self.ranks[src]], t0, p2p=True)

    def all_reduce(self, tensor: torch.Tensor, what: str = "all-reduce", op=dist.ReduceOp.SUM) -> None:
        t0 = time.perf_counter()
        self._wait(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), what, self._peers(), t0)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str = "broadcast") -> None:
        """src: a group-local rank."""
        t0 = time.perf_counter()
        work = dist.broadcast(tensor, src=self.ranks[src], group=self.group, async_op=True)
        self._wait(work, what, self._peers() if self.rank == src else [self.ranks[src]], t0)

    def barrier(self, what: str = "barrier") -> None:
        t0 = time.perf_counter()
        self._wait(dist.barrier(group=self.group, async_op=True), what, self._peers(), t0)

    # ---- waiting ---------------------------------------------------------------------------------------
    def _peers(self) -> list[int]:
        me = self.ranks[self.rank]
        return [r for r in self.ranks if r != me]

    def _wait(self, work, what: str, peers: list[int], t0: float, p2p: bool = False) -> None:
        try:
            if self._poll:
                self._poll_until_done(work, what, peers)
                return
            if p2p:
                self._wait_aside(work, what, peers)
                return
            while True:
                try:
                    work.wait(timeout=self._slice)
                    return
                except RuntimeError as e:
                    if _SLICE_TIMEOUT not in str(e):
                        raise self._lost_from_error(e, what, peers) from e
                    self._check_lost(what, peers)
        finally:
            self.comm_s += time.perf_counter() - t0
            self.calls += 1

    def _wait_aside(self, work, what: str, peers: list[int]) -> None:
        """gloo send or receive: waited whole (the group's timeout) on a helper thread, never in timed slices,
        which would close the pair; this thread asks the heartbeat every slice. After a WorkerLost the helper
        stays blocked until gloo fails the transfer (the dead peer's socket closes, or a fenced one's) or the
        group's timeout: the group is retired with its generation, so nothing waits for the helper."""
        done = threading.Event()
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 (handed to the waiting thread)
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=wait, name=f"wait {what}", daemon=True).start()
        while not done.wait(self._slice.total_seconds()):
            self._check_lost(what, peers)
        if failed:
            e = failed[0]
            if not isinstance(e, RuntimeError):
                raise e
            raise self._lost_from_error(e, what, peers) from e

    def _poll_until_done(self, work, what: str, peers: list[int]) -> None:
        """NCCL: a timed-out `Work.wait(timeout)` may abort the communicator, so poll `is_completed` (a CUDA
        event query) instead, asking the heartbeat every slice; then wait, which surfaces errors. Not run yet:
        no GPU was available when this was written."""
        next_check = time.monotonic() + self._slice.total_seconds()
        while not work.is_completed():
            if self.heartbeat is not None and time.monotonic() >= next_check:
                self._check_lost(what, peers)
                next_check = time.monotonic() + self._slice.total_seconds()
            time.sleep(20e-6)
        try:
            work.wait()
        except RuntimeError as e:
            raise self._lost_from_error(e, what, peers) from e

    def _check_lost(self, what: str, peers: list[int]) -> None:
        """Between wait slices: a lost peer of this operation first, else any lost member of the group, else any
        lost process of the run. A group that lost a member cannot finish its next collective anyway, and an
        operation between two survivors (a broadcast the source will never send, or an all-to-all of another
        instance that rank 0 abandoned, because it is busy recovering) would otherwise wait for the group's
        whole timeout."""
        if self.heartbeat is None:
            return
        lost = self.heartbeat.lost(peers) or self.heartbeat.lost(self._peers()) or self.heartbeat.lost()
        if lost:
            raise WorkerLost(lost[0], f"{self.heartbeat.cause(lost[0])}, during {what}") from None

    def _lost_from_error(self, e: RuntimeError, what: str, peers: list[int]) -> WorkerLost:
        """gloo failed the operation. Name the peer the heartbeat finds lost (after a closed socket, wait for its
        process to be gone or its heartbeat silent). After gloo's own timeout (the group's long one, the bound on
        a peer that beats but never takes part), the one peer of a two-process operation, the only one it could
        have waited for. Otherwise nobody: a peer that keeps beating is slow, not lost."""
        first = str(e).strip().splitlines()[0][:300]
        rank = None
        if self.heartbeat is not None:
            lost = self.heartbeat.lost(peers) or self.heartbeat.lost()
            rank = lost[0] if lost else None if _GLOO_TIMEOUT in first else self.heartbeat.wait_for_loss(peers)
        if rank is None and len(peers) == 1 and (self.heartbeat is None or _GLOO_TIMEOUT in first):
            rank = peers[0]
        return WorkerLost(rank, f"{what} failed: {first}")
