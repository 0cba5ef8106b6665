"""Efficiency factors of the roofline latency model: the constants a calibration step fits.

Every field scales a data-sheet figure (peak FLOP/s, HBM / PCIe / NVLink / network bandwidth) down to what
real kernels reach, or adds a fixed cost the roofline itself does not see. The defaults are typical achieved
fractions on current NVIDIA GPUs; calibration (profiles from the executor) replaces them per GPU and model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

# Modules that may carry their own factors (`Efficiency.modules`); anything else is a typo.
MODULES = ("attention_prefill", "attention_decode", "dense_ffn", "shared_experts", "router", "experts", "lm_head",
           "all_to_all", "all_reduce", "copy", "network", "cpu_attention")


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
    attention_padding: share of the padded attention work (queries x longest context, instead of the sum of
        the contexts) that the kernels pay: 0 for paged / varlen kernels (FlashAttention, FlashInfer), 1 for a
        kernel over a dense padded batch (the CPU executor's SDPA).
    step_s, step_per_sequence_s: the engine's own time per forward outside the modules (embedding, batch
        metadata, sampling, token bookkeeping): step_s + step_per_sequence_s * sequences. 0 on a data sheet.
    boundary_s, boundary_per_sequence_s: the engine's time at one scheduling boundary (snapshot, policy
        decision, KV bookkeeping), likewise.
    modules: per-module overrides of the fields above, {module: {field: value}} with modules from `MODULES`
        (a fit finds attention kernels, expert GEMMs and collectives reaching different fractions of peak).
    source: where the numbers come from (device, calibration file, fitted and held-out models); provenance
        only, never read by the model.
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
    attention_padding: float = 0.0
    step_s: float = 0.0
    step_per_sequence_s: float = 0.0
    boundary_s: float = 0.0
    boundary_per_sequence_s: float = 0.0
    modules: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    source: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in _FRACTIONS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value!r}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
                raise ValueError(f"Efficiency.{name} must be finite and >= 0, got {value!r}")
        if not 0.0 <= self.attention_padding <= 1.0:
            raise ValueError(f"Efficiency.attention_padding must be in [0, 1], got {self.attention_padding!r}")
        if not isinstance(self.modules, Mapping):
            raise ValueError(f"Efficiency.modules must map module names to factors, got {self.modules!r}")
        scalar = [f.name for f in fields(self) if f.name not in ("modules", "source")]
        for module, factors in self.modules.items():
            if module not in MODULES:
                raise ValueError(f"Efficiency.modules: unknown module {module!r}; valid: {', '.join(MODULES)}")
            unknown = sorted(set(factors) - set(scalar))
            if unknown:
                raise ValueError(f"Efficiency.modules.{module}: unknown field(s) {', '.join(unknown)}; valid: "
                                 f"{', '.join(scalar)}")
            replace(self, modules={}, **factors)  # validates the values
        # frozen and hashable: plan caches key on it
        object.__setattr__(self, "modules", _Frozen({m: _Frozen(f) for m, f in self.modules.items()}))
        object.__setattr__(self, "source", dict(self.source))

    def __hash__(self) -> int:
        return hash(tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.compare))

    def for_module(self, module: str) -> "Efficiency":
        """The factors `module` runs at: the top-level ones with that module's overrides applied."""
        factors = self.modules.get(module)
        return replace(self, modules={}, **factors) if factors else self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, the efficiency-file format; `Efficiency.from_dict` reads it back."""
        d = asdict(self)
        d["modules"] = {m: dict(f) for m, f in self.modules.items()}
        d["source"] = dict(self.source)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Efficiency":
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise ValueError(f"unknown efficiency field(s) {', '.join(unknown)}; valid fields are: "
                             f"{', '.join(sorted(valid))}")
        return cls(**{k: (float(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in d.items()})


_FRACTIONS = ("compute", "memory", "link", "host_memory", "host_compute")
_NON_NEGATIVE = ("kernel_s", "collective_s", "collective_per_peer_s", "gemm_pad_rows", "host_kernel_s", "step_s",
                 "step_per_sequence_s", "boundary_s", "boundary_per_sequence_s")


class _Frozen(dict):
    """A read-only, hashable dict (efficiency factors are part of plan-cache keys)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *args, **kwargs):
        raise TypeError("efficiency factors are read-only: build a new Efficiency")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly  # type: ignore[assignment]

    def __reduce__(self):  # pickled by value (a multi-process run returns its output): rebuilt, never written into
        return (_Frozen, (dict(self),))


def load_efficiency(cfg: Mapping[str, Any], gpu: str) -> Efficiency:
    """The `efficiency` config as run: with `auto: true`, the fitted file of GPU `gpu` when one ships
    (conf/efficiency/<gpu>.yaml) under the config's other keys; `inherit: <file>` starts from that file."""
    from batchgen.specs.catalog import efficiency_names, load_efficiency_dict, merge_factors

    d = dict(cfg)
    auto = d.pop("auto", False)
    base = d.pop("inherit", None)
    if base is None and auto and gpu in efficiency_names():
        base = gpu
    return Efficiency.from_dict(merge_factors(load_efficiency_dict(base) if base is not None else {}, d))
