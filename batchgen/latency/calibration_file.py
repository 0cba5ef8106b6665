"""The calibration file: measured seconds per module call on one device, for one model shape (JSON).

    {"format": "batchgen-calibration/1",
     "key": {"device": "cpu" | "cuda", "device_name": ..., "hardware": <conf/hardware name or null>,
             "model": {ModelSpec fields}, "dtype": "float32", "threads": 1, "torch": ..., "python": ...,
             "batchgen": <commit or version>, "cuda": <version or null>},
     "settings": {"warmup": 2, "repeats": 7, "grid": "quick", ...},
     "modules": {<module>: [{<coordinates>, "seconds": median, "p10": 10th percentile,
                             "spread": (p90 - p10) / median, "repeats": n}, ...]},
     "gemms": [{"op", "m", "k", "n", "tp", "seconds"}]}   # optional (imported GEMM profiles)

Seconds are per call of ONE layer's module (what the latency model's methods return), except `lm_head` and
`step` (once per forward) and `boundary` (once per scheduling boundary). Points carry the coordinates their
module's latency-model method takes; extra keys (e.g. `max_expert_tokens`) are kept and ignored.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

FORMAT = "batchgen-calibration/1"

# module -> coordinates every point must carry (besides seconds)
MODULES: dict[str, tuple[str, ...]] = {
    "attention_decode": ("tokens", "context_sum", "max_context", "micro_batches"),
    "attention_prefill": ("tokens", "context_sq_sum", "max_context", "sequences", "micro_batches"),
    "dense_ffn": ("tokens",),
    "shared_experts": ("tokens",),
    "router": ("tokens",),
    "experts": ("total_tokens",),
    "lm_head": ("tokens",),
    "step": ("sequences",),
    "boundary": ("sequences",),
    "h2d": ("bytes",),
    "d2h": ("bytes",),
}
KEY_FIELDS = ("device", "device_name", "model", "dtype", "threads", "torch", "python", "batchgen")
GEMM_FIELDS = ("op", "m", "k", "n", "tp", "seconds")


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file, the entry and the fix."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate(data: Any, where: str = "calibration") -> dict:
    """Check the shape of a calibration dict; returns it. Raises CalibrationError naming what is wrong."""
    if not isinstance(data, Mapping):
        raise CalibrationError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise CalibrationError(f"{where}: format is {data.get('format')!r}, expected {FORMAT!r} (a file written "
                               "by python -m batchgen.profile)")
    key = data.get("key")
    if not isinstance(key, Mapping):
        raise CalibrationError(f"{where}: missing 'key' (device, model, dtype, software versions)")
    missing = [f for f in KEY_FIELDS if f not in key]
    if missing:
        raise CalibrationError(f"{where}: key lacks {', '.join(missing)}")
    if key["device"] not in ("cpu", "cuda"):
        raise CalibrationError(f"{where}: key.device is {key['device']!r}, expected cpu or cuda")
    if not isinstance(key["model"], Mapping) or "name" not in key["model"]:
        raise CalibrationError(f"{where}: key.model must hold the profiled model's ModelSpec fields")
    modules = data.get("modules")
    if not isinstance(modules, Mapping):
        raise CalibrationError(f"{where}: missing 'modules' (module name -> list of measured points)")
    for module, points in modules.items():
        if module not in MODULES:
            raise CalibrationError(f"{where}: unknown module {module!r}; valid: {', '.join(MODULES)}")
        if not isinstance(points, list):
            raise CalibrationError(f"{where}: modules.{module} must be a list of points")
        for i, p in enumerate(points):
            _check_point(p, MODULES[module], f"{where}: modules.{module}[{i}]")
    gemms = data.get("gemms", [])
    if not isinstance(gemms, list):
        raise CalibrationError(f"{where}: gemms must be a list")
    for i, g in enumerate(gemms):
        if not isinstance(g, Mapping) or any(f not in g for f in GEMM_FIELDS):
            raise CalibrationError(f"{where}: gemms[{i}] needs fields {', '.join(GEMM_FIELDS)}, got {g!r}")
        if not (_number(g["seconds"]) and g["seconds"] > 0):
            raise CalibrationError(f"{where}: gemms[{i}].seconds must be a positive number, got {g['seconds']!r}")
    if not modules and not gemms:
        raise CalibrationError(f"{where}: no measured point (modules and gemms are both empty)")
    scales = (data.get("in_run") or {}).get("scales", {})
    if not isinstance(scales, Mapping) or not all(_number(v) and v > 0 for v in scales.values()):
        raise CalibrationError(f"{where}: in_run.scales must map module kinds to positive ratios, got {scales!r}")
    sizes = (data.get("in_run") or {}).get("tokens_per_forward", {})
    if not isinstance(sizes, Mapping) or not all(_number(v) and v > 0 for v in sizes.values()):
        raise CalibrationError(f"{where}: in_run.tokens_per_forward must map ratios to positive token counts, "
                               f"got {sizes!r}")
    by_size = (data.get("in_run") or {}).get("by_size", {})
    if not isinstance(by_size, Mapping) or not all(
            isinstance(pts, list) and all(isinstance(p, list) and len(p) == 2 and _number(p[0]) and _number(p[1])
                                          and p[0] > 0 and p[1] > 0 for p in pts)
            and all(a[0] < b[0] for a, b in zip(pts, pts[1:])) for pts in by_size.values()):
        raise CalibrationError(f"{where}: in_run.by_size must map module kinds to [size, ratio] pairs, sizes "
                               f"ascending, both positive; got {by_size!r}")
    return dict(data)


def _check_point(p: Any, coords: tuple[str, ...], where: str) -> None:
    if not isinstance(p, Mapping):
        raise CalibrationError(f"{where}: expected an object, got {p!r}")
    for name in coords + ("seconds",):
        if name not in p:
            raise CalibrationError(f"{where}: missing {name!r} (a point of this module needs "
                                   f"{', '.join(coords + ('seconds',))})")
        if not (_number(p[name]) and p[name] >= 0):
            raise CalibrationError(f"{where}: {name} must be a finite number >= 0, got {p[name]!r}")


def read(path: str | Path) -> dict:
    """Load and validate a calibration file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read calibration file ({e.strerror or e}); make one with "
                               "python -m batchgen.profile") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    return validate(data, str(path))


