"""A batch job end to end: check what can be checked before any work, record every bad line, skip what the
results file already holds, run the rest on the executor and append each result the moment its sequence ends.

The results file is the job's only state: a job killed at any instant is resumed by running the same command
again (nothing is recomputed that was written, and nothing is written twice), and a finished one says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.batch.checkpoint import Checkpointer, load_partial, partial_path
from batchgen.batch.output import ResultLog, chat_body, completion_body, error_record, success_record
from batchgen.batch.requests import CHAT, LineError, ModelInfo, Request, read_requests
from batchgen.exec.models.loading import checkpoint_name
from batchgen.memory import ConfigError

DEMO_HINT = "python -m batchgen.batch.demo DIR writes a small one to try"


@dataclass(frozen=True)
class JobSettings:
    """The `job` section of conf/run.yaml, checked."""

    input: Path
    output: Path
    default_max_tokens: int | None = None
    fsync: bool = True
    progress: bool | None = None  # None: when stderr is a terminal
    seed: int = 0
    checkpoint_s: float | None = 60.0  # save the tokens of requests still decoding this often (None: never)

    @classmethod
    def from_config(cls, job: dict, seed: int = 0) -> "JobSettings":
        for key in ("input", "output"):
            if not job.get(key):
                raise ConfigError(f"job.{key} is not set: python -m batchgen.run +policy=coroutine model.path=DIR "
                                  "job.input=requests.jsonl job.output=results.jsonl")
        src, out = Path(job["input"]).expanduser(), Path(job["output"]).expanduser()
        if not src.is_file():
            raise ConfigError(f"job.input={src}: no such file (an OpenAI batch file: one JSON request per line)")
        try:
            with src.open("rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"job.input={src}: cannot be read ({e.strerror})") from e
        if not out.parent.is_dir():
            raise ConfigError(f"job.output={out}: its directory {out.parent} does not exist; create it first")
        if out.exists() and out.resolve() == src.resolve():
            raise ConfigError(f"job.output is the input file {src}: write the results to another file")
        if out.is_dir():
            raise ConfigError(f"job.output={out} is a directory: give a file name, e.g. {out / 'results.jsonl'}")
        limit = job.get("default_max_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"job.default_max_tokens must be a whole number >= 1 or null, got {limit!r}")
        progress = job.get("progress", "auto")
        if progress not in ("auto", True, False):
            raise ConfigError(f"job.progress must be auto, true or false, got {progress!r}")
        if not isinstance(job.get("fsync", True), bool):
            raise ConfigError(f"job.fsync must be true or false, got {job.get('fsync')!r}")
        every = job.get("checkpoint_s", 60.0)
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or every <= 0):
            raise ConfigError(f"job.checkpoint_s must be a number of seconds > 0, or null (never), got {every!r}")
        return cls(src, out, limit, job.get("fsync", True), None if progress == "auto" else progress, seed,
                   None if every is None else float(every))


@dataclass
class JobSummary:
    requests: int = 0        # non-blank lines of the input
    completed: int = 0       # results written by this run
    failed: int = 0          # error records in the output (bad lines)
    already_done: int = 0    # results the output held before this run
    prompt_tokens: int = 0   # of the requests this run completed
    output_tokens: int = 0
    wall_s: float = 0.0
    output: Path | None = None
    repaired_bytes: int = 0  # a torn last line cut off the results file (a previous run was killed mid-write)
    resumed: int = 0         # requests that continued from the tokens an interrupted run had saved
    resumed_tokens: int = 0

    def format(self) -> str:
        rate = self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0
        lines = [f"{self.requests:,} requests: {self.completed:,} completed now, {self.already_done:,} already in "
                 f"the output, {self.failed:,} failed (error records)",
                 f"tokens in {self.prompt_tokens:,}, tokens out {self.output_tokens:,}, wall time {self.wall_s:.1f} s"
                 + (f" ({rate:,.1f} tokens/s out)" if self.completed else ""),
                 f"results: {self.output}"]
        if self.resumed:
            lines.append(f"({self.resumed:,} requests continued from the {self.resumed_tokens:,} tokens an interrupted "
                         "run had generated)")
        if self.repaired_bytes:
            lines.append(f"(cut a torn last line of {self.repaired_bytes} bytes left by an interrupted run)")
        return "\n".join(lines)


def model_dir(path: Any) -> Path:
    if not path:
        raise ConfigError(f"no model: set model.path=DIR, a Hugging Face directory (config.json, *.safetensors, "
                          f"tokenizer.json); {DEMO_HINT}")
    p = Path(str(path)).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model.path={p}: no such directory ({DEMO_HINT})")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path={p}: no config.json there; a Hugging Face model directory needs one")
    return p


@dataclass
class _Writer:
    """Turns each finished sequence into its output record, appended and flushed at once."""

    log: ResultLog
    todo: list[Request]
    model: str
    summary: JobSummary
    bar: Any = None
    started: float = field(default_factory=time.perf_counter)

    def __call__(self, ids: np.ndarray, tokens) -> None:
        for sid in ids.tolist():
            r = self.todo[sid]
            generated = tokens.generated[sid]
            body = (chat_body if r.url == CHAT else completion_body)(
                custom_id=r.custom_id, model=self.model, created=int(time.time()), prompt_ids=r.prompt_ids.tolist(),
                token_ids=generated, text=tokens.text(sid), finish_reason=tokens.finish_reason(sid),
                return_token_ids=r.return_token_ids)
            self.log.write(success_record(r.custom_id, body))
            self.summary.completed += 1
            self.summary.prompt_tokens += len(r.prompt_ids)
            self.summary.output_tokens += len(generated)
        if self.bar is not None:
            self.bar.update(ids.size)
            elapsed = time.perf_counter() - self.started
            self.bar.set_postfix_str(f"{self.summary.output_tokens / max(elapsed, 1e-9):,.1f} tok/s", refresh=False)


def record_line_errors(log: ResultLog, errors: list[LineError]) -> int:
    """Write the error record of every bad line not yet in the output; returns how many the output now holds."""
    for e in errors:
        if e.line not in log.done_lines:
            log.write(error_record(e.line, e.custom_id, e.code, e.message))
    return len(errors)


def run_batch(settings: JobSettings, model_path: Path, build_job, execute, *, bar_factory=None) -> JobSummary:
    """build_job(workload) -> Job and execute(job, prompts, params, on_finish, resumed, after_run) -> output: the
    caller's executor (single process or distributed) and its settings (see `batchgen.exec.run.execute`).
    bar_factory(total) -> a tqdm-like bar, or None."""
    from batchgen.workload import Workload

    start = time.perf_counter()
    info = ModelInfo.from_dir(model_path)
    summary = JobSummary(output=settings.output)
    with ResultLog(settings.output, fsync=settings.fsync) as log:
        summary.repaired_bytes = log.repaired_bytes
        requests, errors = read_requests(settings.input, info, job_seed=settings.seed,
                                         default_max_tokens=settings.default_max_tokens)
        summary.requests = len(requests) + len(errors)
        summary.failed = record_line_errors(log, errors)
        todo = [r for r in requests if r.custom_id not in log.done_ids]
        summary.already_done = len(requests) - len(todo)
        if todo:
            resumed = load_partial(settings.output, todo)
            summary.resumed = sum(1 for t in resumed if t)
            summary.resumed_tokens = sum(len(t) for t in resumed)
            done_before = np.array([len(t) for t in resumed], dtype=np.int64)
            workload = Workload(f"batch:{settings.input.name}",
                                np.array([len(r.prompt_ids) for r in todo]) + done_before,
                                np.array([r.params.max_tokens for r in todo]) - done_before)
            job = build_job(workload)
            bar = bar_factory(len(todo)) if bar_factory else None
            writer = _Writer(log, todo, checkpoint_name(model_path), summary, bar)
            checkpoint = (Checkpointer(settings.output, todo, settings.checkpoint_s, settings.fsync)
                          if settings.checkpoint_s else None)
            try:
                execute(job, [r.prompt_ids for r in todo], [r.params for r in todo], writer, resumed, checkpoint)
            finally:
                if bar is not None:
                    bar.close()
        partial_path(settings.output).unlink(missing_ok=True)  # every request has its record now
    summary.wall_s = time.perf_counter() - start
    return summary


def executor_cluster(cluster):
    """The executor runs the job as one rank on its device: `cluster` is the estimate's target, and only lends
    the hardware type the planner prices with."""
    return replace(cluster, num_gpus=1, gpus_per_instance=None)
