"""A batch job end to end: check what can be checked before any work, record every bad line, skip what the
results file already holds, run the rest on the executor and append each result the moment its sequence ends.

The results file is the job's only state: a job killed at any instant is resumed by running the same command
again (nothing is recomputed that was written, and nothing is written twice), and a finished one says so. The
checkpoint beside it (checkpoint.py) only saves work: the choices of unwritten requests, ended or not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.batch.checkpoint import load_partial, remove_partial
from batchgen.batch.choices import plan_choices
from batchgen.batch.output import ResultLog, error_record
from batchgen.batch.requests import LineError, ModelInfo, read_requests
from batchgen.batch.sink import JobSink
from batchgen.exec.models.loading import checkpoint_name
from batchgen.memory import ConfigError

DEMO_HINT = "python -m batchgen.batch.demo DIR writes a small one to try"


class JobStopped(RuntimeError):
    """The run stopped part way (backend=dist: a process died or failed); what finished is in the results file,
    and rerunning the command resumes."""


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
    sequences: int = 0       # choices this run decoded (a request with n choices has up to n)
    prefill_tokens_submitted: int = 0  # prompt (+ saved) tokens of those sequences, each prefilled on its own
    prefill_tokens_distinct: int = 0   # the same with every common prefix counted once (a prefix tree's tokens)

    def format(self) -> str:
        rate = self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0
        lines = [f"{self.requests:,} requests: {self.completed:,} completed now, {self.already_done:,} already in "
                 f"the output, {self.failed:,} failed (error records)",
                 f"tokens in {self.prompt_tokens:,}, tokens out {self.output_tokens:,}, wall time {self.wall_s:.1f} s"
                 + (f" ({rate:,.1f} tokens/s out)" if self.completed else ""),
                 f"results: {self.output}"]
        if self.sequences:
            lines.insert(2, f"{self.sequences:,} sequences (choices); prefill tokens submitted "
                            f"{self.prefill_tokens_submitted:,}, distinct {self.prefill_tokens_distinct:,} (every "
                            "shared prefix once)")
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


def record_line_errors(log: ResultLog, errors: list[LineError]) -> int:
    """Write the error record of every bad line not yet in the output; returns how many the output now holds."""
    for e in errors:
        if e.line not in log.done_lines:
            log.write(error_record(e.line, e.custom_id, e.code, e.message))
    return len(errors)


def run_batch(settings: JobSettings, model_path: Path, build_job, execute, *, writes: bool = True,
              page_tokens: int = 1) -> JobSummary:
    """build_job(workload) -> Job and execute(job, prompts, params, resumed, sink) -> SinkCounts: the caller's
    executor, which opens `sink` (`batchgen.batch.sink.JobSink`) in the process that holds the tokens (this one,
    or backend=dist's rank 0) and returns what it wrote there (None when it wrote elsewhere).

    writes=False: this process only learns the remaining requests (a torchrun worker, rank > 0): it reads the
    results file and the checkpoint without changing them, writes no error record, and passes no sink.
    The prompts' shared prefixes are found in their tokens (`discover_prefixes`, whole pages of `page_tokens`): a
    request's n choices, a system prompt or few-shot block before many requests, nested as they are."""
    from batchgen.workload import Workload
    from batchgen.workload.prefixes import discover_prefixes, distinct_prefix_tokens

    start = time.perf_counter()
    info = ModelInfo.from_dir(model_path)
    summary = JobSummary(output=settings.output)
    log = ResultLog(settings.output, fsync=settings.fsync) if writes else ResultLog.read_only(settings.output)
    with log:
        summary.repaired_bytes = log.repaired_bytes
        requests, errors = read_requests(settings.input, info, job_seed=settings.seed,
                                         default_max_tokens=settings.default_max_tokens)
        summary.requests = len(requests) + len(errors)
        summary.failed = record_line_errors(log, errors) if writes else len(errors)
        todo = [r for r in requests if r.custom_id not in log.done_ids]
        summary.already_done = len(requests) - len(todo)
        if todo:
            saved = load_partial(settings.output, todo)
            summary.resumed = sum(1 for s in saved if s)
            summary.resumed_tokens = sum(s.token_count() for s in saved)
            finished = [s.finished for s in saved]
            plan = plan_choices(todo, finished)
            resumed = [saved[c.request].tokens.get(c.index, []) for c in plan]
            prompts = [todo[c.request].prompt_ids for c in plan]
            done_before = np.array([len(t) for t in resumed], dtype=np.int64)
            # what each sequence's prefill reads: its prompt and the tokens an earlier run generated
            contexts = [np.concatenate([p, np.asarray(t, dtype=np.int64)]) if t else p
                        for p, t in zip(prompts, resumed)]
            workload = Workload(f"batch:{settings.input.name}",
                                np.array([len(p) for p in prompts], dtype=np.int64) + done_before,
                                np.array([c.params.max_tokens for c in plan], dtype=np.int64) - done_before,
                                *discover_prefixes(contexts, page_tokens))
            summary.sequences = len(plan)
            summary.prefill_tokens_submitted = int(workload.input_lens.sum())
            if writes:  # only the writer prints a summary
                summary.prefill_tokens_distinct = distinct_prefix_tokens(contexts)
            sink = JobSink(settings.output, todo, checkpoint_name(model_path), settings.fsync, settings.checkpoint_s,
                           settings.progress, plan, finished) if writes else None
            if plan:
                counts = execute(build_job(workload), prompts, [c.params for c in plan], resumed, sink)
            elif sink is not None:  # every choice had ended before: write the records the killed run did not
                with sink.open() as out:
                    counts = out.counts
            else:
                counts = None
            if counts is not None:
                summary.completed = counts.completed
                summary.prompt_tokens, summary.output_tokens = counts.prompt_tokens, counts.output_tokens
        if writes:
            remove_partial(settings.output)  # every request has its record now
    summary.wall_s = time.perf_counter() - start
    return summary


def executor_cluster(cluster, procs: int = 1):
    """The executor runs the job as one instance of `procs` ranks (backend=exec: one, on its device; backend=dist:
    one process each): `cluster` is the estimate's target, and only lends the hardware type the planner prices
    with."""
    return replace(cluster, num_gpus=procs, gpus_per_instance=None)
