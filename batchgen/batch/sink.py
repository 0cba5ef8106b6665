"""Where a batch job's results go while it runs: opened in the process that holds the tokens.

The single-process job opens it in its own process; under backend=dist that is rank 0, a process of its own
(the one-machine launcher forks it, torchrun starts it), so the job hands rank 0 a `JobSink`, a plain
description that pickles, and rank 0 opens it: its own append handle on the results file, the checkpoints of
unfinished requests, the progress bar. Only one process ever writes records, so appends never interleave.
What this run wrote comes back as `SinkCounts`.

A run's sequences are choices (batchgen/batch/choices.py): a request's record is written when the last of its
choices ends, with the choices an interrupted run had finished (`finished`) in their places.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.batch.checkpoint import Checkpointer
from batchgen.batch.choices import Choice
from batchgen.batch.output import Generated, ResultLog, answer_body, success_record
from batchgen.batch.requests import CHAT, Request


@dataclass
class SinkCounts:
    """What one run appended: records, and the tokens of their requests (the prompt once per request, the
    completions of every choice)."""

    completed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class JobSink:
    """The requests a run answers, its sequences (sequence i is plan[i], a choice of todo[plan[i].request]), the
    choices a previous run finished (per request of todo) and where records and checkpoints go."""

    output: Path
    todo: list[Request]
    model: str
    fsync: bool = True
    checkpoint_s: float | None = None
    progress: bool | None = None  # None: when stderr is a terminal
    plan: list[Choice] = field(default_factory=list)
    finished: list[dict[int, Generated]] = field(default_factory=list)

    def open(self) -> "OpenSink":
        return OpenSink(self)


class OpenSink:
    """A `JobSink` opened here: `on_finish(ids, tokens)` notes each ended choice and appends a request's record the
    moment its last choice ends, `after_run(tokens)` checkpoints the unfinished ones every `checkpoint_s`. A
    context manager; opening it writes the record of any request whose choices had all ended before."""

    def __init__(self, sink: JobSink):
        from batchgen.progress import bar

        self.sink = sink
        self.counts = SinkCounts()
        self.pending: dict[int, dict[int, Generated]] = {j: dict(f) for j, f in enumerate(sink.finished) if f}
        self.log = ResultLog.appending(sink.output, fsync=sink.fsync)
        self.checkpoint = (Checkpointer(sink.output, sink.todo, sink.plan, self.pending, sink.checkpoint_s,
                                        sink.fsync) if sink.checkpoint_s else None)
        self.bar = bar(len(sink.todo), "requests", unit="req", setting=sink.progress, rate=False)
        self.started = time.perf_counter()
        for j in [j for j, done in self.pending.items() if len(done) == sink.todo[j].n]:
            self._write(j)

    def _write(self, j: int) -> None:
        r, done = self.sink.todo[j], self.pending.pop(j)
        choices = [done[i] for i in range(r.n)]
        body = answer_body(chat=r.url == CHAT, custom_id=r.custom_id, model=self.sink.model,
                           created=int(time.time()), prompt_ids=r.prompt_ids.tolist(), choices=choices,
                           return_token_ids=r.return_token_ids)
        self.log.write(success_record(r.custom_id, body))
        c = self.counts
        c.completed += 1
        c.prompt_tokens += len(r.prompt_ids)
        c.output_tokens += sum(len(g.token_ids) for g in choices)
        self.bar.update(1)

    def on_finish(self, ids: np.ndarray, tokens) -> None:
        for sid in ids.tolist():
            choice = self.sink.plan[sid]
            done = self.pending.setdefault(choice.request, {})
            done[choice.index] = Generated(list(tokens.generated[sid]), tokens.text(sid), tokens.finish_reason(sid))
            if len(done) == self.sink.todo[choice.request].n:
                self._write(choice.request)
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix_str(f"{self.counts.output_tokens / max(elapsed, 1e-9):,.1f} tok/s", refresh=False)

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
