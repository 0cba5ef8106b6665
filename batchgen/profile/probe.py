"""Whether a calibration still describes this machine: a few of its grid points timed again, now.

Why. A calibration is one machine at one time, and a shared cloud machine's speed moves by tens of percent within
minutes (benchmarks/results/validation.md), so a prediction can be off with no change to the model of time.
Timing a handful of the file's own points again takes a couple of seconds and says, before anyone trusts a
prediction, by what factor this machine differs now from the one that was profiled.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from batchgen.specs import ModelSpec

# modules probed: `step` is a difference of two wall times (noisy on its own), the router a few microseconds
PROBED = ("attention_decode", "attention_prefill", "experts", "lm_head", "h2d", "d2h")
TOLERANCE = 0.25  # a factor outside [1 / 1.25, 1.25] means the calibration no longer describes this machine


@dataclass(frozen=True)
class Drift:
    """This machine now against a calibration: per module, the median of now / recorded over its probed points."""

    path: Path
    ratios: dict[str, float]
    points: int

    @property
    def factor(self) -> float:
        """Seconds now per recorded second, the median over the modules (< 1: this machine is faster now)."""
        return statistics.median(self.ratios.values())

    @property
    def stale(self) -> bool:
        return stale(self.factor)

    def describe(self) -> str:
        return describe([self])


def stale(factor: float) -> bool:
    """A factor outside the tolerance: the calibration no longer describes this machine."""
    return not 1 / (1 + TOLERANCE) <= factor <= 1 + TOLERANCE


def describe(checks: list[Drift]) -> str:
    """One line for one or more checks of one file (a validation checks before its runs and after each round):
    their mean factor, its range, and what to do if the file no longer describes this machine."""
    last, factors = checks[-1], [c.factor for c in checks]
    mean = statistics.mean(factors)
    when = (f"{mean:.2f}x" if len(checks) == 1
            else f"{mean:.2f}x on average ({min(factors):.2f}x-{max(factors):.2f}x over {len(checks)} checks)")
    parts = ", ".join(f"{m} {r:.2f}x" for m, r in last.ratios.items())
    line = (f"calibration check: {last.points} of {last.path.name}'s points ran at {when} their recorded times on "
            f"this machine (per module, the last check: {parts})")
    if not stale(mean):
        return line + ": it still describes this machine"
    return (line + ": it does not describe this machine now, and predictions from it are off by about that factor. "
            "Profile this machine again (docs/calibration.md, 'The executor's own machine': "
            "python -m batchgen.profile ... out=FILE, then latency.calibration=FILE)")


def probe(path: Path, spec: ModelSpec, quantiles: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8),
          repeats: int = 10) -> Drift:
    """Time again, on the calibration's device, dtype and threads and through the profiler's own cases, the points
    of each module in `PROBED` at these quantiles of its recorded seconds: small calls drifted the most (per-call
    overheads), and a small job makes many of them; the slowest points (a second or more in all) are left out.
    A couple of seconds in all."""
    import torch

    from batchgen.profile.cases import Bench
    from batchgen.profile.grid import grid_named
    from batchgen.exec.clock import using
    from batchgen.profile.run import all_cases, build_profile_model, clock_kind, measure
    from batchgen.profile.timing import Clock

    calibration = json.loads(Path(path).read_text())
    key, settings = calibration["key"], calibration["settings"]
    if not calibration.get("modules"):
        raise ValueError("it has no module points to time again (GEMMs only)")
    device, dtype = torch.device(key["device"]), getattr(torch, key["dtype"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"it was profiled on {key.get('device_name', 'a CUDA device')}, and this machine has none")
    before = torch.get_num_threads()
    torch.set_num_threads(int(key["threads"]))
    try:
        model = build_profile_model(spec, device, dtype)
        cases = {(c.module, _point(c.point)): c
                 for c in all_cases(Bench(model, settings["page_tokens"]), grid_named(settings["grid"]), spec)}
        chosen, recorded = [], []
        for module in PROBED:
            points = sorted((p for p in calibration["modules"].get(module, [])
                             if (module, _point(p)) in cases and p["seconds"] > 0), key=lambda p: p["seconds"])
            for i in sorted({round(q * (len(points) - 1)) for q in quantiles}) if points else ():
                chosen.append(cases[module, _point(points[i])])
                recorded.append(points[i]["seconds"])
        if not chosen:
            raise ValueError(f"{path}: none of its points is on the profiler's grid {settings['grid']!r} "
                             "for this model")
        # timed on the file's clock (a file from before the CPU clock: the wall's)
        kind = settings.get("clock", "wall") if clock_kind(device) == "cpu" else "wall"
        with using(kind):
            samples = measure(chosen, Clock(device, settings.get("evict_bytes", 0)), settings.get("warmup", 2),
                              repeats, rounds=2)
    finally:
        torch.set_num_threads(before)
    by_module: dict[str, list[float]] = {}
    for case, s, seconds in zip(chosen, samples, recorded):
        by_module.setdefault(case.module, []).append(s.median / seconds)
    return Drift(Path(path), {m: statistics.median(r) for m, r in by_module.items()}, len(chosen))


def _point(point: dict) -> str:
    """A grid point's coordinates as a key (a file's point also carries its measurement)."""
    measured = ("seconds", "p10", "minimum", "spread", "repeats", "wall_median")
    return json.dumps({k: v for k, v in point.items() if k not in measured}, sort_keys=True)
