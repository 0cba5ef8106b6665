"""The two ways a multi-process run goes wrong that callers must tell apart: a configuration that cannot work
(refused before any process starts) and a peer that stopped answering (found while running)."""

from __future__ import annotations

from batchgen.memory import ConfigError


class DistConfigError(ConfigError):
    """A multi-process setup that cannot run as asked (process counts, placement, environment); the message
    says what is wrong and how to fix it."""


class WorkerLost(RuntimeError):
    """A peer process died or stopped answering (SIGKILL, out of memory, a hung collective). `rank` is the
    lost process's global rank (None when it could not be told which peer it was); `cause` what showed it."""

    def __init__(self, rank: int | None, cause: str):
        self.rank, self.cause = rank, cause
        who = "an unidentified peer" if rank is None else f"rank {rank}"
        super().__init__(f"worker lost: {who} ({cause})")
