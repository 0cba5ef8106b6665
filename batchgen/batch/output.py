"""The results file of a batch job, in the OpenAI Batch API output format, and the records that go in it.

The file is the job's only durable state: a job killed at any instant (SIGKILL, OOM killer, a preempted
node) is resumed by running it again with the same arguments, and the requests already answered in the
file are skipped. That works because of three properties kept here:

* every record is appended with a single `os.write` of the whole line, newline included, on a file opened
  with O_APPEND, and (by default) fsynced before `write` returns, so a kill can tear only the last line and
  a record that `write` returned for survives a power loss too;
* reopening cuts a torn last line off, so the next record starts on a fresh line; any other line that does
  not parse means the file is not ours (or was damaged by something else), and we refuse to touch it;
* record ids are derived from the request (its custom_id, or its input line number for an error), not drawn
  at random, so a resumed job writes byte for byte what an uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class OutputFileError(ValueError):
    """The results file exists but holds a line that is not a record, so it cannot be resumed."""


def _hex(kind: str, *parts: object, n: int) -> str:
    """`n` hex digits that depend only on `kind` and `parts` (the same request always gets the same ids)."""
    key = "\0".join([kind, *(str(p) for p in parts)])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:n]


# ---------------------------------------------------------------------------------------------------------
# Records


def success_record(custom_id: str, body: dict) -> dict:
    """The output line of a request that was answered; `body` is a Completion or ChatCompletion object."""
    return {
        "id": f"batch_req_{_hex('batch_req', custom_id, n=24)}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": _hex("request", custom_id, n=32), "body": body},
        "error": None,
    }


def error_record(line: int, custom_id: str | None, code: str, message: str) -> dict:
    """The output line of an input line that could not be run. `line` (1-based input line number) is kept in
    the error because a bad line may have no readable custom_id, and it is what a resumed job skips by."""
    return {
        "id": f"batch_req_{_hex('batch_err', line, custom_id, n=24)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": line},
    }


# batchgen/exec/stopping.py's EOS, STOP_TOKEN, STOP_STRING, LENGTH, spelled out rather than imported: that
# module pulls in torch, and this one is imported by light tools (and a SIGKILL test) that should not wait
# seconds for it. tests/batch/test_output.py checks the two agree.
_FINISH = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length"}


def openai_finish_reason(reason: str) -> str:
    """batchgen's finish reasons (batchgen/exec/stopping.py) as OpenAI's: "stop" or "length". OpenAI's own
    two values pass through unchanged, so mapping twice is harmless."""
    if reason in _FINISH:
        return _FINISH[reason]
    if reason == "stop":
        return reason
    raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(_FINISH)}")


@dataclass(frozen=True)
class Generated:
    """One choice of an answer: its tokens, its text (None without a tokenizer) and batchgen's finish reason."""

    token_ids: Sequence[int]
    text: str | None
    finish_reason: str


def _usage(prompt_ids: Sequence[int], choices: Sequence[Generated]) -> dict:
    """As OpenAI counts n choices: the prompt once, the completions of every choice summed."""
    completion = sum(len(g.token_ids) for g in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _choice(chat: bool, index: int, g: Generated, prompt_ids: Sequence[int], return_token_ids: bool) -> dict:
    text = g.text or ""
    content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    choice = {"index": index, **content, "logprobs": None, "finish_reason": openai_finish_reason(g.finish_reason)}
    if return_token_ids:  # vLLM's convention for returning token ids in an OpenAI response: on the choice
        choice["token_ids"] = [int(t) for t in g.token_ids]
        choice["prompt_token_ids"] = [int(t) for t in prompt_ids]
    return choice


def answer_body(*, chat: bool, custom_id: str, model: str, created: int, prompt_ids: Sequence[int],
                choices: Sequence[Generated], return_token_ids: bool) -> dict:
    """An OpenAI ChatCompletion (chat) or Completion object with one choice per element of `choices`, in order
    (`choices[i].index` == i). A choice without text (a model without a tokenizer) has text "", and only its
    token ids (if asked for) carry the answer."""
    prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{_hex(prefix, custom_id, n=32)}", "object": obj, "created": created, "model": model,
            "choices": [_choice(chat, i, g, prompt_ids, return_token_ids) for i, g in enumerate(choices)],
            "usage": _usage(prompt_ids, choices)}


def _one(chat: bool, *, text: str | None, token_ids: Sequence[int], finish_reason: str, **fields) -> dict:
    return answer_body(chat=chat, choices=[Generated(token_ids, text, finish_reason)], **fields)


def completion_body(*, text: str | None, **fields) -> dict:
    """A one-choice Completion object (the answer to /v1/completions). `fields`: custom_id, model, created,
    prompt_ids, token_ids, finish_reason (batchgen's), return_token_ids."""
    return _one(False, text=text, **fields)


def chat_body(*, text: str | None, **fields) -> dict:
    """A one-choice ChatCompletion object (the answer to /v1/chat/completions); see `completion_body`."""
    return _one(True, text=text, **fields)


