"""Tokens of the requests still decoding, saved now and then, so that a resumed job loses little work.

A request killed mid-decode would otherwise restart from its prompt. Its generated tokens are enough to resume
it: prefilling prompt + tokens rebuilds its KV in one batched forward (cheaper than decoding them again), and
its next token is sampled at the same step, with the same seed, as it would have been. The file sits beside the
results (`<output>.partial`), is replaced atomically (write, fsync, rename), and is deleted when the job ends.
Each entry carries a digest of its request (prompt ids and sampling settings): tokens of a request that was
changed in the input since are ignored.

A request with n choices gets its record when its last choice ends; until then the checkpoint keeps every
choice: the tokens of those still decoding, and the tokens, text and finish reason of those that ended, which a
resumed job does not run again (their record is what the interrupted run would have written). An entry is
{"digest": ..., "choices": {"<index>": {"tokens": [...]}, "<index>": {"tokens": [...], "finish_reason": ...,
"text": ...}}}; the first format's {"digest": ..., "tokens": [...]} reads as choice 0 still decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.batch.choices import Choice
from batchgen.batch.output import Generated, openai_finish_reason
from batchgen.batch.requests import Request

FORMAT = "batchgen-partial/2"
READABLE = ("batchgen-partial/1", FORMAT)


def request_digest(r: Request) -> str:
    h = hashlib.sha256(r.prompt_ids.tobytes())
    h.update(repr(r.params).encode())
    return h.hexdigest()[:32]


def partial_path(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def remove_partial(output: Path) -> None:
    """The checkpoint, and a temporary copy a kill mid-save left, once every request has its record."""
    path = partial_path(output)
    for p in (path, path.with_name(path.name + ".tmp")):
        p.unlink(missing_ok=True)


@dataclass
class Saved:
    """What a previous run saved of one request: tokens of choices still decoding, and choices that ended."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, Generated] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished)

    def token_count(self) -> int:
        return sum(map(len, self.tokens.values())) + sum(len(g.token_ids) for g in self.finished.values())


def _tokens(value, limit: int) -> list[int] | None:
    ok = isinstance(value, list) and all(type(t) is int for t in value) and len(value) <= limit
    return value if ok else None


def _finished(e: dict, tokens: list[int]) -> Generated | None:
    reason, text = e.get("finish_reason"), e.get("text")
    try:
        openai_finish_reason(reason)
    except ValueError:
        return None
    return Generated(tokens, text, reason) if text is None or isinstance(text, str) else None


def _saved(entry, r: Request) -> Saved:
    """One request's entry, every part checked (anything odd: that choice starts over)."""
    out = Saved()
    if not isinstance(entry, dict) or entry.get("digest") != request_digest(r):
        return out
    choices = entry.get("choices", {"0": {"tokens": entry.get("tokens")}})
    if not isinstance(choices, dict):
        return out
    for key, e in choices.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else -1
        if not 0 <= index < r.n or not isinstance(e, dict):
            continue
        tokens = _tokens(e.get("tokens"), r.params.max_tokens)
        if tokens is None:
            continue
        if "finish_reason" in e:
            done = _finished(e, tokens)
            if done is not None:
                out.finished[index] = done
        elif tokens and len(tokens) < r.params.max_tokens:
            out.tokens[index] = tokens
    return out


def load_partial(output: Path, todo: list[Request]) -> list[Saved]:
    """Per request of `todo`, what a previous run saved of it (empty when nothing, or stale)."""
    path = partial_path(output)
    try:
        saved = json.loads(path.read_text())
        entries = saved["requests"] if saved.get("format") in READABLE else {}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        entries = {}  # none yet, or torn by a crash before the rename: start those requests over
    if not isinstance(entries, dict):
        entries = {}
    return [_saved(entries.get(r.custom_id), r) for r in todo]


@dataclass
class Checkpointer:
    """An `after_run(tokens)` hook for the executor: every `interval_s`, the unfinished requests' choices.

    Sequence i is `plan[i]`; `pending` (request index -> choice index -> Generated) holds the ended choices of
    requests whose record is not written yet: the sink's own dict, read at each save."""

    output: Path
    todo: list[Request]
    plan: Sequence[Choice]
    pending: dict[int, dict[int, Generated]]
    interval_s: float
    fsync: bool = True
    saves: int = 0
    _next: float = field(default=0.0, init=False)
    _digests: list[str] = field(default_factory=list, init=False)

    def __post_init__(self):
        self._next = time.monotonic() + self.interval_s
        self._digests = [request_digest(r) for r in self.todo]

    def __call__(self, tokens) -> None:
        if time.monotonic() < self._next:
            return
        self.save(tokens)
        self._next = time.monotonic() + self.interval_s

    def _entry(self, entries: dict, j: int) -> dict:
        r = self.todo[j]
        if r.custom_id not in entries:
            entries[r.custom_id] = {"digest": self._digests[j], "choices": {}}
        return entries[r.custom_id]["choices"]

    def save(self, tokens) -> None:
        entries: dict = {}
        for sid, c in enumerate(self.plan):
            if tokens.generated[sid] and tokens.finish_reason(sid) is None:
                self._entry(entries, c.request)[str(c.index)] = {"tokens": tokens.generated[sid]}
        for j, done in self.pending.items():
            for i, g in done.items():
                self._entry(entries, j)[str(i)] = {"tokens": list(g.token_ids), "finish_reason": g.finish_reason,
                                                   "text": g.text}
        path = partial_path(self.output)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "requests": entries}, f, separators=(",", ":"))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self.saves += 1
