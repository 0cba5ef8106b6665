"""Chat requests: a model directory's chat template, and `messages` rendered with it as Hugging Face does.

The template comes from `chat_template.jinja` in the model directory if there is one (newer `save_pretrained`
writes it there), else from tokenizer_config.json's `chat_template`: a string, or a list of
{"name", "template"} of which the one named "default" is taken. It is rendered in a sandboxed, immutable jinja2
environment with trim_blocks and lstrip_blocks, the `raise_exception` and `strftime_now` globals, the `tojson`
filter (non-ASCII kept, as transformers does), and the variables `messages`, `add_generation_prompt=True`,
`bos_token` and `eos_token`. The rendered text already holds the template's special tokens, so it is encoded
without adding special tokens again (see requests.py).

Messages are checked before rendering: a list of objects with a string `role` and a `content` that is a string
or a list of {"type": "text", "text": ...} parts (joined with newlines, as vLLM does). Other keys of a message
(`name`, ...) are passed to the template unchanged.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any


# ChatML, as Qwen and SmolLM2 write it: the demo model's template, and the one an estimate without the model
# directory assumes. Its markers are special tokens, so a tokenizer never splits them.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class MessageError(ValueError):
    """`messages` cannot be rendered; `code` is the LineError code (invalid_parameter or unsupported_parameter)."""

    def __init__(self, message: str, code: str = "invalid_parameter"):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------- model directory


def read_tokenizer_config(path: str | Path) -> dict:
    """tokenizer_config.json of a model directory as a dict ({} when the file is absent)."""
    file = Path(path) / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def special_token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def template_from_config(value: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def load_chat_template(path: str | Path, tokenizer_config: dict | None = None) -> str | None:
    """The directory's chat template, or None when it has none."""
    file = Path(path) / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    config = read_tokenizer_config(path) if tokenizer_config is None else tokenizer_config
    return template_from_config(config.get("chat_template"))


# ----------------------------------------------------------------------------------------------- messages


def normalize_messages(messages: Any) -> list[dict]:
    """The messages the template sees: each a copy of the request's, with list-of-parts content joined."""
    if not isinstance(messages, list):
        raise MessageError(f"body.messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise MessageError("body.messages is empty: give at least one message, e.g. "
                           '[{"role": "user", "content": "..."}]')
    out = []
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{where} must be an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise MessageError(f"{where}.role must be a non-empty string (system, user, assistant, ...), "
                               f"got {role!r}")
        if "content" not in m:
            raise MessageError(f"{where} has no content: give a string, or a list of "
                               '{"type": "text", "text": ...} parts')
        content = m["content"]
        if not isinstance(content, str):
            content = _join_parts(content, where)
        out.append({**m, "content": content})
    return out


def _join_parts(content: Any, where: str) -> str:
    if not isinstance(content, list):
        raise MessageError(f"{where}.content must be a string or a list of "
                           f'{{"type": "text", "text": ...}} parts, got {type(content).__name__}')
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise MessageError(f"{where}.content[{j}] must be an object "
                               f'{{"type": "text", "text": ...}}, got {type(part).__name__}')
        kind = part.get("type")
        if kind != "text":
            raise MessageError(f"{where}.content[{j}] has type {kind!r}: only text parts are supported "
                               "by this engine (no images or audio)", code="unsupported_parameter")
        if not isinstance(part.get("text"), str):
            raise MessageError(f"{where}.content[{j}].text must be a string, got {part.get('text')!r}")
        texts.append(part["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------- rendering


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    from datetime import datetime

    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The compiled template (cached: one compilation per job, not per line). Raises jinja2.TemplateSyntaxError."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: Any, *, bos_token: str | None = None, eos_token: str | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat request. Raises MessageError for messages the template (or the checks
    above) rejects, with the template's own message when it calls raise_exception."""
    msgs = normalize_messages(messages)
    try:
        compiled = compile_template(template)
    except Exception as e:  # a syntax error is the model directory's fault, but it fails this line
        raise MessageError(f"the model's chat template does not compile ({e}); fix chat_template in "
                           "tokenizer_config.json or chat_template.jinja") from e
    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "")
    except Exception as e:  # raise_exception's TemplateError, or a template tripping over unusual messages
        raise MessageError(f"the model's chat template rejected body.messages: {e}") from e