def write(data: Mapping, path: str | Path) -> Path:
    """Validate, then write compactly (one point per line) so that the file stays small and diffable."""
    validate(data, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{", f' "format": {json.dumps(data["format"])},', f' "key": {json.dumps(data["key"])},',
             f' "settings": {json.dumps(data.get("settings", {}))},', ' "modules": {']
    mods = list(data["modules"].items())
    for j, (module, points) in enumerate(mods):
        lines.append(f'  {json.dumps(module)}: [')
        lines += [f'   {json.dumps(p)}' + ("," if i < len(points) - 1 else "") for i, p in enumerate(points)]
        lines.append("  ]" + ("," if j < len(mods) - 1 else ""))
    gemms = data.get("gemms") or []
    in_run = data.get("in_run")
    lines.append(" }," if gemms or in_run else " }")
    if gemms:
        lines.append(' "gemms": [')
        lines += [f'  {json.dumps(g)}' + ("," if i < len(gemms) - 1 else "") for i, g in enumerate(gemms)]
        lines.append(" ]," if in_run else " ]")
    if in_run:  # the profile's in-run ratios (batchgen.profile.in_run)
        lines.append(f' "in_run": {json.dumps(in_run)}')
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")
    return path


def model_shape(model: Mapping | Any) -> dict:
    """The fields that decide a module's cost (everything but the name): two specs with equal shapes share
    calibration points."""
    d = dict(model) if isinstance(model, Mapping) else model.to_dict()
    d.pop("name", None)
    return d


def check_model(data: Mapping, model: Any, where: str = "calibration") -> None:
    """Refuse a calibration measured on another model shape than `model` (a ModelSpec)."""
    have, want = model_shape(data["key"]["model"]), model_shape(model)
    diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
    if diff:
        shown = ", ".join(f"{k}: file {have.get(k)!r} vs job {want.get(k)!r}" for k in diff[:6])
        raise CalibrationError(f"{where} was measured on model {data['key']['model'].get('name')!r}, whose shape "
                               f"differs from the job's model {getattr(model, 'name', '?')!r} ({shown}): profile "
                               f"this model with python -m batchgen.profile model={getattr(model, 'name', '...')}")
