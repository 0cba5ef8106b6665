"""The order in which a boundary's MIGRATEs of running sequences can be carried out one at a time.

The executors move one sequence's KV at a time, in plan order (a migration lands in the destination's pages
before its source lets go of its own: two caches, or two processes), so a destination must have room for each
arrival on top of what it holds at that moment. A set of moves whose end state fits may still not fit on the way:
two full GPUs that swap sequences. `one_at_a_time` finds an order in which every arrival fits (the state performs
the moves in it and the plan lists them so, `ClusterState.move_running`), and a policy asks it before proposing
moves (batchgen.policy.coroutine), so that it never asks for moves the executors cannot carry out.
"""

from __future__ import annotations

import numpy as np

from batchgen.core.sequences import InvariantError

# a move: (places it leaves, what it frees at each, places it arrives at, what it takes at each); a place is an
# index into `used` and `capacity` (a GPU's pages, a node's host KV tokens: whatever the caller counts)
Move = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def one_at_a_time(used: np.ndarray, capacity: np.ndarray, moves: list[Move]) -> list[int]:
    """Indices of `moves` in an order in which each can be carried out after the ones before it, every place it
    arrives at within capacity once it has left its own; moves that cannot be carried out in this order are
    left out (a cycle of moves between places too full to take an arrival first).

    Passes over the moves in the given order: a move that fits is carried out, one that does not waits for the
    next pass (the moves out of its destination may make room). Deterministic, and no more work than one pass
    where every move fits at once (the usual case). Greedy: it may miss an order that carries out everything
    where an early arrival takes the room a later one needed; a caller then refuses the moves, or does not
    propose them."""
    used = np.array(used, np.int64)
    capacity = np.asarray(capacity, np.int64)
    pending = list(range(len(moves)))
    order: list[int] = []
    while pending:
        waiting = []
        for i in pending:
            leave_at, frees, arrive_at, takes = moves[i]
            np.subtract.at(used, leave_at, frees)
            np.add.at(used, arrive_at, takes)
            if np.all(used[arrive_at] <= capacity[arrive_at]):
                order.append(i)
            else:  # not now: back as it was
                np.subtract.at(used, arrive_at, takes)
                np.add.at(used, leave_at, frees)
                waiting.append(i)
        if len(waiting) == len(pending):
            break
        pending = waiting
    return order


def carried_out_in(state, ids: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """Indices of a state's MIGRATEs (ids to gpus) in an order they can be carried out one at a time: each leaves its
    GPUs (a PARTITIONed one its group's) and arrives on the new ones with the same pages; a host copy that
    crosses nodes leaves one node's host memory for the other's. The given order where every arrival fits
    before any move leaves (the usual case)."""
    t, topo = state.table, state.topo
    G = topo.num_gpus
    pages = t.pages[ids].astype(np.int64)  # what each leaves: a shared prefix's pages stay (core.prefix_pages)
    whole = pages + (state.prefix_held[ids] // state.page_tokens if state.sharing else 0)  # what arrives
    node = topo.gpu_node
    src = t.where[ids]
    carried = (t.host_node[ids] >= 0) & (node[src] != node[gpus])  # a host copy that crosses nodes
    host = np.where(carried, t.context(ids), 0)  # arrives whole; leaves its own (core.host_prefixes)
    host_own = host - (np.where(carried, state.host_held[ids], 0) if state.host_sharing else 0)
    tp = t.tp[ids].astype(np.int64)
    used = np.concatenate([state.pages_used, state.host_used])
    capacity = np.concatenate([state.gpu_pages, state.host_kv_tokens])
    if not (tp > 1).any():  # each move arrives on one GPU: every arrival at once, before any move leaves
        ahead = used + np.bincount(np.concatenate([gpus, G + node[gpus]]), np.concatenate([whole, host]),
                                   used.size).astype(np.int64)
        if np.all(ahead <= capacity):
            return np.arange(ids.size)
    plan = []
    for i in range(ids.size):
        leave = np.array(state.group_of(int(src[i]), int(tp[i])), np.int64)
        arrive = np.array(state.group_of(int(gpus[i]), int(tp[i])), np.int64)
        frees, takes = np.full(leave.size, pages[i]), np.full(arrive.size, whole[i])
        if carried[i]:
            leave, arrive = np.append(leave, G + node[src[i]]), np.append(arrive, G + node[gpus[i]])
            frees, takes = np.append(frees, host_own[i]), np.append(takes, host[i])
        plan.append((leave, frees, arrive, takes))
    order = np.array(one_at_a_time(used, capacity, plan), np.int64)
    if order.size < ids.size:
        left = np.setdiff1d(np.arange(ids.size), order)
        raise InvariantError(
            f"sequences {ids[left][:5].tolist()} cannot MIGRATE to GPUs {gpus[left][:5].tolist()}: the "
            "executors move one sequence's KV at a time, and no order of this boundary's moves gives each "
            "destination room for its arrival (device pages, or host memory for a host copy) before the "
            "moves out of it leave; move fewer at once")
    return order
