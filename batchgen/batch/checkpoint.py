"""Tokens of the requests still decoding, saved now and then, so that a resumed job loses little work.

A request killed mid-decode would otherwise restart from its prompt. Its generated tokens are enough to resume
it: prefilling prompt + tokens rebuilds its KV in one batched forward (cheaper than decoding them again), and
its next token is sampled at the same step, with the same seed, as it would have been. The file sits beside the
results (`<output>.partial`), is replaced atomically (write, fsync, rename), and is deleted when the job ends.
Each entry carries a digest of its request (prompt ids and sampling settings): tokens of a request that was
changed in the input since are ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.batch.requests import Request

FORMAT = "batchgen-partial/1"


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


def load_partial(output: Path, todo: list[Request]) -> list[list[int]]:
    """Per request of `todo`, the tokens a previous run generated and saved (empty when none, or stale)."""
    path = partial_path(output)
    try:
        saved = json.loads(path.read_text())
        entries = saved["requests"] if saved.get("format") == FORMAT else {}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        entries = {}  # none yet, or torn by a crash before the rename: start those requests over
    out = []
    for r in todo:
        e = entries.get(r.custom_id) if isinstance(entries, dict) else None
        tokens = e.get("tokens") if isinstance(e, dict) and e.get("digest") == request_digest(r) else None
        ok = (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
              and len(tokens) < r.params.max_tokens)
        out.append(tokens if ok else [])
    return out


@dataclass
class Checkpointer:
    """An `after_run(tokens)` hook for the executor: every `interval_s`, the unfinished requests' tokens."""

    output: Path
    todo: list[Request]
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

    def save(self, tokens) -> None:
        entries = {r.custom_id: {"digest": d, "tokens": tokens.generated[sid]}
                   for sid, (r, d) in enumerate(zip(self.todo, self._digests))
                   if tokens.generated[sid] and tokens.finish_reason(sid) is None}
        path = partial_path(self.output)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "requests": entries}, f, separators=(",", ":"))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self.saves += 1
