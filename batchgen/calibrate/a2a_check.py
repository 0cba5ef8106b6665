"""Check the expert all-to-all against published measurements of a multi-node one: DeepEP's low-latency kernels.

    python -m batchgen.calibrate.a2a_check [efficiency=h100]

The collectives were fitted on one 8-GPU DGX (NVLink) and on Vidur's cross-node send/recv points (the network
module); an expert all-to-all over 16-256 GPUs is priced from those fits (`Roofline.a2a_phase`). DeepEP
(github.com/deepseek-ai/DeepEP, docs/legacy.md: its V1 results) published the latency of one dispatch and one
combine at 8 to 256 ranks on H800s (NVLink, about 160 GB/s achieved) with a 400 Gb/s CX7 InfiniBand card per GPU,
in a DeepSeek-V3/R1 decode setting: 128 tokens per rank, hidden size 7,168, top-8 experts, FP8 dispatch (the
hidden row plus one float scale per 128 values) and BF16 combine. Each point is priced here on an H100 spec with
the H800's NVLink (200 GB/s per direction) and the efficiency file given, and the errors are printed per link
kind, in the form of the GEMM check: `median_abs_error=<pct>% p95_abs_error=<pct>%`.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from batchgen.latency.roofline import Roofline
from batchgen.specs import load_model
from batchgen.specs.catalog import load_hardware_file

TOKENS, HIDDEN, TOP_K, GPUS_PER_NODE = 128, 7168, 8, 8
DISPATCH_ROW = HIDDEN + 4 * HIDDEN // 128  # FP8 values and a float scale per 128 of them
COMBINE_ROW = 2 * HIDDEN                   # BF16
# (ranks, dispatch us, combine us), DeepEP V1 low-latency kernels, H800 + CX7 400 Gb/s
DEEPEP_LOW_LATENCY = ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314), (128, 192, 369),
                      (256, 194, 360))


def h800():
    """An H100 with the H800's NVLink (400 GB/s both ways) and a 400 Gb/s network card per GPU."""
    return dataclasses.replace(load_hardware_file("h100"), name="h800", nvlink_gbs=200.0, network_gbs=50.0)


def predictions(efficiency) -> list[tuple[int, str, float, float]]:
    """(ranks, phase, predicted us, measured us) for every published point."""
    lat = Roofline(load_model("deepseek_r1"), h800(), efficiency, gpus_per_node=GPUS_PER_NODE)
    rows = []
    for ranks, dispatch_us, combine_us in DEEPEP_LOW_LATENCY:
        for phase, row, measured in (("dispatch", DISPATCH_ROW, dispatch_us), ("combine", COMBINE_ROW, combine_us)):
            predicted = float(lat.a2a_phase(TOKENS * TOP_K * row, ranks)) * 1e6
            rows.append((ranks, phase, predicted, float(measured)))
    return rows


def summary(rows) -> dict[str, str]:
    """The errors per link kind: one node (NVLink) and across nodes (the network)."""
    out = {}
    for kind, pick in (("one node", lambda r: r <= GPUS_PER_NODE), ("across nodes", lambda r: r > GPUS_PER_NODE)):
        e = np.array([abs(p - m) / m for r, _, p, m in rows if pick(r)]) * 100
        out[kind] = f"median_abs_error={np.median(e):.1f}% p95_abs_error={np.percentile(e, 95):.1f}% points={e.size}"
    return out


def main(argv: list[str]) -> None:
    from batchgen.calibrate.check import load_efficiency_file

    args = dict(a.split("=", 1) for a in argv if "=" in a)
    eff = load_efficiency_file(args.get("efficiency", "h100"))
    rows = predictions(eff)
    print(f"{'ranks':>5} {'phase':>8} {'predicted us':>12} {'DeepEP us':>9} {'error':>7}")
    for ranks, phase, p, m in rows:
        print(f"{ranks:>5} {phase:>8} {p:>12.0f} {m:>9.0f} {100 * (p - m) / m:>+6.0f}%")
    for kind, line in summary(rows).items():
        print(f"{kind}: {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
