"""What a policy sees at a boundary: a read-only snapshot of its instance, built from the state."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchgen.core.state import ClusterState
from batchgen.engine.plan import filled
from batchgen.policy.base import Capabilities, Lengths, Phase, Snapshot


@dataclass
class InstanceProgress:
    """Per-instance state that is not per-sequence: static padding rows, the last phase, and what the policy's
    last decision carries to its next one."""

    num_ranks: int
    last_phase: Phase = "idle"
    carry: Any = None
    pad_rows: np.ndarray = field(init=False)
    pad_context: np.ndarray = field(init=False)
    padding: bool = False  # pad_rows may hold rows (False: both are zeros, which a plan may share read-only)
    views: Any = None      # the state's _SharedViews, as the last snapshot found them

    def __post_init__(self):
        self.pad_rows = np.zeros(self.num_ranks, np.int64)
        self.pad_context = np.zeros(self.num_ranks, np.int64)
        self._zeros = np.zeros(self.num_ranks, np.int64)
        self._zeros.flags.writeable = False

    def pads(self) -> tuple[np.ndarray, np.ndarray]:
        """(pad_rows, pad_context) for a snapshot or a plan: copies, or one shared read-only zeros array."""
        if self.padding:
            return self.pad_rows.copy(), self.pad_context.copy()
        return self._zeros, self._zeros


class _ReadOnlyPool:
    """What a policy may do with a pool: count it and look at its head."""

    __slots__ = ("_queue",)

    def __init__(self, queue):
        self._queue = queue

    def __len__(self) -> int:
        return len(self._queue)

    def peek(self, n: int) -> np.ndarray:
        return _frozen(self._queue.peek(n))


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view: a policy that writes into the state's arrays fails at the write, not much later."""
    view = a.view()
    view.flags.writeable = False
    return view


class _SharedViews:
    """The parts of a state's snapshots that are the same at every boundary, built once: read-only views of its
    pools and of its length columns, and each instance's GPUs' nodes, the nodes' owners and the GPUs' KV capacities
    (neither the topology nor the capacities change). Built again if the state's table, pool lists or capacities
    are replaced (recovery swaps them)."""

    def __init__(self, state: ClusterState):
        t, topo = state.table, state.topo
        self.sources = (state.table, state.pending, state.pinned, state.suspended, state.gpu_pages)
        self.pending = [_ReadOnlyPool(q) for q in state.pending]
        self.pinned = [_ReadOnlyPool(q) for q in state.pinned]  # per global GPU
        self.suspended = [_ReadOnlyPool(q) for q in state.suspended]
        self.lengths = Lengths(_frozen(t.input_len), _frozen(t.decoded))
        self.node_instance = _frozen(state.node_instance)
        self.rank_node = [_frozen(topo.gpu_node[state.instance_gpus(i)]) for i in range(topo.num_instances)]
        self.one_gpu = [state.instance_gpus(i).size == 1 for i in range(topo.num_instances)]
        # KV pages per rank: capacities, set when the state is built and never changed
        self.pages_capacity = [_frozen(state.gpu_pages[state.instance_gpus(i)]) for i in range(topo.num_instances)]
        self.instance_pinned = [[self.pinned[g] for g in state.instance_gpus(i)] for i in range(topo.num_instances)]

    def current(self, state: ClusterState) -> bool:
        table, pending, pinned, suspended, gpu_pages = self.sources
        return (table is state.table and pending is state.pending and pinned is state.pinned
                and suspended is state.suspended and gpu_pages is state.gpu_pages)

    @classmethod
    def of(cls, state: ClusterState) -> "_SharedViews":
        views = _VIEWS.get(state)
        if views is None:
            views = _VIEWS[state] = cls(state)
        if not views.current(state):
            views = _VIEWS[state] = cls(state)
        return views


_VIEWS: "weakref.WeakKeyDictionary[ClusterState, _SharedViews]" = weakref.WeakKeyDictionary()


