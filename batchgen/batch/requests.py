"""An OpenAI Batch API input file read into requests the executor can run, and one error per bad line.

Every non-blank line of the file becomes exactly one `Request` or one `LineError` (blank lines are skipped but
still counted, so line numbers are the file's). A line is
{"custom_id": str, "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}:

* completions: `body.prompt` is a text (encoded with the tokenizer's special tokens, as vLLM does) or a list
  of token ids in [0, vocab_size); a one-element list of either is accepted too;
* chat: `body.messages` is rendered with the model's chat template (chat.py) and encoded WITHOUT adding
  special tokens again (the template wrote them).

Per-request parameters: n (choices of the same prompt, 1 to MAX_N; batchgen/batch/choices.py), max_tokens (chat
also max_completion_tokens, preferred when both are given),
temperature, top_p, top_k (-1 means off, as in vLLM), seed, stop (a string or a list of strings),
stop_token_ids (vLLM's extension), ignore_eos (default false: the request ends at EOS), return_token_ids.
null counts as absent. Keys we do not know (model, user, metadata, ...) are ignored; keys that ask for
something this engine does not do (stream, logprobs, echo, best_of > 1, penalties, logit_bias,
suffix, tools, a non-text response_format, ...) are unsupported_parameter errors rather than silently
producing something else.

max_tokens when absent: the job's `default_max_tokens` if given, else OpenAI's default (16 for completions;
the rest of the context for chat), in both cases cut to the context left after the prompt. An explicit
max_tokens is never cut: prompt + max_tokens > max_context is a prompt_too_long error.

Seeds: a request without a seed gets one derived from (job_seed, custom_id) (`derive_seed`), so its tokens do
not depend on its sequence id, batch or position: a resumed job (fewer sequences, other ids) draws exactly
what an uninterrupted one would have.

Duplicate custom_ids: the first line with a given custom_id wins, whether it is a good line or an error;
every later line with it is a duplicate_custom_id error naming that first line and the id, whose record has a
null custom_id (like a line whose custom_id cannot be read): a results file holds one record per custom_id,
so a reader that keys records by custom_id never finds an error and a success under one id.

Error codes (LineError.code), each message a sentence starting with "line N: " that names the field and the fix:

  invalid_json           the line is not JSON, not UTF-8, or not a JSON object
  missing_field          custom_id, method, url, body, body.prompt or body.messages is absent
  invalid_method         method is not "POST"
  invalid_url            url is neither /v1/completions nor /v1/chat/completions
  invalid_parameter      a field has the wrong type or value (custom_id, body, prompt, messages, a sampling
                         parameter, token ids out of the vocabulary, an empty prompt, messages the chat
                         template rejects)
  unsupported_parameter  a parameter this engine cannot honour (see above)
  duplicate_custom_id    custom_id already used by an earlier line
  prompt_too_long        the prompt does not fit the context, or prompt + max_tokens exceeds it
  no_tokenizer           a text prompt, chat messages or stop strings, but the model directory has no tokenizer
  no_chat_template       a chat request, but the model directory has no chat template
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.batch.chat import (CHATML, MessageError, load_chat_template, read_tokenizer_config, render_chat,
                                 special_token)
from batchgen.exec.sampling import SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)

ERROR_CODES = ("invalid_json", "missing_field", "invalid_method", "invalid_url", "invalid_parameter",
               "unsupported_parameter", "duplicate_custom_id", "prompt_too_long", "no_tokenizer",
               "no_chat_template")

OPENAI_COMPLETIONS_MAX_TOKENS = 16
MAX_N = 128  # OpenAI's own limit on choices per request
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class ModelInfo:
    """What parsing needs to know about the model (built once per job)."""

    vocab_size: int
    max_context: int  # positions the model allows (prompt + output)
    tokenizer: Any | None  # tokenizers.Tokenizer, or None: text prompts, chat and stop strings are line errors
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelInfo":
        """From config.json (required), tokenizer.json, tokenizer_config.json and chat_template.jinja
        (all optional). Raises ModelLoadError / ValueError for files that exist but cannot be read."""
        from batchgen.exec.models import load_tokenizer
        from batchgen.exec.models.loading import read_config

        path = Path(path)
        config = read_config(path)
        tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
        tok_config = read_tokenizer_config(path)
        return cls(vocab_size=config.vocab_size, max_context=config.max_position_embeddings, tokenizer=tokenizer,
                   chat_template=load_chat_template(path, tok_config),
                   bos_token=special_token(tok_config.get("bos_token")),
                   eos_token=special_token(tok_config.get("eos_token")))

    @classmethod
    def approximate(cls, vocab_size: int, max_context: int) -> "ModelInfo":
        """For estimates without the model directory: guessed token counts and a ChatML template."""
        return cls(vocab_size=vocab_size, max_context=max_context, tokenizer=ApproximateTokenizer(),
                   chat_template=CHATML)


class ApproximateTokenizer:
    """Token counts without a tokenizer (an estimate made without the model directory): about 4 bytes of UTF-8
    text a token, the usual ratio of English text for BPE vocabularies of 32K-150K tokens."""

    BYTES_PER_TOKEN = 4

    class _Encoding:
        def __init__(self, n: int):
            self.ids = [0] * n

    def encode_batch(self, texts, add_special_tokens: bool = True):
        return [self._Encoding(max(1, -(-len(t.encode("utf-8")) // self.BYTES_PER_TOKEN))) for t in texts]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 1


@dataclass(frozen=True)
class Request:
    line: int  # 1-based line number in the input file
    custom_id: str
    url: str  # COMPLETIONS or CHAT
    prompt_ids: np.ndarray  # int64, >= 1 token, read-only
    params: SamplingParams  # max_tokens resolved; seed always set (choice 0's; choices.py derives the others')
    return_token_ids: bool
    n: int = 1  # choices: sequences of this prompt, each with its own seed


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None  # when the line had a readable one
    code: str  # one of ERROR_CODES
    message: str  # a sentence starting with f"line {line}: "


def derive_seed(job_seed: int, custom_id: str) -> int:
    """A stable 63-bit seed for a request without one: the first 8 bytes of sha256(job_seed, custom_id)."""
    digest = hashlib.sha256(f"{job_seed}\0{custom_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


# -------------------------------------------------------------------------------------------- checking


class _Bad(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Pending:
    """A line whose fields passed the checks; waiting for its text to be encoded (text is None: ids known)."""

    line: int
    custom_id: str
    url: str
    text: str | None
    add_special_tokens: bool
    ids: np.ndarray | None
    max_tokens: int | None  # explicit
    kwargs: dict  # SamplingParams' keyword arguments, and n
    return_token_ids: bool


def _nonzero(v) -> bool:
    return v is not None and v != 0


# body key -> (is the value asking for something we do not do?, what to tell the user)
_UNSUPPORTED = {
    "best_of": (lambda v: v is not None and v != 1, "only best_of=1 is supported; remove it"),
    "stream": (lambda v: bool(v), "streaming is not supported in a batch; remove it"),
    "logprobs": (lambda v: v is not None and v is not False, "log probabilities are not returned; remove it"),
    "top_logprobs": (_nonzero, "log probabilities are not returned; remove it"),
    "echo": (lambda v: bool(v), "echoing the prompt is not supported; remove it"),
    "presence_penalty": (_nonzero, "penalties are not supported; remove it or set it to 0"),
    "frequency_penalty": (_nonzero, "penalties are not supported; remove it or set it to 0"),
    "repetition_penalty": (lambda v: v is not None and v != 1, "penalties are not supported; remove it or set it to 1"),
    "logit_bias": (lambda v: bool(v), "logit_bias is not supported; remove it"),
    "min_p": (_nonzero, "min_p is not supported; use top_p or top_k"),
    "min_tokens": (_nonzero, "min_tokens is not supported; remove it"),
    "suffix": (lambda v: bool(v), "suffix (insertion) is not supported; remove it"),
    "tools": (lambda v: bool(v), "tool calling is not supported; remove it"),
    "functions": (lambda v: bool(v), "function calling is not supported; remove it"),
    "response_format": (lambda v: v is not None and not (isinstance(v, dict) and v.get("type", "text") == "text"),
                        "structured output is not supported; remove it or use {\"type\": \"text\"}"),
}
_UNSUPPORTED_KEYS = frozenset(_UNSUPPORTED)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_unsupported(body: dict) -> None:
    for key in _UNSUPPORTED_KEYS & body.keys():
        test, hint = _UNSUPPORTED[key]
        try:
            bad = test(body[key])
        except Exception:  # an odd value that cannot even be compared: certainly not the harmless default
            bad = True
        if bad:
            raise _Bad("unsupported_parameter", f"body.{key}={json.dumps(body[key])[:60]} is not supported: {hint}")


def _token_ids(value: list, field: str, model: ModelInfo) -> np.ndarray:
    if not all(type(t) is int for t in value):
        bad = next(t for t in value if type(t) is not int)
        raise _Bad("invalid_parameter", f"{field} must hold integer token ids, found {json.dumps(bad)[:40]}")
    try:
        ids = np.array(value, dtype=np.int64)
    except OverflowError:
        raise _Bad("invalid_parameter", f"{field} holds a token id outside [0, {model.vocab_size})") from None
    if ids.size and (ids.min() < 0 or ids.max() >= model.vocab_size):
        bad = int(ids[(ids < 0) | (ids >= model.vocab_size)][0])
        raise _Bad("invalid_parameter", f"{field} holds token id {bad}, outside the model's vocabulary "
                                        f"[0, {model.vocab_size})")
    return ids


def _prompt(body: dict, model: ModelInfo) -> tuple[str | None, np.ndarray | None]:
    if "prompt" not in body or body["prompt"] is None:
        raise _Bad("missing_field", "body.prompt is missing: give a text or a list of token ids")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise _Bad("invalid_parameter", "body.prompt is empty: give a non-empty text or token ids")
        if model.tokenizer is None:
            raise _Bad("no_tokenizer", "body.prompt is a text but the model directory has no tokenizer.json: "
                                       "give the prompt as a list of token ids, or add the tokenizer")
        return prompt, None
    if isinstance(prompt, list):
        if not prompt:
            raise _Bad("invalid_parameter", "body.prompt is empty: give a non-empty text or token ids")
        if all(isinstance(p, (str, list)) for p in prompt):
            raise _Bad("unsupported_parameter", "body.prompt is a list of several prompts: write one line per "
                                                "prompt, each with its own custom_id")
        return None, _token_ids(prompt, "body.prompt", model)
    raise _Bad("invalid_parameter", f"body.prompt must be a text or a list of token ids, got {type(prompt).__name__}")


def _chat_text(body: dict, model: ModelInfo) -> str:
    if "messages" not in body or body["messages"] is None:
        raise _Bad("missing_field", 'body.messages is missing: give a list like [{"role": "user", "content": "..."}]')
    if model.tokenizer is None:
        raise _Bad("no_tokenizer", "chat requests need a tokenizer but the model directory has no tokenizer.json: "
                                   "add it, or send /v1/completions lines with token-id prompts")
    if model.chat_template is None:
        raise _Bad("no_chat_template", "chat requests need a chat template but the model directory has none: add "
                                       "chat_template to tokenizer_config.json (or a chat_template.jinja file), or "
                                       "send /v1/completions lines")
    try:
        return render_chat(model.chat_template, body["messages"], bos_token=model.bos_token,
                           eos_token=model.eos_token)
    except MessageError as e:
        raise _Bad(e.code, str(e)) from None


def _sampling_kwargs(body: dict, model: ModelInfo) -> tuple[int | None, dict, bool]:
    get = body.get
    kwargs: dict = {}
    for key in ("temperature", "top_p", "seed", "ignore_eos"):
        v = get(key)
        if v is not None:
            kwargs[key] = v
    top_k = get("top_k")
    if top_k is not None:
        kwargs["top_k"] = 0 if top_k == -1 and _is_int(top_k) else top_k
    stop = get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _Bad("invalid_parameter", f"body.stop must be a non-empty string or a list of them, "
                                            f"got {json.dumps(get('stop'))[:60]}")
        if stop and model.tokenizer is None:
            raise _Bad("no_tokenizer", "body.stop needs a tokenizer to match text but the model directory has no "
                                       "tokenizer.json: remove stop, or use stop_token_ids")
        kwargs["stop"] = tuple(stop)
    stop_ids = get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise _Bad("invalid_parameter", "body.stop_token_ids must be a list of token ids")
        kwargs["stop_token_ids"] = tuple(int(t) for t in _token_ids(stop_ids, "body.stop_token_ids", model))
    max_tokens = get("max_completion_tokens")
    field = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, field = get("max_tokens"), "max_tokens"
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise _Bad("invalid_parameter", f"body.{field} must be an integer >= 1, got {json.dumps(max_tokens)[:40]}")
    n = get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise _Bad("invalid_parameter", f"body.n must be an integer from 1 to {MAX_N} (choices of this prompt), got "
                                        f"{json.dumps(n)[:40]}: write more lines for more samples")
    kwargs["n"] = 1 if n is None else n
    ret = get("return_token_ids")
    if ret is not None and not isinstance(ret, bool):
        raise _Bad("invalid_parameter", f"body.return_token_ids must be true or false, got {json.dumps(ret)[:40]}")
    return max_tokens, kwargs, bool(ret)


def _check(text: str, line: int, model: ModelInfo, seen: dict[str, int] | None) -> _Pending | LineError:
    """Everything but encoding and the length rules. `seen` maps custom_ids to their first line (None: no
    duplicate check, as for a single line)."""
    custom_id = None
    try:
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise _Bad("invalid_json", f"not valid JSON ({e}); each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise _Bad("invalid_json", f"expected a JSON object with custom_id, method, url and body, "
                                       f"got a JSON {type(obj).__name__}")
        if "custom_id" not in obj or obj["custom_id"] is None:
            raise _Bad("missing_field", "custom_id is missing: give every line a unique, non-empty string custom_id")
        cid = obj["custom_id"]
        if not isinstance(cid, str) or not cid:
            raise _Bad("invalid_parameter", f"custom_id must be a non-empty string, got {json.dumps(cid)[:40]}")
        if seen is not None:
            first = seen.setdefault(cid, line)
            if first != line:  # its error record carries no custom_id: that id's record is the first line's
                raise _Bad("duplicate_custom_id", f"custom_id {json.dumps(cid)[:80]} was already used on line "
                                                  f"{first}: give every line a unique custom_id")
        custom_id = cid
        if "method" not in obj:
            raise _Bad("missing_field", 'method is missing: set "method": "POST"')
        if obj["method"] != "POST":
            raise _Bad("invalid_method", f'method must be "POST", got {json.dumps(obj["method"])[:40]}')
        if "url" not in obj:
            raise _Bad("missing_field", f'url is missing: set "url" to "{COMPLETIONS}" or "{CHAT}"')
        url = obj["url"]
        if url not in URLS:
            raise _Bad("invalid_url", f'url must be "{COMPLETIONS}" or "{CHAT}", got {json.dumps(url)[:80]}')
        if "body" not in obj or obj["body"] is None:
            raise _Bad("missing_field", "body is missing: give the request body as a JSON object")
        body = obj["body"]
        if not isinstance(body, dict):
            raise _Bad("invalid_parameter", f"body must be a JSON object, got a JSON {type(body).__name__}")
        _check_unsupported(body)
        max_tokens, kwargs, ret = _sampling_kwargs(body, model)
        if url == COMPLETIONS:
            prompt_text, ids = _prompt(body, model)
            return _Pending(line, cid, url, prompt_text, True, ids, max_tokens, kwargs, ret)
        return _Pending(line, cid, url, _chat_text(body, model), False, None, max_tokens, kwargs, ret)
    except _Bad as e:
        return LineError(line, custom_id, e.code, f"line {line}: {e}")


def _finish(p: _Pending, ids: np.ndarray, model: ModelInfo, job_seed: int, default_max_tokens: int | None,
            check_vocab: bool) -> Request | LineError:
    def bad(code, message):
        return LineError(p.line, p.custom_id, code, f"line {p.line}: {message}")

    n = int(ids.size)
    what = "body.prompt" if p.url == COMPLETIONS else "body.messages (rendered with the chat template)"
    if n == 0:
        return bad("invalid_parameter", f"{what} encodes to no tokens: give a non-empty prompt")
    if check_vocab and p.text is not None and int(ids.max()) >= model.vocab_size:
        return bad("invalid_parameter", f"{what} encodes to token id {int(ids.max())}, outside the model's "
                                        f"vocabulary [0, {model.vocab_size}): the tokenizer does not match the model")
    room = model.max_context - n
    if room <= 0:
        return bad("prompt_too_long", f"{what} is {n} tokens but the model's context is {model.max_context} "
                                      "positions, with at least one left for the output: shorten the prompt")
    if p.max_tokens is not None:
        max_tokens = p.max_tokens
        if max_tokens > room:
            return bad("prompt_too_long", f"{what} is {n} tokens and max_tokens is {max_tokens}, {n + max_tokens} "
                                          f"in all, more than the model's context of {model.max_context}: lower "
                                          f"max_tokens to at most {room} or shorten the prompt")
    elif default_max_tokens is not None:
        max_tokens = min(default_max_tokens, room)
    elif p.url == COMPLETIONS:
        max_tokens = min(OPENAI_COMPLETIONS_MAX_TOKENS, room)
    else:
        max_tokens = room
    kwargs = dict(p.kwargs)
    n = kwargs.pop("n", 1)
    if "seed" not in kwargs:
        kwargs["seed"] = derive_seed(job_seed, p.custom_id)
    try:
        params = SamplingParams(max_tokens=max_tokens, **kwargs)
    except ValueError as e:
        return bad("invalid_parameter", f"body.{e}")
    ids.flags.writeable = False
    return Request(p.line, p.custom_id, p.url, ids, params, p.return_token_ids, n)


def _encode(model: ModelInfo, texts: list[str], add_special_tokens: bool) -> list[np.ndarray]:
    """One encode_batch over the distinct texts (batch jobs often repeat a prompt with different seeds)."""
    if not texts:
        return []
    index: dict[str, int] = {}
    slots = [index.setdefault(t, len(index)) for t in texts]
    encodings = model.tokenizer.encode_batch(list(index), add_special_tokens=add_special_tokens)
    arrays = [np.array(e.ids, dtype=np.int64) for e in encodings]
    if len(arrays) == len(texts):
        return arrays
    return [arrays[i].copy() for i in slots]  # each Request owns its array


def _tokenizer_fits(model: ModelInfo) -> bool:
    """Whether every id the tokenizer can produce is in the model's vocabulary (then encoded ids need no check)."""
    try:
        return model.tokenizer.get_vocab_size(with_added_tokens=True) <= model.vocab_size
    except Exception:  # not a tokenizers.Tokenizer: check every prompt
        return False


