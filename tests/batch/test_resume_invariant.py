"""A batch job interrupted mid-decode and resumed, in batch-invariant mode (backend.batch_invariant=true), writes
exactly the records of an uninterrupted run, greedy and sampled: the resumed requests' KV is recomputed in one
prefill of prompt + saved tokens, which in this mode gives the bits the decode steps gave (docs/batch-jobs.md).
The interruption is an exception raised right after a checkpoint, which leaves the results file and the
checkpoint as a SIGKILL there would (tests/batch/test_batch_job.py kills real processes)."""

import json

import pytest

from batchgen.batch.checkpoint import Checkpointer, partial_path

from .test_batch_job import (  # noqa: F401
    chat,
    comparable,
    completion,
    demo,
    read_records,
    run_in_process,
    write_lines,
)

INVARIANT = ("backend.batch_invariant=true",)


class Killed(BaseException):
    """Not an Exception: nothing on the way may catch it, as nothing survives a SIGKILL."""


def requests_file(tmp_path):
    lines = []
    for k in range(40):
        sampled = {"temperature": 0.8, "seed": k} if k % 2 else {}
        make = chat if k % 5 == 0 else completion
        lines.append(make(f"r{k}", f"Tell me story {k} about the sea", max_tokens=24 + (k * 37) % 90, **sampled))
    return write_lines(tmp_path / "requests.jsonl", lines)


def test_a_resumed_job_equals_the_uninterrupted_one_in_batch_invariant_mode(demo, tmp_path, monkeypatch):  # noqa: F811
    requests = requests_file(tmp_path)
    baseline = tmp_path / "baseline.jsonl"
    run_in_process(demo, requests, baseline, *INVARIANT)

    save, saves = Checkpointer.save, []

    def save_then_die(self, tokens):
        save(self, tokens)
        saves.append(1)
        if len(saves) == 2:
            raise Killed

    output = tmp_path / "results.jsonl"
    monkeypatch.setattr(Checkpointer, "save", save_then_die)
    with pytest.raises(Killed):
        run_in_process(demo, requests, output, *INVARIANT, "job.checkpoint_s=0.001")
    monkeypatch.setattr(Checkpointer, "save", save)
    mid_decode = json.loads(partial_path(output).read_text())["requests"]
    written = len(read_records(output)) if output.exists() else 0
    assert len(mid_decode) >= 10 and written < 40, (len(mid_decode), written)

    run_in_process(demo, requests, output, *INVARIANT)
    assert comparable(read_records(output)) == comparable(read_records(baseline))
