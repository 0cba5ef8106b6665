"""When a sequence is done: EOS, a stop token, a stop string in its decoded text, or its token budget.

One `StopChecker` per sequence sees each generated token once, in order. It lives with the sequence (not
with a batch or a device) and holds only plain Python state, so it survives yields, migrations and
recomputes untouched and can be pickled to another process.

Stop strings are matched on text, not tokens, because a tokenizer may spell one stop string with several
tokens or merge it with its neighbours. The text is decoded incrementally over a short window of recent
tokens (the prefix/read offsets of Hugging Face's text-generation-inference), so a token that ends in
the middle of a multi-byte character produces no text until the character completes, and each token
costs a decode of a few tokens rather than of the whole output. Only the new text plus the last
len(longest stop) - 1 characters before it are searched: any match that lay entirely in older text
would already have stopped the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchgen.exec.sampling import SamplingParams

Decode = Callable[[Sequence[int]], str]

EOS = "eos"
STOP_TOKEN = "stop_token"
STOP_STRING = "stop_string"
LENGTH = "length"


@dataclass(frozen=True)
class Finish:
    """Why a sequence ended, and its final text when it was decoded (None otherwise). The text never
    contains the EOS or stop token, nor a matched stop string or anything decoded after it."""

    reason: str
    text: str | None


class _IncrementalText:
    """Text of a growing token list, produced a piece at a time.

    Decoding one token alone is wrong for many tokenizers (SentencePiece drops a leading space at the
    start of a string, byte-level BPE splits characters across tokens), so each step decodes the window
    from `prefix` (start of the last emitted piece, kept as context) and emits what the newest tokens
    added to it, once it no longer ends in an incomplete character.
    """

    def __init__(self, context_ids: Sequence[int] = ()):
        self.ids = list(context_ids)
        self.prefix = 0
        self.read = len(self.ids)
        self.chunks: list[str] = []
        self.length = 0

    def push(self, token_id: int, decode: Decode) -> str:
        self.ids.append(token_id)
        return self._advance(decode, complete_only=True)

    def flush(self, decode: Decode) -> str:
        """Emit whatever the pending tokens decode to, even a partial character: the sequence has ended."""
        return self._advance(decode, complete_only=False) if self.read < len(self.ids) else ""

    def _advance(self, decode: Decode, complete_only: bool) -> str:
        before = decode(self.ids[self.prefix:self.read])
        now = decode(self.ids[self.prefix:])
        if len(now) <= len(before) or (complete_only and now.endswith("\ufffd")):
            return ""
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.chunks.append(delta)
        self.length += len(delta)
        return delta

    def text(self) -> str:
        return "".join(self.chunks)


class StopChecker:
    """Decides, token by token, whether one sequence has finished.

    `eos_token_ids` come from the model config (several for some models). `context_ids` are the last few
    prompt tokens, optional: they let the first generated token decode with its leading space as it would
    inside the full text. Pass `decode` on every call or on none; it is required when the parameters
    have stop strings.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = (),
                 context_ids: Sequence[int] = ()):
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.token_ids: list[int] = []
        self.finish: Finish | None = None
        self._text = _IncrementalText(context_ids)
        self._decoding: bool | None = None
        self._tail_len = max((len(s) for s in params.stop), default=1) - 1
        self._tail = ""

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def text(self) -> str:
        """Text emitted so far (for streaming); O(length), so not for per-token use."""
        return self.finish.text if self.finish and self.finish.text is not None else self._text.text()

    def check(self, token_id: int, step: int, decode: Decode | None = None) -> Finish | None:
        """Record the token generated at `step` (0 for the first, as in `sample`) and return a Finish
        if the sequence ends with it, else None."""
        self._check_call(step, decode)
        self.token_ids.append(token_id)
        reason = self._token_reason(token_id)
        if reason is not None:  # the stop token itself is not text
            if decode is not None:
                self._text.flush(decode)
            return self._end(reason, cut=None)
        at_length = step + 1 >= self.params.max_tokens
        if decode is not None:
            delta = self._text.push(token_id, decode)
            if at_length:
                delta += self._text.flush(decode)
            cut = self._find_stop(delta)
            if cut is not None:
                return self._end(STOP_STRING, cut)
        return self._end(LENGTH, cut=None) if at_length else None

    def _token_reason(self, token_id: int) -> str | None:
        if token_id in self.eos_token_ids:
            return EOS
        return STOP_TOKEN if token_id in self.stop_token_ids else None

    def _check_call(self, step: int, decode: Decode | None) -> None:
        """Catch the caller bugs that would silently corrupt the text: feeding a finished sequence,
        skipping or replaying a step (e.g. after a recompute), or decoding only some tokens."""
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish.reason}); no more tokens expected")
        if step != len(self.token_ids):
            raise ValueError(f"expected step {len(self.token_ids)} (tokens seen so far), got {step}")
        if decode is None and self.params.stop:
            raise ValueError("a decode function is required to match stop strings "
                             f"{list(self.params.stop)}")
        if self._decoding is None:
            self._decoding = decode is not None
        elif self._decoding != (decode is not None):
            raise ValueError("pass decode on every call or on none: the text would miss tokens otherwise")

    def _find_stop(self, delta: str) -> int | None:
        """Character offset in the full text where the earliest stop string starts, if one has completed."""
        if not self.params.stop or not delta:
            return None
        window = self._tail + delta
        window_start = self._text.length - len(window)
        hits = [i for i in (window.find(s) for s in self.params.stop) if i >= 0]
        self._tail = window[-self._tail_len:] if self._tail_len else ""
        return window_start + min(hits) if hits else None

    def _end(self, reason: str, cut: int | None) -> Finish:
        text = self._text.text()[:cut] if self._decoding else None
        self.finish = Finish(reason, text)
        return self.finish
