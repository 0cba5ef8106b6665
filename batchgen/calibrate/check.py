"""Check a GPU's efficiency file against a measured Vidur mlp.csv, op by op.

    python -m batchgen.calibrate.check profile=<mlp.csv> hardware=<gpu> [efficiency=<name>]

Prints the predicted and measured time of each weight GEMM (attn_pre_proj, attn_post_proj, mlp_up_proj,
mlp_down_proj) for every (tokens, TP) row, and ends with `median_abs_error=<pct>% p95_abs_error=<pct>%`.
The efficiency defaults to the file fitted for that GPU (conf/efficiency/<gpu>.yaml). Attention projections
run at the `attention_prefill` factors and MLP GEMMs at the `dense_ffn` ones when the file overrides them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgen.calibrate.gemm_fit import abs_errors, predict_gemms
from batchgen.calibrate.vidur import GEMM_OPS, GemmPoints, read_mlp_csv

OP_MODULE = {"attn_pre_proj": "attention_prefill", "attn_post_proj": "attention_prefill",
             "mlp_up_proj": "dense_ffn", "mlp_down_proj": "dense_ffn"}
USAGE = "usage: python -m batchgen.calibrate.check profile=<mlp.csv> hardware=<gpu> [efficiency=<name>]"


class UsageError(Exception):
    """A bad command line: the message names the fix."""


@dataclass(frozen=True)
class CheckResult:
    points: GemmPoints
    predicted: np.ndarray

    @property
    def abs_errors(self) -> np.ndarray:
        return abs_errors(self.predicted, self.points.seconds)

    def summary(self) -> str:
        e = self.abs_errors * 100
        return f"median_abs_error={np.median(e):.1f}% p95_abs_error={np.percentile(e, 95):.1f}%"


def predict_with(points: GemmPoints, hardware, efficiency) -> np.ndarray:
    """Predicted seconds of each point, each op at its module's factors (an `Efficiency`)."""
    out = np.empty(len(points))
    for op in np.unique(points.op):
        mask = points.op == op
        eff = efficiency.for_module(OP_MODULE[op])
        params = {"compute": eff.compute, "memory": eff.memory, "kernel_s": eff.kernel_s,
                  "gemm_pad_rows": eff.gemm_pad_rows}
        out[mask] = predict_gemms(points.select(mask), hardware, params)
    return out


def check(points: GemmPoints, hardware, efficiency) -> CheckResult:
    return CheckResult(points, predict_with(points, hardware, efficiency))


def load_efficiency_file(name: str, hardware_name: str | None = None):
    """An `Efficiency` from conf/efficiency/<name>.yaml (a path to a .yaml file works too)."""
    from batchgen.latency.efficiency import Efficiency
    from batchgen.specs.catalog import efficiency_names, load_efficiency_dict

    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        import yaml
        with open(name) as f:
            return Efficiency.from_dict(yaml.safe_load(f) or {})
    names = efficiency_names()
    if name not in names:
        what = f"no fitted efficiency ships for {hardware_name}" if hardware_name else f"unknown efficiency {name!r}"
        raise UsageError(f"{what}: pass efficiency=<name> with one of {', '.join(names) or '(none)'}, or a path "
                         "to an efficiency .yaml")
    return Efficiency.from_dict(load_efficiency_dict(name))


def parse_args(argv: list[str], required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, str]:
    """key=value arguments; unknown or missing keys are UsageErrors."""
    args: dict[str, str] = {}
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or not value:
            raise UsageError(f"argument {a!r} is not key=value")
        if key not in required + optional:
            raise UsageError(f"unknown argument {key!r}; valid: {', '.join(required + optional)}")
        args[key] = value
    missing = [k for k in required if k not in args]
    if missing:
        raise UsageError(f"missing {', '.join(f'{k}=...' for k in missing)}")
    return args


def load_gpu(name: str):
    from batchgen.specs.catalog import hardware_names, load_hardware

    if name not in hardware_names():
        raise UsageError(f"unknown hardware {name!r}: use one of {', '.join(hardware_names())} (conf/hardware)")
    return load_hardware(name)


def report(result: CheckResult) -> list[str]:
    """One line per (tokens, TP): predicted / measured microseconds of each op; then the summary."""
    p, pred = result.points, result.predicted
    lines = [f"{'tokens':>6} {'tp':>2} " + " ".join(f"{op + ' pred/meas us':>34}" for op in GEMM_OPS)]
    index = {(m, tp, op): i for i, (m, tp, op) in enumerate(zip(p.m, p.tp, p.op))}
    for m, tp in sorted(set(zip(p.m, p.tp)), key=lambda x: (x[1], x[0])):
        cells = []
        for op in GEMM_OPS:
            i = index.get((m, tp, op))
            if i is None:
                cells.append(f"{'-':>34}")
                continue
            err = 100 * (pred[i] / p.seconds[i] - 1)
            cells.append(f"{pred[i] * 1e6:>12.1f} /{p.seconds[i] * 1e6:>10.1f} ({err:+6.1f}%)")
        lines.append(f"{int(m):>6} {int(tp):>2} " + " ".join(cells))
    lines.append(result.summary())
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv, ("profile", "hardware"), ("efficiency",))
        gpu = load_gpu(args["hardware"])
        eff = load_efficiency_file(args.get("efficiency", args["hardware"]), None if "efficiency" in args
                                   else args["hardware"])
        try:
            points = read_mlp_csv(args["profile"])
        except FileNotFoundError:
            raise UsageError(f"profile {args['profile']} does not exist: pass profile=<path to a Vidur mlp.csv>, "
                             "e.g. batchgen/data/profiles/vidur/compute/a100/meta-llama/Llama-2-70b-hf/mlp.csv")
        except ValueError as e:
            raise UsageError(str(e))
    except UsageError as e:
        print(f"error: {e} ({USAGE})", file=sys.stderr)
        return 2
    print("\n".join(report(check(points, gpu, eff))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
