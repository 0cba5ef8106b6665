"""Profile a model's modules on this device and assemble the calibration file
(see batchgen.latency.calibration_file)."""
from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import batchgen
from batchgen.latency.calibration_file import FORMAT
from batchgen.exec.clock import using
from batchgen.exec.load import LoadMeter
from batchgen.exec.models import ExecModelConfig, MoEDecoder, init_random
from batchgen.profile.cases import Bench, Case, attention_cases, copy_cases, ffn_cases, lm_head_cases, step_cases
from batchgen.profile.grid import Grid
from batchgen.profile.timing import Clock, Samples, split_repeats
from batchgen.specs import ModelSpec

FULL_MODEL_BYTES = 2e9  # build every layer below this (fp32 at init); above it only the layers a module needs


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    device: torch.device
    dtype: torch.dtype
    threads: int | None          # torch intra-op threads pinned for the run (None: as they are)
    grid: Grid
    warmup: int = 2
    repeats: int = 7
    page_size: int = 64          # the executor's KV page (attention pads contexts to whole pages)
    hardware: str | None = None  # conf/hardware name of this device, recorded in the key
    seed: int = 0


def build_profile_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0
                        ) -> MoEDecoder:
    """The executor's model with random weights; a large model keeps only its first layers (the dense ones and
    one MoE layer): per-layer module costs do not depend on how many layers follow."""
    config = ExecModelConfig.from_spec(spec)
    if spec.total_params * 4 > FULL_MODEL_BYTES:
        keep = min(spec.num_layers, (spec.first_dense_layers if spec.is_moe else 0) + 1)
        config = dataclasses.replace(config, num_layers=keep)
    return init_random(config, seed=seed, dtype=dtype, device=device).eval()


def all_cases(bench: Bench, grid: Grid, spec: ModelSpec) -> list[Case]:
    max_ctx = min(spec.max_context, bench.model.config.max_position_embeddings)
    return (attention_cases(bench, grid, max_ctx) + ffn_cases(bench, grid) + lm_head_cases(bench, grid)
            + step_cases(bench, grid, max_ctx) + copy_cases(bench, grid))


def measure(cases: list[Case], clock: Clock, warmup: int, repeats: int, rounds: int,
            log=None) -> list[Samples]:
    """Every case `repeats` times in total, spread over `rounds` passes over the whole grid (drift on a shared
    machine then hits every point alike), with `warmup` untimed calls before each point's calls of a round."""
    samples = [Samples() for _ in cases]
    for r, calls in enumerate(split_repeats(repeats, rounds)):
        t0 = time.perf_counter()
        for case, s in zip(cases, samples):
            clock.last_wall = []
            s.seconds.extend(case.measure(clock, warmup, calls))
            s.wall.extend(clock.last_wall)
        if log:
            log(f"round {r + 1}: {len(cases)} points in {time.perf_counter() - t0:.1f} s")
    return samples


EVICT_MAX_BYTES = 1 << 29  # a buffer read between timed calls at most this large (512 MiB)


def evict_bytes(spec: ModelSpec, device: torch.device) -> int:
    """CPU: the model's weight bytes (what a run reads between two calls of one layer's module), up to
    EVICT_MAX_BYTES; CUDA: 0 (events time the kernels; the GPU's L2 is small beside any layer)."""
    if device.type != "cpu":
        return 0
    return int(min(spec.total_params * spec.weight_bytes, EVICT_MAX_BYTES))


def clock_kind(device: torch.device) -> str:
    """The executor's clock for a profile on `device` with the threads now in force (batchgen.exec.clock)."""
    return "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"


def profile(spec: ModelSpec, settings: ProfileSettings, log=None) -> dict:
    """Measure every module of `spec` over the grid; returns the calibration dict."""
    before = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    kind, meter = clock_kind(settings.device), LoadMeter()
    try:
        with using(kind):
            return _profile(spec, settings, kind, meter, log)
    finally:
        torch.set_num_threads(before)


def _profile(spec: ModelSpec, settings: ProfileSettings, kind: str, meter: LoadMeter, log) -> dict:
    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    model = build_profile_model(spec, settings.device, settings.dtype, settings.seed)
    bench = Bench(model, settings.page_size, settings.seed)
    cases = all_cases(bench, settings.grid, spec)
    if log:
        log(f"profiling {spec.name} on {settings.device} ({settings.dtype}, {torch.get_num_threads()} "
            f"threads, {kind} clock): {len(cases)} points x {settings.repeats} repeats, grid {settings.grid.name}")
    clock = Clock(settings.device, evict_bytes(spec, settings.device))
    samples = measure(cases, clock, settings.warmup, settings.repeats, settings.grid.rounds, log)
    modules: dict[str, list[dict]] = {}
    for case, s in zip(cases, samples):
        # the step overhead is a difference of two times: it can dip below 0 by noise on tiny batches
        point = {**case.point, "seconds": max(s.median, 0.0), "p10": max(s.p10, 0.0),
                 "minimum": max(s.minimum, 0.0), "spread": round(s.spread, 4), "repeats": len(s.seconds)}
        if s.wall:
            point["wall_median"] = float(np.median(s.wall))
        modules.setdefault(case.module, []).append(point)
    return {"format": FORMAT, "key": device_key(spec, settings),
            "settings": {"warmup": settings.warmup, "repeats": settings.repeats, "rounds": settings.grid.rounds,
                         "grid": settings.grid.name, "page_tokens": settings.page_size,
                         "layers_built": model.num_layers, "sampling": "greedy", "clock": kind,
                         "evict_bytes": evict_bytes(spec, settings.device),
                         "spread": "(p90 - p10) / median of the repeats", "p10": "10th percentile of the repeats",
                         "seconds": f"median per call of one layer's module (lm_head, step: per forward), on the "
                                    f"{kind} clock", "minimum": "the fastest call",
                         "wall_median": "median wall seconds of the same calls (CPU clock only)",
                         "load": meter.read().to_dict(), "wall_s": round(time.perf_counter() - start, 1)},
            "modules": modules}


def device_key(spec: ModelSpec, s: ProfileSettings) -> dict:
    cuda = s.device.type == "cuda"
    return {"device": s.device.type, "device_name": torch.cuda.get_device_name(s.device) if cuda else cpu_name(),
            "hardware": s.hardware, "model": spec.to_dict(), "dtype": str(s.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "batchgen": batchgen_version(), "cuda": torch.version.cuda if cuda else None}


def cpu_name() -> str:
    """The CPU model name (lscpu's), with the core count this process may use."""
    name = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({cores} CPUs)" if cores else name


def batchgen_version() -> str:
    """The checkout's commit (with +dirty for local changes) when run from a clone, else the package version."""
    root = Path(batchgen.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=True).stdout.strip()
        return f"{batchgen.__version__}+g{commit}"
    except (OSError, subprocess.SubprocessError):
        return batchgen.__version__


def summary(calibration: dict) -> str:
    """One line per module: points and the range of measured seconds."""
    lines = []
    for module, points in calibration["modules"].items():
        sec = np.array([p["seconds"] for p in points])
        spread = np.median([p.get("spread", 0.0) for p in points])
        lines.append(f"  {module:18s} {len(points):3d} points  {sec.min() * 1e3:9.3f} .. {sec.max() * 1e3:9.3f} ms"
                     f"  median spread {spread:.1%}")
    return "\n".join(lines)


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
