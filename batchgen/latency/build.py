"""Which latency model a job runs with: the `latency` config group (conf/latency/) made into an object."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchgen.latency.base import LatencyModel
from batchgen.latency.calibration_file import check_model, read
from batchgen.latency.efficiency import Efficiency
from batchgen.latency.roofline import Roofline

KINDS = ("roofline", "table")


@dataclass(frozen=True)
class LatencySettings:
    """name: roofline, or table (interpolated measurements; `calibration` is the file: a path, or a file name
    under batchgen/data/calibration/)."""

    name: str = "roofline"
    calibration: str | None = None

    def __post_init__(self) -> None:
        if self.name not in KINDS:
            raise ValueError(f"latency={self.name!r} is not a latency model: choose one of {', '.join(KINDS)}")
        if self.name == "table" and not self.calibration:
            raise ValueError("latency=table needs a calibration file: set latency.calibration=FILE (made by "
                             "python -m batchgen.profile, or one shipped in batchgen/data/calibration/)")

    def calibration_path(self) -> Path:
        """The calibration file, found as given or among the shipped ones; a clear error if neither."""
        from batchgen.confdir import data_dir

        given = Path(str(self.calibration)).expanduser()
        shipped = data_dir() / "calibration" / given.name
        for path in (given, shipped):
            if path.is_file():
                return path
        names = sorted(p.name for p in (data_dir() / "calibration").glob("*.json"))
        raise FileNotFoundError(f"latency.calibration={self.calibration}: no such file (shipped: "
                                f"{', '.join(names) or 'none'}); make one with python -m batchgen.profile")


def check_calibration(settings: LatencySettings, model) -> None:
    """Before any work: a table's calibration file exists, is well formed and was measured on `model`'s
    shape (raises FileNotFoundError or ValueError naming the fix)."""
    if settings.name != "table":
        return
    path = settings.calibration_path()
    check_model(read(path), model, str(path))


def build_latency(settings: LatencySettings, model, gpu, eff: Efficiency = Efficiency(), **kw) -> LatencyModel:
    """The job's latency model; `kw` are Roofline's (ep_ranks, gpus_per_node, routing_skew, use_fp8, host)."""
    roofline = Roofline(model, gpu, eff, **kw)
    if settings.name == "roofline":
        return roofline
    from batchgen.latency.table import TablePredictor  # measured points, the roofline for everything else

    return TablePredictor.from_file(settings.calibration_path(), fallback=roofline)
