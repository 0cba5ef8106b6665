import json
import signal
import subprocess
import sys
import time

import pytest

from batchgen.batch.output import (OutputFileError, ResultLog, chat_body, completion_body, error_record,
                                   openai_finish_reason, success_record)


def _body(custom_id="req-1", **kw):
    args = dict(custom_id=custom_id, model="tiny", created=1700000000, prompt_ids=[1, 2, 3],
                token_ids=[7, 8], text="hi", finish_reason="eos", return_token_ids=False)
    args.update(kw)
    return completion_body(**args)


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# -- records ------------------------------------------------------------------------------------------------

def test_success_record_shape_and_deterministic_ids():
    body = _body()
    r = success_record("req-1", body)
    assert set(r) == {"id", "custom_id", "response", "error"}
    assert r["id"].startswith("batch_req_") and len(r["id"]) == len("batch_req_") + 24
    int(r["id"][len("batch_req_"):], 16)
    assert r["custom_id"] == "req-1" and r["error"] is None
    assert r["response"]["status_code"] == 200 and r["response"]["body"] is body
    int(r["response"]["request_id"], 16)
    again = success_record("req-1", _body())
    assert again == r
    other = success_record("req-2", _body("req-2"))
    assert other["id"] != r["id"] and other["response"]["request_id"] != r["response"]["request_id"]
    assert other["response"]["body"]["id"] != body["id"]


def test_error_record_shape_and_ids():
    r = error_record(5, "req-x", "invalid_request", "bad body")
    assert r["response"] is None and r["custom_id"] == "req-x"
    assert r["error"] == {"code": "invalid_request", "message": "bad body", "line": 5}
    assert r["id"].startswith("batch_req_")
    assert error_record(5, "req-x", "other", "m")["id"] == r["id"]
    ids = {r["id"], error_record(6, "req-x", "c", "m")["id"], error_record(5, None, "c", "m")["id"],
           success_record("req-x", {})["id"]}
    assert len(ids) == 4
    assert error_record(3, None, "c", "m")["custom_id"] is None


