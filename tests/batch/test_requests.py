import json
import time
from dataclasses import replace

import numpy as np
import pytest

from batchgen.batch.demo import CHAT_TEMPLATE, write_demo_model
from batchgen.batch.requests import (CHAT, COMPLETIONS, ERROR_CODES, LineError, ModelInfo, Request, derive_seed,
                                     parse_line, read_requests)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"), requests=False)


@pytest.fixture(scope="module")
def model(model_dir):
    return ModelInfo.from_dir(model_dir)


def line(body, url=COMPLETIONS, custom_id="r", method="POST", **extra):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body, **extra})


def comp(prompt="Hello there", **params):
    return {"prompt": prompt, **params}


def chat(content="Hello there", **params):
    return {"messages": [{"role": "user", "content": content}], **params}


def ok(text, model, **kw) -> Request:
    r = parse_line(text, 7, model, **kw)
    assert isinstance(r, Request), r
    return r


def err(text, model, code, *fragments, **kw) -> LineError:
    r = parse_line(text, 7, model, **kw)
    assert isinstance(r, LineError), r
    assert r.code == code, r
    assert r.code in ERROR_CODES
    assert r.line == 7 and r.message.startswith("line 7: "), r
    for f in fragments:
        assert f in r.message, r
    return r


# ------------------------------------------------------------------------------------------ model info


def test_model_info_from_demo_dir(model, model_dir):
    assert model.vocab_size == 512 and model.max_context == 2048
    assert model.tokenizer is not None and model.chat_template == CHAT_TEMPLATE
    assert model.eos_token == "<|im_end|>" and model.bos_token is None


def test_model_info_without_tokenizer_files(tmp_path, model_dir):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    m = ModelInfo.from_dir(tmp_path)
    assert m.tokenizer is None and m.chat_template is None and m.vocab_size == 512
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "T"}], "bos_token": {"content": "<s>"}}))
    m = ModelInfo.from_dir(tmp_path)
    assert m.chat_template == "T" and m.bos_token == "<s>" and m.eos_token is None


# ------------------------------------------------------------------------------------------ good lines


def test_text_prompt_ids_match_tokenizer(model):
    r = ok(line(comp("The capital of France is", max_tokens=8)), model)
    assert r.line == 7 and r.custom_id == "r" and r.url == COMPLETIONS
    assert r.prompt_ids.dtype == np.int64 and not r.prompt_ids.flags.writeable
    assert r.prompt_ids.tolist() == model.tokenizer.encode("The capital of France is").ids
    assert r.params.max_tokens == 8 and r.return_token_ids is False


def test_token_id_prompt_and_single_prompt_lists(model):
    assert ok(line(comp([17, 42, 99, 7])), model).prompt_ids.tolist() == [17, 42, 99, 7]
    assert ok(line(comp([[17, 42]])), model).prompt_ids.tolist() == [17, 42]
    assert ok(line(comp(["hi"])), model).prompt_ids.tolist() == model.tokenizer.encode("hi").ids


def test_chat_rendered_with_demo_template(model):
    r = ok(line(chat("Good morning"), url=CHAT), model)
    text = "<|im_start|>user\nGood morning<|im_end|>\n<|im_start|>assistant\n"
    assert r.url == CHAT
    assert r.prompt_ids.tolist() == model.tokenizer.encode(text, add_special_tokens=False).ids
    assert r.prompt_ids[0] == model.tokenizer.token_to_id("<|im_start|>")  # a special token, not split


def test_special_tokens_added_to_completions_not_to_chat(model):
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(model.tokenizer.to_str())
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", bos)])
    m = replace(model, tokenizer=tok)
    assert ok(line(comp("Hi")), m).prompt_ids.tolist() == [bos] + model.tokenizer.encode("Hi").ids
    assert bos not in ok(line(chat("Hi"), url=CHAT), m).prompt_ids.tolist()


def test_params_carried(model):
    r = ok(line(comp(temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["."], ignore_eos=True,
                     return_token_ids=True, stop_token_ids=[4], model="x", user="u", metadata={"a": 1}, n=1,
                     stream=False, logprobs=None, presence_penalty=0)), model)
    p = r.params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos, p.stop_token_ids) == \
        (0.5, 0.9, 5, 3, (".",), True, (4,))
    assert r.return_token_ids is True
    assert ok(line(comp(stop=".", top_k=-1)), model).params.stop == (".",)
    assert ok(line(comp(top_k=-1)), model).params.top_k == 0
    assert ok(line(comp(temperature=None)), model).params.temperature == 1.0
    assert ok(line(comp()), model).params.ignore_eos is False


