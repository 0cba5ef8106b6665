"""Requests with n choices (OpenAI's `n`): one record per request with choices 0..n-1, each choice its own
sampling stream, usage counting the prompt once; the same records on a second run and after an interruption
that left some choices ended and others mid-decode (the ended ones are kept, not rerun)."""

import json

import pytest

from batchgen.batch.checkpoint import Checkpointer, partial_path
from batchgen.batch.choices import choice_seed

from .test_batch_job import (  # noqa: F401
    chat,
    comparable,
    completion,
    demo,
    read_records,
    run_in_process,
    write_lines,
)
from .test_resume_invariant import INVARIANT, Killed

STOPS = list(range(100, 140))  # ~8% of the demo vocabulary: sampled choices end at different steps


def test_choice_seeds_keep_choice_0_and_differ_between_choices():
    assert choice_seed(42, 0) == 42
    seeds = {choice_seed(42, i) for i in range(64)}
    assert len(seeds) == 64 and choice_seed(42, 5) == choice_seed(42, 5) != choice_seed(43, 5)


def test_n_choices_shape_usage_and_determinism(demo, tmp_path):  # noqa: F811
    lines = [completion("greedy", "The sea is", max_tokens=10, n=3, ignore_eos=True, return_token_ids=True),
             completion("sampled", "The sea is", max_tokens=10, n=3, temperature=1.0, seed=7, ignore_eos=True,
                        return_token_ids=True),
             completion("one", "The sea is", max_tokens=10, temperature=1.0, seed=7, ignore_eos=True,
                        return_token_ids=True),
             chat("chat", "Hello there", max_tokens=6, n=2, temperature=0.9, return_token_ids=True),
             completion("bad", "x", n=0)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run_in_process(demo, requests, first)
    run_in_process(demo, requests, second)
    records = comparable(read_records(first))
    assert records == comparable(read_records(second))  # the same tokens, choice by choice, every run
    greedy, sampled = records["greedy"]["response"]["body"], records["sampled"]["response"]["body"]
    one, talk = records["one"]["response"]["body"], records["chat"]["response"]["body"]
    for body, n in ((greedy, 3), (sampled, 3), (one, 1), (talk, 2)):
        assert [c["index"] for c in body["choices"]] == list(range(n))
    tokens = [c["token_ids"] for c in sampled["choices"]]
    assert [c["token_ids"] for c in greedy["choices"]] == [greedy["choices"][0]["token_ids"]] * 3
    assert len({tuple(t) for t in tokens}) == 3  # each choice its own stream
    assert tokens[0] == one["choices"][0]["token_ids"]  # choice 0 samples with the request's own seed
    prompt = len(sampled["choices"][0]["prompt_token_ids"])
    assert sampled["usage"] == {"prompt_tokens": prompt, "completion_tokens": 30, "total_tokens": prompt + 30}
    assert all(c["message"]["role"] == "assistant" for c in talk["choices"])
    assert talk["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in talk["choices"])
    assert talk["usage"]["prompt_tokens"] == len(talk["choices"][0]["prompt_token_ids"])
    bad = records[("line", 5)]["error"]
    assert bad["code"] == "invalid_parameter" and bad["message"].startswith("line 5: body.n must be an integer")


def test_an_interrupted_job_with_choices_resumes_to_the_same_records(demo, tmp_path, monkeypatch,  # noqa: F811
                                                                     capsys):
    lines = [completion(f"r{k}", f"Tell me story {k} about the sea", max_tokens=30 + 7 * k, n=4, temperature=1.0,
                        seed=k, stop_token_ids=STOPS) for k in range(10)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    baseline = tmp_path / "baseline.jsonl"
    run_in_process(demo, requests, baseline, *INVARIANT)

    save, seen = Checkpointer.save, []

    def save_then_die(self, tokens):
        save(self, tokens)
        entries = json.loads(partial_path(self.output).read_text())["requests"]
        choices = [c for e in entries.values() for c in e["choices"].values()]
        seen.append(choices)
        ended, decoding = sum("finish_reason" in c for c in choices), sum("finish_reason" not in c for c in choices)
        if ended >= 3 and decoding >= 3:  # some requests half done: ended choices beside choices mid-decode
            raise Killed

    output = tmp_path / "results.jsonl"
    monkeypatch.setattr(Checkpointer, "save", save_then_die)
    with pytest.raises(Killed):
        run_in_process(demo, requests, output, *INVARIANT, "job.checkpoint_s=0.001")
    monkeypatch.setattr(Checkpointer, "save", save)
    written = {r["custom_id"] for r in read_records(output)} if output.exists() else set()
    assert len(written) < 10
    ended = sum("finish_reason" in c for c in seen[-1])
    capsys.readouterr()

    run_in_process(demo, requests, output, *INVARIANT)
    # the choices that had ended are not run again: only the others of the unwritten requests are
    assert f"{4 * (10 - len(written)) - ended:,} sequences (choices)" in capsys.readouterr().out
    records = read_records(output)
    assert sorted(r["custom_id"] for r in records) == [f"r{k}" for k in range(10)]  # each once
    assert comparable(records) == comparable(read_records(baseline))
    assert not partial_path(output).exists()
    for r in records:
        assert [c["index"] for c in r["response"]["body"]["choices"]] == [0, 1, 2, 3]


def test_the_estimate_simulates_every_choice(demo, tmp_path, capsys):  # noqa: F811
    from .test_batch_job import estimate_output

    lines = [completion(f"a{k}", "The quick brown fox", max_tokens=32, n=4) for k in range(10)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    out = estimate_output(capsys, f"model.path={demo}", f"job.input={requests}", "cluster=h100_8",
                          "job.estimate_policies=[static]")
    assert "Estimated completion of 10 requests (40 choices)" in out


def test_a_request_whose_choices_all_ended_is_written_from_the_checkpoint(demo, tmp_path, capsys):  # noqa: F811
    """Its record is written as saved, without running anything (the tokens here are not what the model would
    sample: they can only come from the checkpoint)."""
    from batchgen.batch.output import Generated
    from batchgen.batch.requests import ModelInfo, read_requests

    requests = write_lines(tmp_path / "requests.jsonl", [completion("a", [5, 6, 7], n=2, return_token_ids=True)])
    output = tmp_path / "results.jsonl"
    todo, _ = read_requests(requests, ModelInfo.from_dir(demo))
    ended = {0: {0: Generated([1, 2, 3], "abc", "eos"), 1: Generated([4], "d", "length")}}
    Checkpointer(output, todo, [], ended, interval_s=60).save(None)  # no sequence decoding: both choices ended
    run_in_process(demo, requests, output)
    (record,) = read_records(output)
    choices = record["response"]["body"]["choices"]
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in choices] == [
        (0, "abc", [1, 2, 3], "stop"), (1, "d", [4], "length")]
    assert record["response"]["body"]["usage"]["completion_tokens"] == 4
    assert "0 sequences" not in capsys.readouterr().out and not partial_path(output).exists()


@pytest.mark.slow
def test_n8_with_a_shared_system_prompt_killed_twice_then_resumed(demo, tmp_path):  # noqa: F811
    """The issue's check with real SIGKILLs: every custom_id once, every choice in its record, records equal to an
    uninterrupted run (batch-invariant mode, so resumed decodes are bitwise the uninterrupted ones)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from .test_batch_job import SMALL_EXEC

    system = "You are a careful assistant. Answer in one short paragraph and stay on topic. " * 3
    lines = [{"custom_id": f"q{k}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": f"Question {k}: why is the sea salty?"}],
                       "n": 8, "max_tokens": 40 + (k * 13) % 60, "temperature": 1.0, "stop_token_ids": STOPS[:10]}}
             for k in range(12)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    baseline = tmp_path / "baseline.jsonl"
    run_in_process(demo, requests, baseline, *INVARIANT)
    output = tmp_path / "results.jsonl"
    args = [sys.executable, "-m", "batchgen.run", *SMALL_EXEC, *INVARIANT, f"model.path={demo}",
            f"job.input={requests}", f"job.output={output}", "job.checkpoint_s=0.2", f"hydra.run.dir={tmp_path}/h"]
    env = {**os.environ, "BATCHGEN_PROGRESS": "0"}
    kills = 0
    for _ in range(2):
        before = len(output.read_text().splitlines()) if output.exists() else 0
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (output.exists() and len(output.read_text().splitlines()) > before + 2
                    and partial_path(output).exists()):
                break
            time.sleep(0.02)
        time.sleep(0.3)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
    assert kills >= 1, "the job finished before any kill: give it more work"
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    records = read_records(output)
    assert sorted(r["custom_id"] for r in records) == sorted(f"q{k}" for k in range(12))
    assert all(len(r["response"]["body"]["choices"]) == 8 for r in records)
    assert comparable(records) == comparable(read_records(baseline))


def test_a_system_prompt_before_distinct_requests_is_found_and_shared(demo, tmp_path, monkeypatch):  # noqa: F811
    """No `n`, no labels: the requests' tokens show the shared system prompt (workload.prefixes'
    discover_prefixes), and the run prefills it once per GPU instead of once per request; the records equal a run
    that shares nothing."""
    from batchgen.exec import run as exec_run

    runs = []
    real = exec_run.execute

    def watched(job, settings, **kw):
        out = real(job, settings, **kw)
        runs.append(out)
        return out

    monkeypatch.setattr(exec_run, "execute", watched)
    system = "You are a careful assistant. Answer in one short paragraph and stay on topic. " * 4
    lines = [{"custom_id": f"q{k}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": f"Question {k}: why is the sea salty?"}],
                       "max_tokens": 8, "temperature": 0}} for k in range(8)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    shared, plain = tmp_path / "shared.jsonl", tmp_path / "plain.jsonl"
    run_in_process(demo, requests, shared, "page_tokens=16")
    run_in_process(demo, requests, plain, "page_tokens=16", "policy.prefix_cache=false")
    on, off = (r.prepared.state for r in runs)
    w = runs[0].job.workload
    assert (w.prefix_group == w.prefix_group[0]).all() and w.prefix_group[0] >= 0 and w.prefix_len[0] >= 64
    assert on.sharing and on.prefill_computed < off.prefill_computed == int(w.input_lens.sum())
    assert comparable(read_records(shared)) == comparable(read_records(plain))
