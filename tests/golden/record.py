"""Write the golden decision traces and finish times of tests/golden/cases.py (one .npz per job).

    python tests/golden/record.py [CASE ...]

Run it only to accept a change of decisions or times on purpose, and say in the commit which jobs changed and why.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cases import CASES, KV_PAGES  # noqa: E402

from batchgen.decisions import trace_of  # noqa: E402
from batchgen.sim.run import simulate  # noqa: E402

ROWS_KEPT_CHARS = 1 << 21  # a trace's rows stored whole up to this much text, else only their digests


def outcome(name: str) -> dict[str, np.ndarray]:
    """A job's decision trace (one row per boundary, as decisions.csv writes it) and its times."""
    out = simulate(CASES[name](), progress=False, kv_pages_per_gpu=KV_PAGES.get(name))
    t = out.prepared.state.table
    trace = trace_of(out.records)
    rows = np.array(["|".join(str(v) for v in d.row().values()) for d in trace], dtype=str)
    got = {"digest": np.array([hashlib.sha1(r.encode()).hexdigest() for r in rows.tolist()], dtype=str),
           "instance": np.array([d.instance for d in trace]), "finish": t.finish_time.copy(),
           "first": t.first_token_time.copy()}
    if sum(map(len, rows.tolist())) <= ROWS_KEPT_CHARS:  # small enough to keep: a difference is then shown
        got["rows"] = rows
    return got


def main(names: list[str]) -> None:
    for name in names or sorted(CASES):
        got = outcome(name)
        np.savez_compressed(HERE / f"{name}.npz", **got)
        print(f"{name}: {got['digest'].size} boundaries, BCT {np.nanmax(got['finish']):.6f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
