"""Switch for the simulator's fast paths, so that each can be checked against the general code it skips.

The simulator spends most of its time on small arrays (one rank, one iteration: a serving engine's forward),
where numpy's per-call overhead, not the arithmetic, sets the pace. Some hot paths therefore carry a second,
cheaper way to the same result for a common case: GEMM times read from a cached curve, a few ids' primitives on
Python scalars (batchgen.core.few), one-rank runs priced on Python floats (batchgen.pricing.price.price_cells), an
offloading system's one-rank runs priced as the chain its DAG reduces to (batchgen.pricing.scalar_offload), a block
policy's identical decode runs as one event with each boundary replayed (batchgen.engine.repeat), a one-GPU
instance's plain boundary applied, priced and recorded in one pass (batchgen.sim.fused). Each is taken only where its
result is the general path's, bit for bit. `ENABLED` turns them all off at once; tests/test_sim_fastpath.py runs jobs
both ways and requires identical decisions, times and step records (only the count of SimPy events may be lower with
the shortcuts). A new shortcut must consult `ENABLED` and keep that test passing; a check that only skips work where
there is nothing to do (no host copy, nothing partitioned, nothing moved) is not a shortcut and does not.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

ENABLED = True


@contextmanager
def reference() -> Iterator[None]:
    """Run the block on the general paths only (every shortcut off)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before