def encode_record(record: dict) -> bytes:
    """One output line, newline included: compact JSON, non-ASCII text kept as UTF-8."""
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------------------
# The file


class ResultLog:
    """Append-only JSONL results file that survives SIGKILL at any instant.

    Opening an existing file reads it once to learn what is already done (`done_ids`, `done_lines`) and to
    cut a torn last line off (`repaired_bytes`); `write` then appends one record per call.
    """

    def __init__(self, path: str | Path, *, fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync
        self.done_ids: set[str] = set()
        self.done_lines: set[int] = set()
        self.records = 0  # records in the file when it was opened (after repair)
        self.written = 0  # records appended since
        self.repaired_bytes = 0
        created = not self.path.exists()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if created:
                self._sync_dir()  # so the file itself (not only its contents) survives a power loss
            else:
                self._load_and_repair()
        except BaseException:
            self.close()
            raise

    @classmethod
    def appending(cls, path: str | Path, *, fsync: bool = True) -> ResultLog:
        """A second handle on a file another handle opened (and repaired) already: appends only, reads nothing
        (`done_ids` and `done_lines` stay empty). The process that writes the records of a backend=dist job,
        rank 0, opens the results file this way."""
        return cls._handle(path, fsync, os.open(path, os.O_WRONLY | os.O_APPEND))

    @classmethod
    def _handle(cls, path: str | Path, fsync: bool, fd: int | None) -> ResultLog:
        """A log on `fd` that has read nothing yet."""
        log = cls.__new__(cls)
        log.path, log.fsync, log._fd = Path(path), fsync, fd
        log.done_ids, log.done_lines = set(), set()
        log.records = log.written = log.repaired_bytes = 0
        return log

    def _load_and_repair(self) -> None:
        good_end = self._load()
        size = self.path.stat().st_size
        if good_end < size:  # only the last line can be bad here: a write torn by a kill
            self.repaired_bytes = size - good_end
            os.ftruncate(self._fd, good_end)
            os.fsync(self._fd)

    def _load(self) -> int:
        """Note every record of the file (`_note`, `records`); the byte offset past the last good line. A bad
        line other than the last one: refused (`_refuse`)."""
        good_end = 0  # byte offset just past the last line that parsed
        bad: tuple[int, str] | None = None  # (line number, why) of the first line that did not
        number = 0
        with open(self.path, "rb") as f:
            for raw in f:
                number += 1
                if bad is not None:  # a bad line followed by another line: not a torn tail
                    self._refuse(*bad)
                record, why = _parse(raw)
                if record is None:
                    bad = (number, why)
                    continue
                self._note(record)
                self.records += 1
                good_end += len(raw)
        return good_end

    @classmethod
    def read_only(cls, path: str | Path) -> ResultLog:
        """What a results file holds (`done_ids`, `done_lines`), read without changing it (a torn last line is
        skipped, not cut) and without a handle to write with: a torchrun worker learns the job's remaining
        requests this way while rank 0 opens the file for writing."""
        log = cls._handle(path, False, None)
        if log.path.exists():
            log._load()
        return log

    def _refuse(self, number: int, why: str) -> None:
        raise OutputFileError(
            f"{self.path}: line {number} is not a batch result record ({why}), and it is not the last line, "
            f"so this is not a results file a killed job left behind. Move the file away (or choose another "
            f"job.output) and run the job again.")

    def _note(self, record: dict) -> None:
        if record.get("response") is not None and isinstance(record.get("custom_id"), str):
            self.done_ids.add(record["custom_id"])
        error = record.get("error")
        if isinstance(error, dict) and isinstance(error.get("line"), int):
            self.done_lines.add(error["line"])

    def _sync_dir(self) -> None:
        if not self.fsync:
            return
        try:
            fd = os.open(self.path.parent if str(self.path.parent) else ".", os.O_RDONLY)
        except OSError:  # e.g. a platform that cannot open directories; the data itself is still fsynced
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def write(self, record: dict) -> None:
        """Append one record as one line; when this returns the line is in the file (and on disk if fsync)."""
        if self._fd is None:
            raise ValueError(f"{self.path}: write to a closed ResultLog")
        data = encode_record(record)
        written = os.write(self._fd, data)
        while written < len(data):  # a regular file takes it whole except on a full disk; finish or fail loudly
            n = os.write(self._fd, data[written:])
            if n == 0:
                raise OSError(f"{self.path}: could not write a whole record (disk full?)")
            written += n
        if self.fsync:
            os.fsync(self._fd)
        self.written += 1
        self._note(record)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> ResultLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse(raw: bytes) -> tuple[dict | None, str]:
    """A line's record, or None and why not. A line without its newline is never trusted: the write that
    produced it was cut short, even if what is left happens to parse."""
    if not raw.endswith(b"\n"):
        return None, "no newline at its end"
    try:
        record = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both
        return None, f"not JSON: {e}"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    return record, ""
