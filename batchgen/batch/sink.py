"""Where a batch job's results go while it runs: opened in the process that holds the tokens.

The single-process job opens it in its own process; under backend=dist that is rank 0, a process of its own
(the one-machine launcher forks it, torchrun starts it), so the job hands rank 0 a `JobSink`, a plain
description that pickles, and rank 0 opens it: its own append handle on the results file, the checkpoints of
unfinished requests, the progress bar. Only one process ever writes records, so appends never interleave.
What this run wrote comes back as `SinkCounts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.batch.checkpoint import Checkpointer
from batchgen.batch.output import ResultLog, chat_body, completion_body, success_record
from batchgen.batch.requests import CHAT, Request


@dataclass
class SinkCounts:
    """What one run appended: records, and the tokens of their requests."""

    completed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class JobSink:
    """The requests a run answers (sequence i is todo[i]) and where their records and checkpoints go."""

    output: Path
    todo: list[Request]
    model: str
    fsync: bool = True
    checkpoint_s: float | None = None
    progress: bool | None = None  # None: when stderr is a terminal

    def open(self) -> "OpenSink":
        return OpenSink(self)


class OpenSink:
    """A `JobSink` opened here: `on_finish(ids, tokens)` appends each finished request's record at once,
    `after_run(tokens)` checkpoints the unfinished ones every `checkpoint_s`. A context manager."""

    def __init__(self, sink: JobSink):
        from batchgen.progress import bar

        self.sink = sink
        self.counts = SinkCounts()
        self.log = ResultLog.appending(sink.output, fsync=sink.fsync)
        self.checkpoint = (Checkpointer(sink.output, sink.todo, sink.checkpoint_s, sink.fsync)
                           if sink.checkpoint_s else None)
        self.bar = bar(len(sink.todo), "requests", unit="req", setting=sink.progress, rate=False)
        self.started = time.perf_counter()

    def on_finish(self, ids: np.ndarray, tokens) -> None:
        c = self.counts
        for sid in ids.tolist():
            r = self.sink.todo[sid]
            generated = tokens.generated[sid]
            body = (chat_body if r.url == CHAT else completion_body)(
                custom_id=r.custom_id, model=self.sink.model, created=int(time.time()),
                prompt_ids=r.prompt_ids.tolist(), token_ids=generated, text=tokens.text(sid),
                finish_reason=tokens.finish_reason(sid), return_token_ids=r.return_token_ids)
            self.log.write(success_record(r.custom_id, body))
            c.completed += 1
            c.prompt_tokens += len(r.prompt_ids)
            c.output_tokens += len(generated)
        self.bar.update(ids.size)
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix_str(f"{c.output_tokens / max(elapsed, 1e-9):,.1f} tok/s", refresh=False)

    def after_run(self, tokens) -> None:
        if self.checkpoint is not None:
            self.checkpoint(tokens)

    def close(self) -> None:
        self.bar.close()
        self.log.close()

    def __enter__(self) -> "OpenSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
