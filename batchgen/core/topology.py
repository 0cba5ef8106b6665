"""Which node and which expert-parallel instance each GPU belongs to."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Topology:
    """Which node and which expert-parallel instance each GPU belongs to."""

    gpu_node: np.ndarray      # node of each global GPU index
    gpu_instance: np.ndarray  # instance of each global GPU index
    num_nodes: int
    num_instances: int

    @property
    def gpu_rank(self) -> np.ndarray:
        """Rank of each GPU within its instance (GPUs of an instance in increasing order)."""
        rank = np.empty(self.gpu_instance.size, np.int64)
        for inst in range(self.num_instances):
            gpus = self.instance_gpus(inst)
            rank[gpus] = np.arange(gpus.size)
        return rank

    @property
    def num_gpus(self) -> int:
        return self.gpu_node.size

    def instance_gpus(self, instance: int) -> np.ndarray:
        return np.flatnonzero(self.gpu_instance == instance)


def node_instance(topo: Topology) -> np.ndarray:
    """The instance whose GPUs fill each node, or -1 where the node's GPUs serve several instances."""
    owner = np.full(topo.num_nodes, -1, np.int64)
    owner[topo.gpu_node] = topo.gpu_instance
    shared = np.bincount(topo.gpu_node, minlength=topo.num_nodes) != np.bincount(
        topo.gpu_node, weights=(topo.gpu_instance == owner[topo.gpu_node]), minlength=topo.num_nodes)
    owner[shared] = -1
    return owner
