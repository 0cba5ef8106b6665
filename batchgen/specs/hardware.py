"""GPUs and clusters as plain data.

YAML files hold data-sheet units (TFLOP/s, GB, GB/s, one direction); the properties convert to SI (FLOP/s,
bytes, bytes/s) so that the latency model never multiplies by 1e9 itself. Memory capacity is the exception to
decimal units: GPU memory is sold in binary sizes (an "80 GB" A100 has 80 GiB), so capacity comes from
`memory_mib`, the total the driver reports (nvidia-smi's total, in MiB), and failing that from `hbm_gb` read as
GiB. Bandwidths stay decimal, as data sheets state them. Tensor throughputs are
dense (no 2:4 sparsity): achieved efficiency is the latency model's business, not the spec's.
`sm_count` (streaming multiprocessors) is what lets the GEMM model follow tiles and waves
(batchgen.latency.gemm); 0 means unknown, or not a GPU, and falls back to the pad-rows roofline.
"""

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from batchgen.specs.host import DEFAULT_HOST, HostSpec
from batchgen.specs.model import check_field_types, check_keys, plain_dict, require


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One GPU model and its links."""

    name: str
    bf16_tflops: float
    fp8_tflops: float = 0.0
    hbm_gb: float
    hbm_gbs: float
    # device memory as the driver reports it (nvidia-smi memory.total, MiB); 0: hbm_gb GiB
    memory_mib: float = 0.0
    pcie_gbs: float
    nvlink_gbs: float = 0.0
    network_gbs: float = 0.0
    sm_count: int = 0
    # gpu, or cpu: the "device" is the host's own cores and DRAM (the CPU executor), so host copies, CPU
    # attention and the device's compute share one set of cores and nothing overlaps
    kind: str = "gpu"

    def __post_init__(self) -> None:
        p = "hardware"
        check_field_types(self, p)
        require(self.kind in ("gpu", "cpu"), p, "kind", self.kind, "be 'gpu' or 'cpu'",
                "cpu when the device is the host's own cores (the CPU executor)")
        for name in ("bf16_tflops", "hbm_gb", "hbm_gbs", "pcie_gbs"):
            require(getattr(self, name) > 0, p, name, getattr(self, name), "be positive",
                    "copy it from the GPU's data sheet (dense tensor TFLOP/s, GB as sold, GB/s per direction)")
        require(self.fp8_tflops >= 0, p, "fp8_tflops", self.fp8_tflops, "be >= 0", "use 0 if FP8 is unsupported")
        require(self.nvlink_gbs >= 0, p, "nvlink_gbs", self.nvlink_gbs, "be >= 0",
                "use 0 for no NVLink (intra-node traffic then goes over PCIe)")
        require(self.network_gbs >= 0, p, "network_gbs", self.network_gbs, "be >= 0",
                "use 0 for no inter-node network (single-node clusters only)")
        require(self.memory_mib >= 0, p, "memory_mib", self.memory_mib, "be >= 0",
                "copy the total memory nvidia-smi reports for the GPU (MiB), or use 0 to read hbm_gb as GiB")
        require(self.sm_count >= 0, p, "sm_count", self.sm_count, "be >= 0",
                "copy the SM count from the GPU's data sheet, or use 0 when unknown (no tile model)")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HardwareSpec":
        d = plain_dict(d, "hardware")
        check_keys(d, cls, "hardware")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def flops_bf16(self) -> float:
        """bf16_tflops * 1e12 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def flops_fp8(self) -> float:
        """fp8_tflops * 1e12 FLOP/s (0 when unsupported: callers fall back to bf16)."""
        return self.fp8_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        """Device memory in bytes: memory_mib MiB where known, otherwise hbm_gb GiB (see the module's note)."""
        return self.memory_mib * 2**20 if self.memory_mib else self.hbm_gb * 2**30

    @property
    def hbm_bw(self) -> float:
        """hbm_gbs * 1e9 bytes/s."""
        return self.hbm_gbs * 1e9

    @property
    def pcie_bw(self) -> float:
        """pcie_gbs * 1e9 bytes/s, host <-> device, one direction."""
        return self.pcie_gbs * 1e9

    @property
    def nvlink_bw(self) -> float:
        """nvlink_gbs * 1e9 bytes/s per GPU, one direction; pcie_bw when the GPU has no NVLink."""
        return self.nvlink_gbs * 1e9 if self.nvlink_gbs > 0 else self.pcie_bw

    @property
    def network_bw(self) -> float:
        """network_gbs * 1e9 bytes/s per GPU, one direction, between nodes (0: no network)."""
        return self.network_gbs * 1e9


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """GPUs grouped into nodes (shared host memory, NVLink) and into expert-parallel instances.

    An instance is the unit that runs one copy of the model with its experts spread over the instance's GPUs;
    the paper ran 128 H20s as two 64-GPU instances because all-to-all cost grows with instance size.
    `host` is every node's CPUs and DRAM (a file in conf/host by name; DEFAULT_HOST when the YAML names none).
    """

    name: str
    gpu: HardwareSpec
    num_gpus: int
    gpus_per_node: int
    gpus_per_instance: int | None = None
    host_mem_gb_per_node: float
    host: HostSpec = DEFAULT_HOST

    def __post_init__(self) -> None:
        p = "cluster"
        check_field_types(self, p)
        if not isinstance(self.gpu, HardwareSpec):
            raise ValueError(f"{p}.gpu must be a HardwareSpec, got {self.gpu!r}: build a cluster from a GPU name "
                             "with batchgen.specs.catalog.cluster_from_config")
        if not isinstance(self.host, HostSpec):
            raise ValueError(f"{p}.host must be a HostSpec, got {self.host!r}: build a cluster from a host name "
                             "with batchgen.specs.catalog.cluster_from_config")
        require(self.num_gpus > 0, p, "num_gpus", self.num_gpus, "be a positive integer")
        require(self.gpus_per_node > 0, p, "gpus_per_node", self.gpus_per_node, "be a positive integer")
        require(self.gpus_per_instance is None or self.gpus_per_instance > 0, p, "gpus_per_instance",
                self.gpus_per_instance, "be a positive integer or null", "null puts all GPUs in one instance")
        require(self.host_mem_gb_per_node > 0, p, "host_mem_gb_per_node", self.host_mem_gb_per_node,
                "be positive", "host memory holds all weights and KV, e.g. 2000 for 2 TB")
        require(self.num_gpus <= self.gpus_per_node or self.num_gpus % self.gpus_per_node == 0, p, "num_gpus",
                self.num_gpus, f"be a multiple of gpus_per_node ({self.gpus_per_node}) when it spans nodes",
                "use whole nodes")
        size, node = self.instance_size, self.node_size
        require(self.num_gpus % size == 0, p, "num_gpus", self.num_gpus,
                f"be divisible by the instance size ({size})", "change cluster.gpus_per_instance")
        require(size % node == 0 or node % size == 0, p, "gpus_per_instance", self.gpus_per_instance,
                f"be a whole number of nodes ({node} GPUs each) or divide a node",
                f"e.g. {node} or {2 * node}")
        require(self.num_nodes == 1 or self.gpu.network_gbs > 0, p, "gpu", self.gpu.name,
                f"have an inter-node network (network_gbs > 0) for {self.num_nodes} nodes",
                "use one node or a GPU whose hardware file sets network_gbs")

    @property
    def node_size(self) -> int:
        """GPUs per node actually used: gpus_per_node, or num_gpus when the cluster is one partial node."""
        return min(self.gpus_per_node, self.num_gpus)

    @property
    def num_nodes(self) -> int:
        """num_gpus // gpus_per_node; 1 when num_gpus < gpus_per_node (one partial node)."""
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def instance_size(self) -> int:
        """min(gpus_per_instance or num_gpus, num_gpus): clamped, so that sweeping cluster.num_gpus=8 on a
        cluster of 64-GPU instances gives one 8-GPU instance instead of an error."""
        return min(self.gpus_per_instance or self.num_gpus, self.num_gpus)

    @property
    def num_instances(self) -> int:
        """num_gpus // instance_size."""
        return self.num_gpus // self.instance_size

    @property
    def host_mem_bytes_per_node(self) -> float:
        """host_mem_gb_per_node * 1e9 bytes."""
        return self.host_mem_gb_per_node * 1e9

    def _check_index(self, gpu_index: int) -> None:
        if not (_is_index(gpu_index) and 0 <= gpu_index < self.num_gpus):
            raise ValueError(f"GPU index must be an integer in [0, {self.num_gpus}), got {gpu_index!r}")

    def node_of(self, gpu_index: int) -> int:
        """gpu_index // node_size: GPUs are numbered node by node."""
        self._check_index(gpu_index)
        return gpu_index // self.node_size

    def instance_of(self, gpu_index: int) -> int:
        """gpu_index // instance_size: instances are contiguous ranges of GPUs."""
        self._check_index(gpu_index)
        return gpu_index // self.instance_size


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
