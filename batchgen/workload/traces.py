"""Request-length traces read from CSV.

Real traces give workloads that no one here chose the shape of, which keeps synthetic distributions honest.
Arrival times, if present, are ignored: in batch inference every request is there at t=0.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

# Accepted (input column, output column) pairs, in order of preference. The first is the project's own
# format; the second is the one used by Vidur's processed Azure/Splitwise traces.
COLUMN_PAIRS = (("input_len", "output_len"), ("num_prefill_tokens", "num_decode_tokens"))

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"


def shipped_traces() -> list[str]:
    """Names of the traces that ship with the package (resolvable by bare file name)."""
    return sorted(p.name for p in SHIPPED_DIR.glob("*.csv")) if SHIPPED_DIR.is_dir() else []


def _parse_length(text: str) -> int:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        value = float(text)  # tolerate "12.0", which some exporters write; reject "12.5" below
        if not value.is_integer():
            raise ValueError(f"{text!r} is not a whole number") from None
        return int(value)


def load_trace(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read (input_lens, output_lens) as int64 arrays from a CSV file with a header row.

    The csv module with a per-row loop is fast enough (20K rows in tens of milliseconds) and, unlike
    numpy.loadtxt, lets every error name the file and the line a user has to fix.
    """
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader, [])]
        for in_col, out_col in COLUMN_PAIRS:
            if in_col in header and out_col in header:
                i_in, i_out = header.index(in_col), header.index(out_col)
                break
        else:
            expected = " or ".join(f"'{a},{b}'" for a, b in COLUMN_PAIRS)
            raise ValueError(f"{path}: header {header} lacks the columns {expected}")

        inputs: list[int] = []
        outputs: list[int] = []
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            line = reader.line_num
            try:
                n_in, n_out = _parse_length(row[i_in]), _parse_length(row[i_out])
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}, line {line}: cannot read lengths from {row}: {e}") from None
            if n_in < 1 or n_out < 1:
                raise ValueError(
                    f"{path}, line {line}: lengths must be >= 1, got {in_col}={n_in}, {out_col}={n_out}"
                )
            inputs.append(n_in)
            outputs.append(n_out)

    if not inputs:
        raise ValueError(f"{path}: no data rows after the header")
    return np.array(inputs, dtype=np.int64), np.array(outputs, dtype=np.int64)
