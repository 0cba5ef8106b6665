"""When a simulated run's sequences finish, on the run's own clock."""

from __future__ import annotations

import numpy as np


def finish_offsets(cost, produced: np.ndarray, finished: np.ndarray, compute: float, boundary: float,
                   duration: float, scale: float) -> np.ndarray:
    """Seconds after a run's start at which each decoding sequence made its last token (NaN where it did not
    finish): the boundary's overhead, then its iterations' compute stretched by `scale` (`SimBackend.timing`)."""
    if cost.iteration_s.size == 1:  # one iteration: every finish at its one end
        end = boundary + float(cost.iteration_s[0]) * scale if compute > 0 else duration
        return np.where(finished, end, np.nan)
    offsets = np.full(finished.size, np.nan)
    if finished.any():
        clock = boundary + np.cumsum(cost.iteration_s) * scale
        offsets[finished] = clock[produced[finished] - 1] if compute > 0 else duration
    return offsets


def few_chunks_finished(t, chunk_ids: np.ndarray, completes: np.ndarray) -> np.ndarray:
    """Per chunk of a forward's few: it ends its prompt and the first token it makes is the sequence's last (read
    before the forward's outcome is recorded), on scalars."""
    return np.array([done and int(t.output_len[sid]) - int(t.decoded[sid]) == 1
                     for sid, done in zip(chunk_ids.tolist(), completes.tolist())], bool)
