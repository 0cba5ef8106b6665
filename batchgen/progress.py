"""Progress bars (tqdm) for long simulator runs, executor runs and workload sampling, on stderr.

Shown when stderr is a terminal, unless a setting says otherwise (`output.progress: true | false | auto`) or the
environment does (BATCHGEN_PROGRESS=1 forces them on, 0 off; a setting of true/false wins over it). A bar
appears only once its job has taken `DELAY_S` (a tiny job shows nothing) and redraws at most every
`MININTERVAL_S`. Callers that update per step should still update the bar rarely (see `Throttle`): a disabled bar
costs a method call, an enabled one a clock read.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

ENV = "BATCHGEN_PROGRESS"
DELAY_S = 1.5        # show nothing before a job has run this long
MININTERVAL_S = 0.5  # redraw at most this often
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def enabled(setting: Any = "auto", stream: TextIO | None = None) -> bool:
    """Whether to show progress: `setting` True/False decides; "auto"/None: BATCHGEN_PROGRESS when set, else
    whether `stream` (stderr) is a terminal."""
    if isinstance(setting, bool):
        return setting
    if setting is not None and str(setting).lower() != "auto":
        raise ValueError(f"output.progress must be auto, true or false, got {setting!r}")
    env = os.environ.get(ENV, "").strip().lower()
    if env in ON:
        return True
    if env in OFF:
        return False
    if env:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 1 (progress bars on) or 0 (off)")
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


# A bar without tqdm's own rate (requests/s): the executor's bars show tokens/s, their caller's postfix, instead.
NO_RATE = "{l_bar}{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]"


def bar(total: float | None, desc: str, unit: str = "it", *, setting: Any = "auto", delay: float | None = None,
        stream: TextIO | None = None, rate: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar over `total` on stderr, disabled (a cheap no-op) when `enabled(setting)` is false.
    `delay`: seconds before it first shows (default DELAY_S). `rate`: False drops tqdm's units/s (the caller
    shows its own rate, tokens/s, as the postfix)."""
    stream = sys.stderr if stream is None else stream
    if not rate:
        kwargs.setdefault("bar_format", NO_RATE)
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not enabled(setting, stream),
                mininterval=MININTERVAL_S, delay=DELAY_S if delay is None else delay, dynamic_ncols=True,
                leave=False, **kwargs)


class Throttle:
    """For per-step callbacks: `due()` is true at most every `interval` seconds (one clock read per call)."""

    def __init__(self, interval: float = MININTERVAL_S):
        self.interval = interval
        self.next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.interval
        return True


class FinishProgress:
    """An `on_finish(ids, tokens)` observer for the executor (batchgen.exec.run.execute): requests finished /
    `total`, and the tokens per second finished requests generated since the first finished (the model's build
    and the prompts' prefill come before it), in place of tqdm's requests per second."""

    def __init__(self, total: int, desc: str, setting: Any = "auto", stream: TextIO | None = None):
        self.bar = bar(total, desc, unit="req", setting=setting, stream=stream, rate=False)
        self.tokens, self.first = 0, None

    @property
    def active(self) -> bool:
        return not self.bar.disable

    def __call__(self, ids, tokens) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.tokens += sum(len(tokens.generated[int(i)]) for i in ids)
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.first, 1e-9):,.0f} tok/s", refresh=False)
        self.bar.update(len(ids))

    def close(self) -> None:
        self.bar.close()
