import json

import pytest

from batchgen.batch.chat import (MessageError, load_chat_template, normalize_messages, read_tokenizer_config,
                                 render_chat, special_token, template_from_config)
from batchgen.batch.demo import CHAT_TEMPLATE


def test_demo_template_renders_chatml_with_generation_prompt():
    text = render_chat(CHAT_TEMPLATE, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_text_parts_are_joined_and_other_keys_kept():
    msgs = normalize_messages([{"role": "user", "name": "ann",
                                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert msgs == [{"role": "user", "name": "ann", "content": "a\nb"}]
    assert render_chat(CHAT_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "x"}]}]) == \
        render_chat(CHAT_TEMPLATE, [{"role": "user", "content": "x"}])


def test_hf_environment_features():
    # trim_blocks/lstrip_blocks, tojson (non-ASCII kept), bos/eos, raise_exception, loop controls
    template = ("{{ bos_token }}\n  {% for m in messages %}\n{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m | tojson }}|{% endfor %}\n{% if add_generation_prompt %}GEN{{ eos_token }}{% endif %}")
    text = render_chat(template, [{"role": "user", "content": "é"}] * 3, bos_token="<s>", eos_token="</s>")
    one = json.dumps({"role": "user", "content": "é"}, ensure_ascii=False)
    assert text == f"<s>\n{one}|{one}|GEN</s>"  # only block tags trim
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    with pytest.raises(MessageError, match="first message must be from the user"):
        render_chat(strict, [{"role": "assistant", "content": "x"}])
    assert render_chat(strict, [{"role": "user", "content": "x"}]) == "ok"


def test_sandbox_refuses_unsafe_templates():
    with pytest.raises(MessageError, match="rejected"):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(MessageError, match="does not compile"):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, code, fragment", [
    ("hi", "invalid_parameter", "must be a list"),
    ([], "invalid_parameter", "empty"),
    (["hi"], "invalid_parameter", "messages[0] must be an object"),
    ([{"content": "x"}], "invalid_parameter", "messages[0].role"),
    ([{"role": "user"}], "invalid_parameter", "no content"),
    ([{"role": "user", "content": 3}], "invalid_parameter", "content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "invalid_parameter", "content[0].text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "unsupported_parameter",
     "only text parts"),
])
def test_bad_messages(messages, code, fragment):
    with pytest.raises(MessageError, match=fragment.replace("[", r"\[").replace("]", r"\]")) as e:
        normalize_messages(messages)
    assert e.value.code == code


def test_special_tokens_and_named_templates():
    assert special_token("<s>") == "<s>"
    assert special_token({"__type": "AddedToken", "content": "<s>", "lstrip": False}) == "<s>"
    assert special_token(None) is None
    assert template_from_config([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]) == "D"
    assert template_from_config([{"name": "tool_use", "template": "T"}]) is None
    assert template_from_config(None) is None


def test_template_sources(tmp_path):
    assert read_tokenizer_config(tmp_path) == {}
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A"}))
    assert load_chat_template(tmp_path) == "A"
    (tmp_path / "chat_template.jinja").write_text("B")
    assert load_chat_template(tmp_path) == "B"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_tokenizer_config(tmp_path)