def test_seeds_stable_distinct_and_explicit(model):
    a1 = ok(line(comp(), custom_id="a"), model).params.seed
    a2 = ok(line(comp(temperature=0.3), custom_id="a"), model).params.seed
    b = ok(line(comp(), custom_id="b"), model).params.seed
    assert a1 == a2 == derive_seed(0, "a") and a1 != b
    assert 0 <= a1 < 2 ** 63
    assert ok(line(comp(), custom_id="a"), model, job_seed=1).params.seed not in (a1, b)
    assert ok(line(comp(seed=42), custom_id="a"), model).params.seed == 42
    assert ok(line(comp(seed=-5), custom_id="a"), model).params.seed == -5


def test_default_max_tokens(model):
    assert ok(line(comp()), model).params.max_tokens == 16
    r = ok(line(chat(), url=CHAT), model)
    assert r.params.max_tokens == model.max_context - len(r.prompt_ids)
    assert ok(line(comp()), model, default_max_tokens=100).params.max_tokens == 100
    assert ok(line(chat(), url=CHAT), model, default_max_tokens=100).params.max_tokens == 100
    assert ok(line(comp(max_tokens=5)), model, default_max_tokens=100).params.max_tokens == 5
    assert ok(line(chat(max_completion_tokens=6), url=CHAT), model).params.max_tokens == 6
    assert ok(line(chat(max_tokens=7), url=CHAT), model).params.max_tokens == 7
    # a default (never an explicit value) is cut to the context left after the prompt
    ids = [5] * (model.max_context - 4)
    assert ok(line(comp(ids)), model).params.max_tokens == 4
    assert ok(line(comp(ids)), model, default_max_tokens=100).params.max_tokens == 4
    with pytest.raises(ValueError):
        parse_line(line(comp()), 1, model, default_max_tokens=0)


# ------------------------------------------------------------------------------------------- bad lines

