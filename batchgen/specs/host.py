"""The host side of a node: CPU sockets, cores, DRAM bandwidth and FLOP/s, as plain data.

Host memory *capacity* stays on the cluster (`host_mem_gb_per_node`); this spec holds what moves or computes
next to it: the DRAM bandwidth that every PCIe copy of a node's GPUs reads from or writes to, and the CPU that
can run attention beside host-resident KV (MoE-Gen, MoE-Lightning). YAML files hold data-sheet units (GB/s,
TFLOP/s, per socket); the properties give node totals in SI units. Achieved fractions are the latency model's
business (`Efficiency.host_memory`, `Efficiency.host_compute`).
"""

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from batchgen.specs.model import check_field_types, check_keys, plain_dict, require


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """The CPUs and DRAM of one node."""

    name: str
    sockets: int
    cores_per_socket: int
    dram_gbs_per_socket: float  # peak DRAM bandwidth: channels x transfer rate x 8 bytes
    tflops_per_socket: float    # peak FP32 vector FLOP/s: cores x base clock x FLOPs per cycle per core

    def __post_init__(self) -> None:
        p = "host"
        check_field_types(self, p)
        for name in ("sockets", "cores_per_socket"):
            require(getattr(self, name) > 0, p, name, getattr(self, name), "be a positive integer")
        for name in ("dram_gbs_per_socket", "tflops_per_socket"):
            require(getattr(self, name) > 0, p, name, getattr(self, name), "be positive",
                    "copy it from the CPU's data sheet (per socket)")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HostSpec":
        d = plain_dict(d, "host")
        check_keys(d, cls, "host")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def cores(self) -> int:
        """sockets * cores_per_socket."""
        return self.sockets * self.cores_per_socket

    @property
    def dram_bw(self) -> float:
        """Node DRAM bandwidth, bytes/s: sockets * dram_gbs_per_socket * 1e9."""
        return self.sockets * self.dram_gbs_per_socket * 1e9

    @property
    def flops(self) -> float:
        """Node CPU peak, FLOP/s: sockets * tflops_per_socket * 1e12."""
        return self.sockets * self.tflops_per_socket * 1e12


# The host a cluster gets when its YAML names none: a two-socket Sapphire Rapids server, as in DGX H100 and
# most HGX H20 / H200 machines (conf/host/xeon_8480_2s.yaml holds the same numbers and their sources).
DEFAULT_HOST_NAME = "xeon_8480_2s"
DEFAULT_HOST = HostSpec(name=DEFAULT_HOST_NAME, sockets=2, cores_per_socket=56, dram_gbs_per_socket=307.2,
                        tflops_per_socket=7.168)