def test_completion_body():
    b = _body()
    assert b["id"].startswith("cmpl-") and b["object"] == "text_completion"
    assert b["created"] == 1700000000 and b["model"] == "tiny"
    assert b["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}]
    assert b["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert _body() == b and _body("req-2")["id"] != b["id"]
    with_ids = _body(return_token_ids=True, text=None, finish_reason="length")
    choice = with_ids["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == [7, 8] and choice["prompt_token_ids"] == [1, 2, 3]
    json.dumps(with_ids)


def test_chat_body():
    b = chat_body(custom_id="c1", model="m", created=1, prompt_ids=[1] * 10, token_ids=(4, 5, 6), text=None,
                  finish_reason="stop_string", return_token_ids=True)
    assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion"
    assert b["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": "stop", "token_ids": [4, 5, 6], "prompt_token_ids": [1] * 10}]
    assert b["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    plain = chat_body(custom_id="c1", model="m", created=1, prompt_ids=[1], token_ids=[2], text="ok",
                      finish_reason="stop_token", return_token_ids=False)
    assert "token_ids" not in plain["choices"][0] and plain["choices"][0]["message"]["content"] == "ok"
    assert plain["id"] == b["id"]


def test_finish_reasons():
    assert [openai_finish_reason(r) for r in ("eos", "stop_token", "stop_string", "length")] == \
        ["stop", "stop", "stop", "length"]
    assert openai_finish_reason("stop") == "stop"
    with pytest.raises(ValueError):
        openai_finish_reason("abort")


def test_finish_reasons_agree_with_stopping():
    # read stopping.py's constants from its source: importing it pulls in torch (seconds)
    import ast
    import importlib.util
    source = open(importlib.util.find_spec("batchgen.exec.stopping").origin, encoding="utf-8").read()
    constants = {node.targets[0].id: node.value.value for node in ast.parse(source).body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.targets[0], ast.Name)}
    reasons = {constants[name] for name in ("EOS", "STOP_TOKEN", "STOP_STRING", "LENGTH")}
    assert reasons == {"eos", "stop_token", "stop_string", "length"}
    for reason in reasons:
        openai_finish_reason(reason)


# -- the file -----------------------------------------------------------------------------------------------

def _write_three(path):
    with ResultLog(path, fsync=False) as log:
        for i in range(3):
            log.write(success_record(f"r{i}", _body(f"r{i}")))
        log.write(error_record(9, None, "invalid_json", "no"))
    return path.read_bytes()


def test_new_file_is_created_and_written_as_compact_utf8_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultLog(path) as log:
        assert path.exists() and log.records == 0 and log.repaired_bytes == 0
        log.write(success_record("é", _body("é", text="naïve ✓")))
        assert log.done_ids == {"é"}
    data = path.read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert "naïve ✓".encode() in data and b", " not in data and b'": ' not in data
    with pytest.raises(ValueError):
        log.write(success_record("x", {}))


def test_reopen_clean_file_drops_nothing(tmp_path):
    path = tmp_path / "results.jsonl"
    before = _write_three(path)
    with ResultLog(path) as log:
        assert log.records == 4 and log.repaired_bytes == 0
        assert log.done_ids == {"r0", "r1", "r2"} and log.done_lines == {9}
    assert path.read_bytes() == before


def test_torn_last_line_is_cut_and_writing_continues(tmp_path):
    path = tmp_path / "results.jsonl"
    before = _write_three(path)
    torn = json.dumps(success_record("r3", _body("r3"))).encode()[:40]
    path.write_bytes(before + torn)
    with ResultLog(path, fsync=False) as log:
        assert log.repaired_bytes == len(torn) > 0
        assert log.records == 4 and log.done_ids == {"r0", "r1", "r2"}
        assert path.read_bytes() == before
        log.write(success_record("r3", _body("r3")))
        assert "r3" in log.done_ids
    assert [r["custom_id"] for r in _lines(path)] == ["r0", "r1", "r2", None, "r3"]


def test_torn_line_that_parses_but_lacks_newline_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    before = _write_three(path)
    path.write_bytes(before + b'{"id":"x","custom_id":"r9","response":{},"error":null}')
    with ResultLog(path) as log:
        assert "r9" not in log.done_ids and log.records == 4
    assert path.read_bytes() == before


def test_complete_last_line_that_is_not_json_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    before = _write_three(path)
    path.write_bytes(before + b'{"id": "x", "cus\n')
    with ResultLog(path) as log:
        assert log.repaired_bytes == len(b'{"id": "x", "cus\n') and log.records == 4
    assert path.read_bytes() == before


def test_torn_multibyte_character_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    before = _write_three(path)
    path.write_bytes(before + '{"custom_id":"é'.encode()[:-1])
    with ResultLog(path) as log:
        assert log.repaired_bytes > 0
    assert path.read_bytes() == before


def test_bad_line_in_the_middle_is_refused(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = _write_three(path).splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2] + [b"not json\n"] + lines[2:]))
    with pytest.raises(OutputFileError, match=r"line 3\b.*[Mm]ove the file away") as e:
        ResultLog(path)
    assert str(path) in str(e.value)
    path.write_bytes(b"".join(lines[:1] + [b"[1, 2]\n"] + lines[1:]))
    with pytest.raises(OutputFileError, match=r"line 2\b"):
        ResultLog(path)


# -- a real kill --------------------------------------------------------------------------------------------

_WRITER = """
import sys
from batchgen.batch.output import ResultLog, completion_body, success_record
with ResultLog(sys.argv[1], fsync=False) as log:
    print("ready", flush=True)
    i = 0
    while True:
        body = completion_body(custom_id=f"k{i}", model="m", created=0, prompt_ids=[1] * 50,
                               token_ids=list(range(2000)), text="x" * 3000, finish_reason="length",
                               return_token_ids=True)
        log.write(success_record(f"k{i}", body))
        i += 1
"""


def test_sigkilled_writer_leaves_a_resumable_file(tmp_path):
    path = tmp_path / "results.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with ResultLog(path, fsync=False) as log:
        n = log.records
        assert n > 0 and log.done_ids == {f"k{i}" for i in range(n)}
        log.write(success_record("after", {}))
    records = _lines(path)
    assert [r["custom_id"] for r in records] == [f"k{i}" for i in range(n)] + ["after"]