BAD = [  # (line text, code, fragments of the message)
    ("{not json", "invalid_json", ["not valid JSON"]),
    ("[1, 2]", "invalid_json", ["JSON object"]),
    (json.dumps({"method": "POST", "url": COMPLETIONS, "body": comp()}), "missing_field", ["custom_id"]),
    (line(comp(), custom_id=""), "invalid_parameter", ["custom_id"]),
    (line(comp(), custom_id=5), "invalid_parameter", ["custom_id"]),
    (json.dumps({"custom_id": "r", "url": COMPLETIONS, "body": comp()}), "missing_field", ["method"]),
    (line(comp(), method="GET"), "invalid_method", ["POST", "GET"]),
    (json.dumps({"custom_id": "r", "method": "POST", "body": comp()}), "missing_field", ["url"]),
    (line(comp(), url="/v1/embeddings"), "invalid_url", ["/v1/embeddings", COMPLETIONS]),
    (json.dumps({"custom_id": "r", "method": "POST", "url": COMPLETIONS}), "missing_field", ["body"]),
    (line("hello"), "invalid_parameter", ["body must be a JSON object"]),
    (line({"max_tokens": 3}), "missing_field", ["body.prompt"]),
    (line({"max_tokens": 3}, url=CHAT), "missing_field", ["body.messages"]),
    (line(comp("")), "invalid_parameter", ["body.prompt is empty"]),
    (line(comp([])), "invalid_parameter", ["body.prompt is empty"]),
    (line(comp(3)), "invalid_parameter", ["body.prompt"]),
    (line(comp([1, "a"])), "invalid_parameter", ["body.prompt", "integer"]),
    (line(comp([1, True])), "invalid_parameter", ["body.prompt", "integer"]),
    (line(comp([1, 512])), "invalid_parameter", ["512", "[0, 512)"]),
    (line(comp([-1])), "invalid_parameter", ["-1"]),
    (line(comp([2 ** 70])), "invalid_parameter", ["body.prompt"]),
    (line(comp(["a", "b"])), "unsupported_parameter", ["one line per prompt"]),
    (line(chat()["messages"] and {"messages": []}, url=CHAT), "invalid_parameter", ["body.messages is empty"]),
    (line({"messages": [{"role": "user", "content": 1}]}, url=CHAT), "invalid_parameter", ["messages[0].content"]),
    (line({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, url=CHAT), "unsupported_parameter",
     ["only text parts"]),
    (line(comp(temperature=-1)), "invalid_parameter", ["body.temperature", ">= 0"]),
    (line(comp(temperature="hot")), "invalid_parameter", ["body.temperature"]),
    (line(comp(top_p=0)), "invalid_parameter", ["body.top_p", "(0, 1]"]),
    (line(comp(top_k=-2)), "invalid_parameter", ["body.top_k"]),
    (line(comp(seed=1.5)), "invalid_parameter", ["body.seed"]),
    (line(comp(max_tokens=0)), "invalid_parameter", ["body.max_tokens", ">= 1"]),
    (line(comp(max_tokens="8")), "invalid_parameter", ["body.max_tokens"]),
    (line(chat(max_completion_tokens=-3), url=CHAT), "invalid_parameter", ["body.max_completion_tokens"]),
    (line(comp(stop=[""])), "invalid_parameter", ["body.stop"]),
    (line(comp(stop=3)), "invalid_parameter", ["body.stop"]),
    (line(comp(ignore_eos="yes")), "invalid_parameter", ["ignore_eos"]),
    (line(comp(return_token_ids=1)), "invalid_parameter", ["return_token_ids"]),
    (line(comp(stop_token_ids=[600])), "invalid_parameter", ["stop_token_ids", "600"]),
    (line(comp(n=0)), "invalid_parameter", ["body.n must be an integer from 1 to 128", "got 0"]),
    (line(comp(n=-3)), "invalid_parameter", ["body.n", "got -3"]),
    (line(comp(n=129)), "invalid_parameter", ["body.n", "got 129", "write more lines"]),
    (line(comp(n=2.5)), "invalid_parameter", ["body.n", "got 2.5"]),
    (line(chat(n="4"), url=CHAT), "invalid_parameter", ["body.n", 'got "4"']),
    (line(comp(n=True)), "invalid_parameter", ["body.n", "got true"]),
    (line(comp(stream=True)), "unsupported_parameter", ["body.stream"]),
    (line(comp(logprobs=0)), "unsupported_parameter", ["body.logprobs"]),
    (line(chat(logprobs=True), url=CHAT), "unsupported_parameter", ["body.logprobs"]),
    (line(chat(top_logprobs=2), url=CHAT), "unsupported_parameter", ["body.top_logprobs"]),
    (line(comp(echo=True)), "unsupported_parameter", ["body.echo"]),
    (line(comp(best_of=3)), "unsupported_parameter", ["body.best_of"]),
    (line(comp(presence_penalty=0.5)), "unsupported_parameter", ["body.presence_penalty"]),
    (line(comp(frequency_penalty=-1)), "unsupported_parameter", ["body.frequency_penalty"]),
    (line(comp(logit_bias={"5": 10})), "unsupported_parameter", ["body.logit_bias"]),
    (line(chat(tools=[{"type": "function"}]), url=CHAT), "unsupported_parameter", ["body.tools"]),
    (line(chat(response_format={"type": "json_object"}), url=CHAT), "unsupported_parameter", ["response_format"]),
    (line(comp([5] * 2048)), "prompt_too_long", ["2048 tokens", "2048"]),
    (line(comp([5] * 2000, max_tokens=100)), "prompt_too_long", ["2000", "100", "2048", "lower max_tokens",
                                                                "at most 48"]),
    (line(chat("x", max_tokens=2048), url=CHAT), "prompt_too_long", ["max_tokens is 2048"]),
]


@pytest.mark.parametrize("text, code, fragments", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_line(text, code, fragments, model):
    e = err(text, model, code, *fragments)
    readable = '"custom_id": "r"' in text
    assert e.custom_id == ("r" if readable else None)


def test_harmless_defaults_of_unsupported_keys_are_accepted(model):
    ok(line(comp(n=1, best_of=1, stream=False, echo=False, logprobs=None, top_logprobs=0, presence_penalty=0,
                 frequency_penalty=0.0, logit_bias={}, suffix=None)), model)
    ok(line(chat(logprobs=False, tools=[], response_format={"type": "text"}), url=CHAT), model)


def test_no_tokenizer(model):
    m = replace(model, tokenizer=None)
    ok(line(comp([1, 2, 3], stop_token_ids=[2])), m)
    err(line(comp("text")), m, "no_tokenizer", "body.prompt", "tokenizer.json")
    err(line(chat(), url=CHAT), m, "no_tokenizer", "tokenizer.json")
    err(line(comp([1, 2], stop=".")), m, "no_tokenizer", "body.stop")


def test_no_chat_template(model):
    m = replace(model, chat_template=None)
    err(line(chat(), url=CHAT), m, "no_chat_template", "chat_template", "tokenizer_config.json")
    ok(line(comp()), m)


def test_template_raise_exception_is_a_line_error(model):
    m = replace(model, chat_template="{{ raise_exception('roles must alternate user/assistant') }}")
    err(line(chat(), url=CHAT), m, "invalid_parameter", "roles must alternate")


# ------------------------------------------------------------------------------------------- whole file


def test_file_with_a_fifth_bad(model, tmp_path):
    goods = [line(comp("Tell me a story"), custom_id="g{}"), line(comp([3, 4, 5], max_tokens=2), custom_id="g{}"),
             line(chat("Hi", temperature=0), url=CHAT, custom_id="g{}"),
             line(comp("x", seed=9, stop=["\n"]), custom_id="g{}")]
    bads = [(text, code) for text, code, _ in BAD]
    rows, expect = [], {}
    n = 5 * len(bads)
    for i in range(n):
        if i % 5 == 4:
            text, code = bads[i // 5]
            text = text.replace('"custom_id": "r"', f'"custom_id": "b{i}"')
        else:
            text, code = goods[i % 4].replace("g{}", f"g{i}"), None
        rows.append(text)
        expect[len(rows)] = code
        if i % 17 == 0:
            rows.append("   ")  # blank lines are skipped but counted
    rows.append(line(comp(), custom_id="g0"))  # a duplicate of the first line
    expect[len(rows)] = "duplicate_custom_id"
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")

    reqs, errs = read_requests(tmp_path / "in.jsonl", model)
    assert len(reqs) + len(errs) == len(expect)
    assert {r.line for r in reqs} == {ln for ln, c in expect.items() if c is None}
    assert {e.line: e.code for e in errs} == {ln: c for ln, c in expect.items() if c is not None}
    for e in errs:
        assert e.message.startswith(f"line {e.line}: ")
    assert errs[-1].custom_id is None and '"g0"' in errs[-1].message and "line 1" in errs[-1].message
    assert [r.line for r in reqs] == sorted(r.line for r in reqs)
    for r in reqs:  # a line read in a file is the same request as read alone
        alone = parse_line(rows[r.line - 1], r.line, model)
        assert alone.params == r.params and np.array_equal(alone.prompt_ids, r.prompt_ids)


def test_first_line_wins_even_when_it_is_bad(model, tmp_path):
    (tmp_path / "in.jsonl").write_bytes(
        (line(comp(temperature=-1), custom_id="a") + "\n" + line(comp(), custom_id="a") + "\n").encode()
        + b'{"custom_id": "\xff"}\n\n' + line(comp(), custom_id="b").encode() + b"\r\n")
    reqs, errs = read_requests(tmp_path / "in.jsonl", model)
    assert [(e.line, e.code) for e in errs] == [(1, "invalid_parameter"), (2, "duplicate_custom_id"),
                                               (3, "invalid_json")]
    assert [(r.line, r.custom_id) for r in reqs] == [(5, "b")]
    assert [e.custom_id for e in errs] == ["a", None, None]  # one record per custom_id: the first line's


@pytest.mark.parametrize("n", [10_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_lines_speed(n, model, tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(
        json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": COMPLETIONS,
                    "body": {"model": "m", "prompt": f"Write a short poem about the sea, number {i}.",
                             "max_tokens": 32, "temperature": 0.7}}) + "\n" for i in range(n)))
    start = time.perf_counter()
    reqs, errs = read_requests(path, model)
    elapsed = time.perf_counter() - start
    print(f"\nread_requests: {n:,} short completions lines in {elapsed:.2f} s ({elapsed / n * 1e6:.0f} us a line)")
    assert len(reqs) == n and not errs


def test_tokenizer_larger_than_model_vocab(model):
    m = replace(model, vocab_size=200)
    err(line(comp("The quick brown fox jumps over the lazy dog")), m, "invalid_parameter",
        "tokenizer does not match")
    ok(line(comp([1, 2, 3])), m)


def test_n_choices_are_carried(model):
    assert ok(line(comp(n=3)), model).n == 3
    assert ok(line(chat(n=128), url=CHAT), model).n == 128
    assert ok(line(comp(n=None)), model).n == ok(line(comp()), model).n == 1
