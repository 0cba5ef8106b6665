"""Write an efficiency file from measured profiles.

    python -m batchgen.calibrate profile=<mlp.csv>[,<mlp.csv>...] [collectives=<csv>,...]
        [held_out=<mlp.csv>,...] hardware=<gpu> out=<path.yaml>
    python -m batchgen.calibrate profile=<calibration.json> hardware=<device> out=<path.yaml>

Vidur CSVs (GPU GEMMs, collectives) are fitted here (batchgen.calibrate.gemm_fit); the executor's own
calibration JSON files go to batchgen.calibrate.modules. `held_out` profiles are not fitted: they are
checked, and the result is written into the file's header and `source`, so a shipped file says how well it
predicts models it never saw.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np

from batchgen.calibrate.check import UsageError, check, load_gpu, parse_args
from batchgen.calibrate.gemm_fit import fit_collective_links, fit_gemms
from batchgen.calibrate.vidur import CollectivePoints, GemmPoints, profile_name, read_collective_csv, read_mlp_csv

USAGE = ("usage: python -m batchgen.calibrate profile=<mlp.csv>[,...] [collectives=<csv>,...] "
         "[held_out=<mlp.csv>,...] hardware=<gpu> out=<path.yaml>")


def _sig(v: float) -> float:
    return float(f"{float(v):.4g}")


def _paths(value: str | None) -> list[str]:
    return [p for p in (value or "").split(",") if p]


def _display(path: str) -> str:
    """A path as written in provenance: relative to the package data or the working directory if inside."""
    p = Path(path).resolve()
    data = Path(__file__).resolve().parent.parent / "data"
    for root, prefix in ((data, "batchgen/data/"), (Path.cwd(), "")):
        try:
            return prefix + str(p.relative_to(root))
        except ValueError:
            pass
    return str(path)


def fit_vidur(profiles: list[str], collectives: list[str], held_out: list[str], hardware) -> tuple[dict, list[str]]:
    """(efficiency-file dict, header comment lines) fitted to Vidur profiles on `hardware`."""
    from batchgen.latency.efficiency import Efficiency

    points = GemmPoints.concat(read_mlp_csv(p) for p in profiles)
    gemm = fit_gemms(points, hardware)
    out = {k: _sig(gemm.params[k]) for k in ("compute", "memory", "kernel_s", "gemm_pad_rows")}
    source: dict = {"device": hardware.name, "profiles": [_display(p) for p in profiles],
                    "fitted_on": sorted({profile_name(p) for p in profiles}),
                    "held_out": sorted({profile_name(p) for p in held_out}),
                    "gemm_fit": _errors(gemm.abs_errors)}
    if collectives:
        coll = CollectivePoints.concat(read_collective_csv(p) for p in collectives)
        nvlink, network = fit_collective_links(coll, hardware)
        out.update({k: _sig(nvlink.params[k]) for k in ("link", "collective_s", "collective_per_peer_s")})
        source["collectives"] = [_display(p) for p in collectives]
        source["collective_fit"] = _errors(nvlink.abs_errors)
        if network is not None:
            out["modules"] = {"network": {k: _sig(network.params[k]) for k in ("link", "collective_s")}}
            source["network_fit"] = _errors(network.abs_errors)
    eff = Efficiency.from_dict(out)  # what the simulator will load must load
    check_line = "not run (no held_out profiles)"
    if held_out:
        result = check(GemmPoints.concat(read_mlp_csv(p) for p in held_out), hardware, eff)
        check_line = result.summary()
        source["check"] = _errors(result.abs_errors)
    out["source"] = source
    header = [f"Fitted by: python -m batchgen.calibrate profile={','.join(source['profiles'])}"
              + (f" collectives={','.join(source['collectives'])}" if collectives else "")
              + (f" held_out={','.join(_display(p) for p in held_out)}" if held_out else "")
              + f" hardware={hardware.name} out=<this file>",
              f"Fit on: {', '.join(source['fitted_on'])}; held out: {', '.join(source['held_out']) or 'none'}; "
              f"check: {check_line}",
              f"GEMM fit on its own points: median_abs_error={source['gemm_fit']['median_abs_error_pct']}% "
              f"p95_abs_error={source['gemm_fit']['p95_abs_error_pct']}%"]
    return out, header


def _errors(e: np.ndarray) -> dict:
    return {"median_abs_error_pct": round(float(np.median(e)) * 100, 1),
            "p95_abs_error_pct": round(float(np.percentile(e, 95)) * 100, 1), "points": int(len(e))}


def write_efficiency(path: str | Path, data: dict, header: list[str]) -> Path:
    """The efficiency file: header comments, then the factors in the order the format documents."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"# {part}\n" for line in header
                   for part in textwrap.wrap(line, 114, subsequent_indent="    ", break_on_hyphens=False,
                                                break_long_words=False))
    text += yaml.safe_dump(_plain(data), sort_keys=False, default_flow_style=None, width=116)
    path.write_text(text)
    return path


def _plain(x):
    """numpy scalars and tuples as plain YAML types."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv, ("profile", "hardware", "out"), ("collectives", "held_out"))
        hardware_name = args["hardware"]
        profiles = _paths(args["profile"])
        json_files = [p for p in profiles if p.endswith(".json")]
        for p in profiles + _paths(args.get("collectives")) + _paths(args.get("held_out")):
            if not Path(p).is_file():
                raise UsageError(f"{p} does not exist: pass the path of a Vidur CSV or a calibration .json")
        if json_files:
            if len(profiles) != 1 or "collectives" in args or "held_out" in args:
                raise UsageError("a calibration .json is fitted on its own: pass exactly one profile=<file.json> "
                                 "and no collectives= or held_out=")
            from batchgen.calibrate.modules import fit_calibration_file  # lazily: only for .json profiles

            data = fit_calibration_file(profiles[0], hardware_name)
            header = [f"Fitted by: python -m batchgen.calibrate profile={_display(profiles[0])} "
                      f"hardware={hardware_name} out=<this file>"]
        else:
            gpu = load_gpu(hardware_name)
            data, header = fit_vidur(profiles, _paths(args.get("collectives")), _paths(args.get("held_out")), gpu)
    except (UsageError, ValueError, FileNotFoundError) as e:
        print(f"error: {e} ({USAGE})", file=sys.stderr)
        return 2
    path = write_efficiency(args["out"], data, header)
    print(f"wrote {path}")
    for line in header[1:]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
