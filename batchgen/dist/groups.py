"""Instances as process groups: the world's ranks split into consecutive blocks, one group per instance, so
that instances of a cluster run concurrently, each with its own collectives (its all-to-alls never wait for
another instance's ranks)."""

from __future__ import annotations

from dataclasses import dataclass
import datetime

import torch.distributed as dist

from batchgen.dist.errors import DistConfigError

# Process groups (and the workers holding them) of a recovery's earlier generations, kept until the process
# ends. A step abandoned on a loss can leave gloo's worker thread inside a collective whose peer never posts its
# half (rank 0 stopped between two all-to-alls of a forward that rank 1 went on with): freeing that group joins
# the thread, which waits for the collective's whole timeout, and the survivor stalled that long (60 s of a 62 s
# test). A process that retired any ends with os._exit (launch._worker), which runs no destructor.
_RETIRED: list = []


def retire(*objects) -> None:
    """Keep `objects` (a previous generation's groups, or a worker holding them) alive until the process ends."""
    _RETIRED.extend(objects)


def retired() -> bool:
    return bool(_RETIRED)


def instance_ranks(world_size: int, sizes: list[int]) -> list[tuple[int, ...]]:
    """Consecutive blocks of ranks, one per instance: sizes [2, 2] over 4 ranks -> [(0, 1), (2, 3)]."""
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise DistConfigError(f"every instance needs at least one process, got instance sizes {sizes}")
    if sum(sizes) != world_size:
        raise DistConfigError(f"instances of {sizes} processes need {sum(sizes)} processes in all, but the world "
                              f"has {world_size}: start {sum(sizes)} processes or change the cluster")
    out, start = [], 0
    for n in sizes:
        out.append(tuple(range(start, start + n)))
        start += n
    return out


@dataclass(frozen=True)
class InstanceGroup:
    """This process's instance: its index, its ranks (global) and the process group they share."""

    index: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return len(self.ranks)

    def local_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


def instance_groups(sizes: list[int], timeout_s: float | None = None) -> InstanceGroup:
    """Create one process group per instance and return this process's. Every process of the world must call
    it with the same sizes (torch creates groups collectively, in the same order everywhere)."""
    blocks = instance_ranks(dist.get_world_size(), sizes)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    me, mine = dist.get_rank(), None
    for i, ranks in enumerate(blocks):
        group = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            mine = InstanceGroup(i, ranks, group)
    assert mine is not None  # the blocks cover the world
    return mine


def control_groups(sizes: list[int], timeout_s: float | None = None) -> list[tuple[dist.ProcessGroup, dist.ProcessGroup]
                                                                          | None]:
    """Per instance, two gloo groups of rank 0 and the instance's ranks: one for rank 0's commands (broadcast
    from rank 0), one for the replies (gathered on rank 0); None where this process is not a member (rank 0 is in
    every one). Collectives, not point to point: a gloo send or receive waited in slices (so that the heartbeat
    is asked in between) closes its connection when a slice expires, while a collective goes on; and a worker
    waits for its next command, or for rank 0 to collect its reply, as long as the other instances' forwards take.
    Two groups, so that a command rank 0 posts to an instance before collecting its last reply (a migration from
    another instance) cannot be matched with that reply. Every process must call it with the same sizes."""
    blocks = instance_ranks(dist.get_world_size(), sizes)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    me, out = dist.get_rank(), []
    for ranks in blocks:
        members = sorted({0, *ranks})
        commands = dist.new_group(members, timeout=timeout, backend="gloo")
        replies = dist.new_group(members, timeout=timeout, backend="gloo")
        out.append((commands, replies) if me in members else None)
    return out
