"""Batch jobs end to end (`python -m batchgen.run`): bad lines become error records and the job goes on; a job
killed at random points and resumed ends with exactly the output of an uninterrupted run; a finished job exits 0
without recomputing; job-level problems stop before any work with a message naming the setting."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from batchgen.batch.demo import write_demo_model
from batchgen.confdir import conf_dir

SMALL_EXEC = ["+policy=coroutine", "backend.device=cpu", "backend.threads=1", "backend.kv_budget_mb=8"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"), requests=False)


def completion(cid, prompt, max_tokens=12, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}}


def chat(cid, text, max_tokens=12, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
                     **body}}


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(records: list[dict]) -> dict:
    """custom_id (or error line) -> record without the wall-clock `created` field."""
    out = {}
    for r in records:
        key = r["custom_id"] if r["response"] else ("line", r["error"]["line"])
        assert key not in out, f"{key} recorded twice"
        if r["response"]:
            r = json.loads(json.dumps(r))
            r["response"]["body"].pop("created")
        out[key] = r
    return out


def run_in_process(demo, requests: Path, output: Path, *overrides: str, capsys=None):
    from batchgen.run import run_job

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("run", overrides=[*SMALL_EXEC, f"model.path={demo}", f"job.input={requests}",
                                         f"job.output={output}", *overrides])
    run_job(cfg)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen.run", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "BATCHGEN_PROGRESS": "0"})


def bad_and_good_lines():
    """Ten lines, two of them bad in each listed way (a fifth of a larger file below)."""
    return [
        completion("a", "The quick brown fox"),
        "{not json",                                                       # malformed line
        {"custom_id": "b", "method": "POST", "url": "/v1/completions"},    # missing body
        chat("c", "What is the capital of France?"),
        {**completion("d", "hello"), "url": "/v1/embeddings"},             # unknown url
        completion("a", "a duplicate custom_id"),                          # duplicate custom_id
        completion("e", [5, 6, 7, 8], max_tokens=8, return_token_ids=True),
        completion("f", "x " * 3000, max_tokens=4),                        # longer than the context
        completion("g", "Two plus two", temperature=-1),                   # invalid parameter
        completion("h", "Once upon a time", max_tokens=6, ignore_eos=True),
    ]


def test_a_fifth_of_the_lines_bad(demo, tmp_path):
    lines = []
    for k in range(3):  # 30 lines: 6 good + 4 bad per copy, with distinct custom_ids per copy
        for line in bad_and_good_lines():
            if isinstance(line, dict):
                line = {**line, "custom_id": f"{line['custom_id']}{k}"}
            lines.append(line)
    lines += [completion(f"extra{k}", "Write a short poem about the sea", max_tokens=5) for k in range(20)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    run_in_process(demo, requests, output)
    records = read_records(output)
    good = [r for r in records if r["response"]]
    errors = {r["error"]["line"]: r["error"] for r in records if r["error"]}
    bad_lines = {i + 1 for i, line in enumerate(lines) if i < 30 and i % 10 in (1, 2, 4, 5, 7, 8)}
    assert len(bad_lines) / len(lines) == pytest.approx(0.36)  # 18 of 50
    assert set(errors) == bad_lines
    for line, err in errors.items():
        assert err["message"].startswith(f"line {line}: ")
    ids = [r["custom_id"] for r in records if r["custom_id"] is not None]
    assert len(ids) == len(set(ids)), "a custom_id has two records"  # the duplicate "a" gets only its error
    assert errors[6]["message"].startswith('line 6: custom_id "a0" was already used on line 1')
    codes = sorted({e["code"] for e in errors.values()})
    assert codes == sorted({"invalid_json", "missing_field", "invalid_url", "duplicate_custom_id",
                            "prompt_too_long", "invalid_parameter"})
    assert sorted(r["custom_id"] for r in good) == sorted(
        [f"{c}{k}" for k in range(3) for c in "acdeh" if c != "d"] + [f"extra{k}" for k in range(20)])
    by_id = {r["custom_id"]: r["response"] for r in good}
    assert all(r["status_code"] == 200 for r in by_id.values())
    chat_body, ids_body, eos_body = by_id["c0"]["body"], by_id["e0"]["body"], by_id["h0"]["body"]
    assert chat_body["object"] == "chat.completion" and chat_body["model"] == "batchgen-demo-moe"
    assert chat_body["choices"][0]["message"]["role"] == "assistant"
    assert ids_body["object"] == "text_completion"
    assert ids_body["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8]
    assert len(ids_body["choices"][0]["token_ids"]) == ids_body["usage"]["completion_tokens"]
    assert "token_ids" not in by_id["a0"]["body"]["choices"][0]
    assert eos_body["usage"]["completion_tokens"] == 6 and eos_body["choices"][0]["finish_reason"] == "length"
    for body in (chat_body, by_id["a0"]["body"]):
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] >= 2


def test_requests_end_at_eos_unless_ignore_eos(demo, tmp_path):
    """The demo model's EOS is <|im_end|>; a prompt made of it followed by itself makes greedy decoding likely to
    stop at EOS somewhere within 64 tokens: whichever sequence stops early must say `stop`, and the same prompt
    with ignore_eos runs to max_tokens."""
    from batchgen.exec.models import load_tokenizer

    eos = load_tokenizer(demo).token_to_id("<|im_end|>")
    cfg = json.loads((demo / "config.json").read_text())
    assert cfg["eos_token_id"] == eos
    lines = [completion(f"p{k}", [k + 3, k + 9, eos], max_tokens=48) for k in range(24)]
    lines += [completion(f"q{k}", [k + 3, k + 9, eos], max_tokens=48, ignore_eos=True, return_token_ids=True)
              for k in range(24)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    run_in_process(demo, requests, output)
    by_id = {r["custom_id"]: r["response"]["body"] for r in read_records(output)}
    assert any(by_id[f"p{k}"]["choices"][0]["finish_reason"] == "stop" for k in range(24))  # EOS is exercised
    for k in range(24):
        free, forced = by_id[f"p{k}"], by_id[f"q{k}"]
        assert forced["usage"]["completion_tokens"] == 48 and forced["choices"][0]["finish_reason"] == "length"
        n = free["usage"]["completion_tokens"]
        # the same greedy tokens up to where the free one stopped
        if free["choices"][0]["finish_reason"] == "stop":
            assert forced["choices"][0]["token_ids"][n - 1] == eos and n < 48
        else:
            assert n == 48 and eos not in forced["choices"][0]["token_ids"]


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume(demo, tmp_path):
    # ~16K tokens: a few seconds of decoding on one CPU thread, so that the kills land mid-run (with 160 requests
    # an idle machine sometimes finished the first resume before its kill)
    lines = [completion(f"r{k}", f"Request number {k}: summarize the following text", max_tokens=40 + k % 80)
             for k in range(200)]
    lines.insert(7, "{torn")  # a bad line too: its error record must not be duplicated by resumes
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    baseline = tmp_path / "baseline.jsonl"
    run_in_process(demo, requests, baseline)

    output = tmp_path / "results.jsonl"
    args = [*SMALL_EXEC, f"model.path={demo}", f"job.input={requests}", f"job.output={output}",
            f"hydra.run.dir={tmp_path / 'hydra'}", "job.checkpoint_s=0.2"]
    rng = random.Random(1234)
    kills, ran_to_end, progress = 0, None, []  # progress: records in the output after each killed attempt
    for attempt in range(4):
        before = len(output.read_text().splitlines()) if output.exists() else 0
        log = tmp_path / f"attempt{attempt}.out"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "batchgen.run", *args], stdout=out,
                                    stderr=subprocess.STDOUT, env={**os.environ, "BATCHGEN_PROGRESS": "0"})
        deadline = time.monotonic() + 120
        # wait until this run has written something new, then kill it a random moment later
        while time.monotonic() < deadline and proc.poll() is None:
            if (output.exists() and len(output.read_text().splitlines()) > before + 1
                    and Path(f"{output}.partial").exists()):
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is not None:  # it finished before the kill: it was the resume
            assert proc.returncode == 0, log.read_text()
            ran_to_end = log.read_text()
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        progress.append(len(output.read_text().splitlines()))
    assert kills >= 2, "the job finished too fast to be interrupted twice: give it more work"
    if ran_to_end is None:  # the last attempt was killed too: resume now
        done = cli(*args)
        assert done.returncode == 0, done.stderr
        ran_to_end = done.stdout
    if "job already complete" in ran_to_end:
        # the kill landed after the last attempt had written every record (in its shutdown): nothing was left to
        # continue, but each resumed attempt added records to what the one before had left
        assert progress[-1] == len(lines) and all(b > a for a, b in zip(progress, progress[1:]))
    else:
        assert "requests continued from the" in ran_to_end  # the killed run's unfinished requests went on
    assert not Path(f"{output}.partial").exists()
    assert comparable(read_records(output)) == comparable(read_records(baseline))

    again = cli(*args)  # a finished job says so, recomputes nothing, and exits 0
    assert again.returncode == 0, again.stderr
    assert "job already complete" in again.stdout
    assert comparable(read_records(output)) == comparable(read_records(baseline))


def test_job_level_errors_before_any_work(demo, tmp_path):
    from batchgen.memory import ConfigError
    from batchgen.run import run_job

    requests = write_lines(tmp_path / "requests.jsonl", [completion("a", "hello", max_tokens=1000)])
    out = tmp_path / "o.jsonl"
    cases = [
        ([f"job.input={requests}", f"job.output={out}"], "model.path"),
        ([f"model.path={tmp_path / 'nowhere'}", f"job.input={requests}", f"job.output={out}"], "no such directory"),
        ([f"model.path={demo}", f"job.input={tmp_path / 'missing.jsonl'}", f"job.output={out}"], "job.input"),
        ([f"model.path={demo}", f"job.input={requests}", f"job.output={tmp_path / 'no' / 'dir' / 'o.jsonl'}"],
         "does not exist"),
        ([f"model.path={demo}", f"job.input={requests}", f"job.output={out}", "backend.kv_budget_mb=0.05",
          "policy.kv_residency=device"], "backend.kv_budget_mb"),
        ([f"model.path={demo}", f"job.input={requests}", f"job.output={out}", "job.checkpoint_s=-1"],
         "job.checkpoint_s"),
        ([f"model.path={demo}", f"job.input={requests}", f"job.output={out}", "backend=sim"], "job.estimate=true"),
    ]
    for overrides, needle in cases:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            base = [] if "backend=sim" in overrides else ["backend.device=cpu"]
            cfg = compose("run", overrides=["+policy=coroutine", *base, *overrides])
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            run_job(cfg)
        assert not out.exists() or not out.read_text()  # nothing ran


def test_cli_says_what_is_wrong_with_exit_code_2(tmp_path):
    requests = write_lines(tmp_path / "requests.jsonl", [completion("a", "hello")])
    res = cli("+policy=coroutine", f"job.input={requests}", f"job.output={tmp_path / 'o.jsonl'}",
              f"hydra.run.dir={tmp_path / 'hydra'}", "model.path=/nonexistent/model")
    assert res.returncode == 2 and "error: model.path=/nonexistent/model: no such directory" in res.stderr


def test_partial_tokens_are_kept_only_for_the_same_request(demo, tmp_path):
    from batchgen.batch.checkpoint import Checkpointer, load_partial, partial_path
    from batchgen.batch.choices import plan_choices
    from batchgen.batch.output import Generated
    from batchgen.batch.requests import ModelInfo, read_requests
    from batchgen.exec.sequences import SequenceTokens

    info = ModelInfo.from_dir(demo)
    src = write_lines(tmp_path / "in.jsonl", [completion("a", [3, 4, 5], max_tokens=9),
                                             completion("b", [6, 7], max_tokens=9, n=3)])
    todo, _ = read_requests(src, info)
    out = tmp_path / "out.jsonl"
    assert not any(load_partial(out, todo))  # no file yet
    plan = plan_choices(todo, [{}, {}])
    assert [(c.request, c.index) for c in plan] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    tokens = SequenceTokens([todo[c.request].prompt_ids for c in plan], [c.params for c in plan], (),
                            resumed=[[11, 12], [], [13], []])
    ended = {1: {0: Generated([14, 15], "xy", "eos")}}  # request b's choice 0 ended; its record waits for 1 and 2
    Checkpointer(out, todo, plan, ended, interval_s=60).save(tokens)
    a, b = load_partial(out, todo)
    assert (a.tokens, a.finished) == ({0: [11, 12]}, {})
    assert (b.tokens, b.finished) == ({1: [13]}, {0: Generated([14, 15], "xy", "eos")})
    assert b.token_count() == 3
    changed, _ = read_requests(write_lines(tmp_path / "in2.jsonl", [completion("a", [3, 4, 6], max_tokens=9)]), info)
    assert not load_partial(out, changed)[0]  # the request changed: its old tokens are not reused
    partial_path(out).write_text('{"format": "batchgen-partial/1", "requests": {"a": {"digest": "%s", "tokens": '
                                 '[11]}}}' % json.loads(partial_path(out).read_text())["requests"]["a"]["digest"])
    assert load_partial(out, todo)[0].tokens == {0: [11]}  # the first format: choice 0 still decoding
    partial_path(out).write_text('{"format": "batchgen-partial/2", "requ')  # torn: start over, no error
    assert not any(load_partial(out, todo))


def estimate_output(capsys, *overrides: str) -> str:
    from batchgen.run import estimate_job

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("run", overrides=["job.estimate=true", "job.progress=false", *overrides])
    estimate_job(cfg)
    return capsys.readouterr().out


def test_estimate_reads_the_file_and_loads_no_weights(demo, tmp_path, capsys, monkeypatch):
    import batchgen.exec.models.loading as loading

    def no_weights(*args, **kwargs):
        raise AssertionError("the estimate must not load weights")

    monkeypatch.setattr(loading, "load_model", no_weights)
    lines = [completion(f"a{k}", "The quick brown fox " * (1 + k % 5), max_tokens=64) for k in range(150)]
    lines += [chat(f"c{k}", "Summarize this text " * 3, max_tokens=32, ignore_eos=True) for k in range(50)]
    lines.append("{bad")
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    out = estimate_output(capsys, f"model.path={demo}", f"job.input={requests}", "cluster=h100_8",
                          "job.estimate_policies=[coroutine,static]")
    assert "200 requests" in out and "batchgen-demo-moe" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["coroutine"], ["static"])]
    assert [r[0] for r in rows] == ["coroutine", "static"]
    assert "output lengths" in out and "1 line of the input is bad and would get an error record" in out
    assert "approximate" not in out  # the demo directory has a tokenizer


def test_estimated_policies_read_the_models_context_as_a_run_does(tmp_path, capsys, monkeypatch):
    """A policy the estimate loads from its file (not the job's +policy) is composed with the model: sglang_opt's
    output reserve reads the model's context, as in a run (loaded alone, the file gives 0: context unknown)."""
    import batchgen.batch.estimate as estimate_module
    from batchgen.specs import load_model

    class Seen(Exception):
        pass

    def capture(model, cluster, inp, policies, **kwargs):
        raise Seen(policies)
    monkeypatch.setattr(estimate_module, "estimate", capture)
    requests = write_lines(tmp_path / "requests.jsonl", [completion(f"a{k}", "word " * 50, max_tokens=16)
                                                         for k in range(5)])
    with pytest.raises(Seen) as seen:
        estimate_output(capsys, f"job.input={requests}", "model=qwen3_30b_a3b", "cluster=h100_8",
                        "job.estimate_policies=[sglang_opt,continuous]")
    contexts = [p["model_context"] for p in seen.value.args[0]]
    assert contexts == [load_model("qwen3_30b_a3b").max_context] * 2


def test_estimate_without_a_model_directory_guesses_prompt_lengths(tmp_path, capsys):
    requests = write_lines(tmp_path / "requests.jsonl",
                           [completion(f"a{k}", "word " * 200, max_tokens=128) for k in range(100)])
    out = estimate_output(capsys, f"job.input={requests}", "model=qwen3_30b_a3b", "cluster=h100_8",
                          "job.estimate_policies=[coroutine]")
    assert "qwen3_30b_a3b" in out and "prompt lengths are approximate" in out
    assert "25,000 prompt tokens" in out  # 100 prompts of 1,000 bytes, about 4 bytes a token


def test_the_example_writes_under_outputs_and_a_job_leaves_only_its_output(tmp_path):
    """The demo writes outputs/demo-model (not the checkout's root), and a batch job writes job.output only: no
    outputs/<date>/<time>/ folder with a config copy and an empty log per run."""
    env = {**os.environ, "BATCHGEN_PROGRESS": "0"}
    demo_run = subprocess.run([sys.executable, "-m", "batchgen.batch.demo"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=env)
    assert demo_run.returncode == 0, demo_run.stderr
    before = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    assert before == {"outputs", "outputs/demo-model", *(f"outputs/demo-model/{f}" for f in (
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "requests.jsonl"))}
    job = subprocess.run([sys.executable, "-m", "batchgen.run", *SMALL_EXEC, "model.path=outputs/demo-model",
                          "job.input=outputs/demo-model/requests.jsonl", "job.output=outputs/results.jsonl"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert job.returncode == 0, job.stderr
    after = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    assert after - before == {"outputs/results.jsonl"}
    assert len(read_records(tmp_path / "outputs" / "results.jsonl")) == 3
