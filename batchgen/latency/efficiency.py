"""Efficiency factors of the roofline latency model: the constants a calibration step fits.

Every field scales a data-sheet figure (peak FLOP/s, HBM / PCIe / NVLink / network bandwidth) down to what
real kernels reach, or adds a fixed cost the roofline itself does not see. The defaults are typical achieved
fractions on current NVIDIA GPUs; calibration (profiles from the executor) replaces them per GPU and model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak and fixed overheads (fitted by calibration; see `batchgen.latency`).

    compute: fraction of peak tensor FLOP/s reached by large GEMMs.
    memory: fraction of HBM bandwidth reached by streaming kernels.
    link: fraction of PCIe / NVLink / network bandwidth reached by copies and collectives.
    kernel_s: fixed cost of one module launch (a module = attention, one FFN, the grouped expert GEMM, ...).
    collective_s: fixed latency of one collective (one phase of an all-to-all, one point-to-point send).
    collective_per_peer_s: extra latency per peer of a collective; it is why all-to-all stops scaling past
        ~64 GPUs.
    gemm_pad_rows: rows of GEMM work lost per GEMM call to tile padding and wave quantisation, on average:
        a GEMM over M rows (tokens) costs as much compute as a perfect one over M + gemm_pad_rows, so it
        reaches M / (M + gemm_pad_rows) of `compute`. This is why measured experts keep gaining throughput
        up to hundreds or thousands of tokens each, far past the pure-roofline crossover (~30 tokens per
        expert on an H20). 0 gives the pure roofline.
    host_memory: fraction of the host's peak DRAM bandwidth reached (STREAM-like: ~70-80% on current servers);
        it bounds the PCIe copies of a node's GPUs together and CPU attention.
    host_compute: fraction of the host CPUs' peak FP32 vector FLOP/s reached by CPU attention kernels.
    host_kernel_s: fixed cost of one CPU attention call (thread-pool dispatch and synchronisation).
    """

    compute: float = 0.6
    memory: float = 0.75
    link: float = 0.75
    kernel_s: float = 6e-6
    collective_s: float = 12e-6
    collective_per_peer_s: float = 0.4e-6
    gemm_pad_rows: float = 64.0
    host_memory: float = 0.7
    host_compute: float = 0.5
    host_kernel_s: float = 20e-6

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "link", "host_memory", "host_compute"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value!r}")
        for name in ("kernel_s", "collective_s", "collective_per_peer_s", "gemm_pad_rows", "host_kernel_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"Efficiency.{name} must be finite and >= 0, got {value!r}")

    def to_dict(self) -> dict[str, float]:
        """Plain dict, e.g. for a calibration file; `Efficiency(**d)` reads it back."""
        return asdict(self)