def tp_and_hosted(state: ClusterState, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running sequences' partition degrees and host-residency flags; shared constants where the state has no
    partition and no host copy (`ClusterState.check` verifies the flags it reads)."""
    t = state.table
    tp = t.tp[ids] if state.partitioned_ever else filled(ids.size, 1, t.tp.dtype)
    hosted = t.host_resident[ids] if state.has_host_copies() else filled(ids.size, False, t.host_resident.dtype)
    return tp, hosted


class _StatePrefixes:
    """`PrefixView` of a state's prefix cache, for one instance's ranks."""

    __slots__ = ("_state", "_gpus")

    def __init__(self, state: ClusterState, gpus: np.ndarray):
        self._state, self._gpus = state, gpus

    def group(self, ids: np.ndarray) -> np.ndarray:
        return self._state.prefix_group[ids]

    def shared_tokens(self, ids: np.ndarray) -> np.ndarray:
        return self._state.share_tokens(ids)

    def shared_span(self, ids: np.ndarray) -> np.ndarray:
        return self._state.share_span(ids)

    def levels(self, ids: np.ndarray) -> list[list[tuple[int, int]]]:
        state = self._state
        return [state.prefix_levels(sid, c) for sid, c in zip(ids.tolist(), state.table.context(ids).tolist())]

    def on_ranks(self) -> dict[tuple[int, int], tuple[int, int]]:
        return self._state.prefixes_on(self._gpus)

    @property
    def fetches(self) -> bool:
        return self._state.fetch

    @property
    def resumes_anywhere(self) -> bool:
        return self._state.resume_anywhere

    def restore_shares(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._state.restore_shares(ids, self._gpus)

    def host_held(self, ids: np.ndarray) -> np.ndarray:
        return self._state.host_held[ids] if self._state.host_sharing else np.zeros(ids.size, np.int64)

    def host_skips(self, ids: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        return self._state.host_skips(ids, nodes)


def make_snapshot(state: ClusterState, instance: int, now: float, progress: InstanceProgress,
                  gpus_per_node: int, capabilities: Capabilities = Capabilities()) -> Snapshot:
    t = state.table
    gpus = state.instance_gpus(instance)  # read-only, shared
    ids = state.active[instance]
    views = progress.views
    if views is None or not views.current(state):
        views = progress.views = _SharedViews.of(state)
    tp, hosted = tp_and_hosted(state, ids)
    decoded = t.decoded[ids]  # read once: the context is the prompt plus it (Lengths.context)
    # indexing with an id array already copies: the snapshot's per-sequence arrays are the policy's own (but the
    # shared read-only ones: views of the state, and columns of one value, such as degree 1 when nothing is
    # partitioned)
    return Snapshot(
        now=now, instance=instance, page_tokens=state.page_tokens, gpus=gpus,
        rank_node=views.rank_node[instance], pages_used=state.pages_used[gpus],
        # shared prefixes' pages are the GPU's, not any sequence's: `active_shared` says what each holds of them
        pages_capacity=(views.pages_capacity[instance] if not state.sharing or not state.prefix_pages.any()
                        else views.pages_capacity[instance] - state.prefix_pages[gpus]),
        pad_rows=progress.pads()[0],
        active_ids=_frozen(ids), active_context=t.input_len[ids] + decoded,
        # every running sequence of a one-GPU instance is on its rank 0
        active_rank=np.zeros(ids.size, np.int64) if views.one_gpu[instance]
        else state.gpu_rank[t.where[ids]],
        active_decoded=decoded, active_pages=t.pages[ids], active_tp=tp, active_host_resident=hosted,
        pending=views.pending[instance], pinned=views.instance_pinned[instance], suspended=views.suspended,
        node_instance=views.node_instance, host_capacity_tokens=state.host_kv_tokens,
        host_used_tokens=state.host_committed(except_instance=instance),
        lengths=views.lengths, last_phase=progress.last_phase, gpus_per_node=gpus_per_node,
        capabilities=capabilities, active_prefilled=t.prefilled[ids], carry=progress.carry,
        **({"prefixes": _StatePrefixes(state, gpus), "active_shared": state.prefix_held[ids]} if state.sharing else {}),
    )