def _resolve(pending: list[_Pending | LineError], model: ModelInfo, job_seed: int,
             default_max_tokens: int | None) -> list[Request | LineError]:
    """Encode every pending text (one encode_batch per kind of special-token handling), then finish each line."""
    for add in (True, False):
        todo = [p for p in pending if isinstance(p, _Pending) and p.text is not None and p.add_special_tokens is add]
        for p, ids in zip(todo, _encode(model, [p.text for p in todo], add)):
            p.ids = ids
    check_vocab = model.tokenizer is not None and not _tokenizer_fits(model)
    return [p if isinstance(p, LineError) else _finish(p, p.ids, model, job_seed, default_max_tokens, check_vocab)
            for p in pending]


def _check_default(default_max_tokens: int | None) -> None:
    if default_max_tokens is not None and (not _is_int(default_max_tokens) or default_max_tokens < 1):
        raise ValueError(f"default_max_tokens must be an integer >= 1 or None, got {default_max_tokens!r}")


def parse_line(text: str, line: int, model: ModelInfo, *, job_seed: int = 0,
               default_max_tokens: int | None = None) -> Request | LineError:
    """One input line (no duplicate check: that needs the whole file, see read_requests)."""
    _check_default(default_max_tokens)
    return _resolve([_check(text, line, model, None)], model, job_seed, default_max_tokens)[0]


def iter_lines(path: str | Path):
    """(1-based line number, text) of each non-blank line; a line that is not UTF-8 comes as None."""
    data = Path(path).read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            yield i, raw.decode("utf-8")
        except UnicodeDecodeError:
            yield i, None


def read_requests(path: str | Path, model: ModelInfo, *, job_seed: int = 0,
                  default_max_tokens: int | None = None) -> tuple[list[Request], list[LineError]]:
    """Every non-blank line of the file as one Request or one LineError, each list in line order."""
    _check_default(default_max_tokens)
    seen: dict[str, int] = {}
    pending = []
    for line, text in iter_lines(path):
        if text is None:
            pending.append(LineError(line, None, "invalid_json", f"line {line}: not valid UTF-8 text; save the "
                                                                 "file as UTF-8 with one JSON object per line"))
        else:
            pending.append(_check(text, line, model, seen))
    requests, errors = [], []
    for r in _resolve(pending, model, job_seed, default_max_tokens):
        (requests if isinstance(r, Request) else errors).append(r)
    return requests, errors
