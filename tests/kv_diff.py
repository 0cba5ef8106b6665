"""A second, independent account of a boundary's KV ops, for tests: derived by comparing where the ledger has each
sequence's KV with where the state keeps it after the decision (the way the engine derived them before the
primitives emitted them). tests/test_kv_ops.py checks that the emitted ops equal it, boundary by boundary."""

from __future__ import annotations

import numpy as np

from batchgen.core.ops import KVLedger, KVOps
from batchgen.core.sequences import FINISHED, PENDING, SUSPENDED, InvariantError

_I = np.empty(0, np.int64)


def diffed_ops(state, ledger: KVLedger, instance: int, touched: np.ndarray, fresh_ids: np.ndarray = _I,
               moved: np.ndarray = _I) -> KVOps:
    """The KV moves that take the `touched` sequences from where the ledger has their KV to where the state
    (after the decision) runs or keeps them. `fresh_ids` (prefills, first chunks) are to hold no KV before the
    run writes it (an evicted one's old KV is dropped). Derived from the ledger's view: the ops are checked
    against it again by `KVLedger.apply`, which a hand-written (or broadcast) plan goes through too.

    A PARTITIONed sequence's group changes as the state's primitives change it, in their order: MIGRATE moves the
    group to its new lead at its degree, then PARTITION changes the degree there (a reshard each); one that stops
    running leaves its group (join: dropped, or gathered into its lead's host copy when suspended).

    Migrations are carried out one at a time in plan order, so their order matters where a destination is full:
    the running sequences the state MIGRATEd (`moved`, in the order `ClusterState.move_running` carried them out,
    each arrival within the pages its destination has then) come first, in that order; then resumes on another
    GPU (they only arrive: any order fits), by id."""
    gpus = state.instance_gpus(instance)
    nodes = ledger.gpu_node[gpus]
    if not touched.size:
        return KVOps(gpus, gpu_node=nodes)
    t = state.table
    ids = np.unique(touched)
    where, tp, hosted = t.where[ids].astype(np.int64), t.tp[ids].astype(np.int64), t.host_resident[ids]
    fresh = np.isin(ids, fresh_ids) if fresh_ids.size else np.zeros(ids.size, bool)
    running = (where >= 0) & ~fresh
    gone = ((where == FINISHED) | (where == PENDING) | fresh)
    suspended = (where == SUSPENDED) & ~fresh
    want_dev = running & ~hosted
    h, dev, sp = ledger.holder[ids].copy(), ledger.on_device[ids].copy(), ledger.split[ids]
    stray = (suspended | running) & (h < 0)
    if stray.any():
        sid = int(ids[stray][0])
        raise InvariantError(f"sequence {sid} is {'suspended' if where[stray][0] == SUSPENDED else 'running'} "
                             f"(state) but its KV is {ledger.where(sid)}")
    # a partition that stops running leaves its group first: dropped (finished, evicted) or into the lead's host copy
    join = (sp > 0) & ~running
    join_lead = h[join]
    h[join & gone] = -1
    dev[join] = False
    # a partition that runs on: its group follows its lead (MIGRATE), then changes degree (PARTITION)
    regroup = (sp > 0) & running
    move = regroup & (h != where)
    drop = gone & (h >= 0)
    evicted = where != FINISHED  # dropped for a recompute (pending again, or prefilled again now)
    same = running & ((h == where) | regroup)
    restore = same & want_dev & ~dev
    offload = same & ~want_dev & dev
    migrate = running & ~same
    yields = suspended & dev
    degree = np.maximum(sp, 1)  # 1: the whole KV in the holder's pages
    change = running & (degree != tp)
    # reshards, each sequence's in order: its group's move at its degree, then its degree change at the new lead
    group_moves, changed = np.flatnonzero(move), np.flatnonzero(change)
    rows = np.concatenate([group_moves, changed])
    is_move = np.arange(rows.size) < group_moves.size
    order = np.argsort(rows, kind="stable")
    rows, is_move = rows[order], is_move[order]
    r_lead = np.where(is_move, h[rows], where[rows])
    r_to_degree = np.where(is_move, degree[rows], tp[rows])
    migrate = np.flatnonzero(migrate)
    if moved.size and migrate.size > 1:  # the state's order of its moves first (a stable sort keeps ids' order)
        sorter = np.argsort(moved)
        at = sorter[np.minimum(np.searchsorted(moved, ids[migrate], sorter=sorter), moved.size - 1)]
        key = np.where(moved[at] == ids[migrate], at, moved.size)  # its place among the moves, or after them
        migrate = migrate[np.argsort(key, kind="stable")]
    dst = where[migrate]
    src = h[migrate]
    return KVOps(
        gpus, join_ids=ids[join], join_lead=join_lead, join_degree=sp[join],
        join_to_host=suspended[join],
        free_ids=ids[drop & ~evicted], free_gpu=h[drop & ~evicted], evict_ids=ids[drop & evicted],
        evict_gpu=h[drop & evicted], yield_ids=ids[yields], yield_gpu=h[yields], offload_ids=ids[offload],
        offload_gpu=h[offload], migrate_ids=ids[migrate], migrate_src=src, migrate_dst=dst,
        migrate_cross=ledger.gpu_node[src] != ledger.gpu_node[dst], migrate_to_device=want_dev[migrate],
        migrate_host_copy=t.host_node[ids[migrate]] >= 0,
        restore_ids=ids[restore], restore_gpu=h[restore], reshard_ids=ids[rows], reshard_lead=r_lead,
        reshard_degree=degree[rows], reshard_to_lead=where[rows], reshard_to_degree=r_to_degree,
        reshard_host_copy=t.host_node[ids[rows]] >= 0, gpu_node=nodes)
