"""The result tables written from columns are the files the row-by-row writer made, byte for byte, and each
file can be turned off.

The reference writers below are row by row (csv.DictWriter over `BoundaryDecision.row()` with each instance's
running sets as Python-set differences, numpy.savetxt), kept here as the oracle; decisions.csv also reads back as
the trace it was written from.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from batchgen.decisions import (CHANGED_FIELDS, FILE_COLUMNS, BoundaryDecision, DecisionColumns, DeferredDecision,
                                ids_of, ranges, read_decisions, sorted_within, trace_of)
from batchgen.results import csvtext, write_results, writer
from batchgen.results.metrics import step_arrays
from batchgen.sim.run import simulate
from test_sim_paths import CASES, KV_PAGES

TABLES = ("decisions.csv", "steps.csv", "sequences.csv")
JOBS = ("continuous-a100-preempting", "coroutine-a100", "coroutine-host-2x8", "sglang_opt-a100-unmixed",
        "static-tiny-8", "pd_disagg-tiny-2x4")  # evictions, host-resident KV, migrations, partitions, flags


# ---- the row-by-row writer, as it was ------------------------------------------------------------------------

def reference_decisions(path: Path, records) -> None:
    before: dict[tuple[int, str], set] = {}
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["boundary", *FILE_COLUMNS])
        w.writeheader()
        for k, d in enumerate(trace_of(records)):
            row = {"boundary": k, **d.row()}
            for f in CHANGED_FIELDS:
                now, was = set(getattr(d, f)), before.get((d.instance, f), set())
                before[(d.instance, f)] = now
                del row[f]
                row[f"{f}_joined"], row[f"{f}_left"] = ranges(sorted(now - was)), ranges(sorted(was - now))
            w.writerow(row)


def reference_sequences(path: Path, out) -> None:
    t = out.prepared.state.table
    cols = (np.arange(len(t)), t.input_len, t.output_len, t.first_token_time, t.finish_time, t.instance,
            t.yields, t.migrations, t.recomputes)
    np.savetxt(path, np.column_stack(cols), fmt=["%d", "%d", "%d", "%.6f", "%.6f", "%d", "%d", "%d", "%d"],
               delimiter=",", header=",".join(writer.SEQUENCE_COLUMNS), comments="")


def reference_steps(path: Path, out) -> None:
    s = step_arrays(out)
    ranks = max(s.busy.shape[1], 1)
    cols = (s.instance, s.start, s.duration, s.phase, s.iterations, s.tokens, s.running, s.expert_tokens,
            s.expert_calls, s.busy.sum(axis=1) / ranks, s.busy.max(axis=1, initial=0.0))
    table = np.empty((len(s), len(cols)), dtype=object)
    for j, c in enumerate(cols):
        table[:, j] = c
    np.savetxt(path, table, fmt=["%d", "%.6f", "%.6f", "%s", "%d", "%d", "%d", "%.1f", "%d", "%.6f", "%.6f"],
               delimiter=",", header=",".join(writer.STEP_COLUMNS), comments="")


def reference_tables(out, run_dir: Path) -> dict[str, bytes]:
    """The three tables as the old writer made them (this resolves the records' decisions)."""
    run_dir.mkdir()
    reference_decisions(run_dir / "decisions.csv", out.records)
    reference_sequences(run_dir / "sequences.csv", out)
    reference_steps(run_dir / "steps.csv", out)
    return {name: (run_dir / name).read_bytes() for name in TABLES}


# ---- simulated jobs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", JOBS)
def test_tables_are_the_row_by_row_writers(case, tmp_path):
    job = dataclasses.replace(CASES[case](), check_invariants=False)
    out = simulate(job, progress=False, kv_pages_per_gpu=KV_PAGES.get(case))
    assert any(isinstance(r.summary, DeferredDecision) for r in out.records)  # the columns read them unresolved
    columns = DecisionColumns.of(out.records)
    paths = write_results(out, tmp_path / "columns", {})
    new = {name: paths[name].read_bytes() for name in TABLES}
    old = reference_tables(out, tmp_path / "rows")
    for name in TABLES:
        assert new[name] == old[name], name
    trace = trace_of(out.records)
    assert len(columns) == len(trace) and read_decisions(paths["decisions.csv"]) == trace
    # and from records whose decisions were resolved already (BoundaryDecisions, as tests/test_sim_paths.py makes them)
    again = write_results(out, tmp_path / "resolved", {})
    assert again["decisions.csv"].read_bytes() == old["decisions.csv"]


# ---- decisions the simulator rarely makes: idle changes folded in, duplicates, admits, host residency ---------

def _deferred(rng: np.random.Generator, folded: BoundaryDecision | None) -> DeferredDecision:
    def ids(most=12):
        return rng.permutation(rng.integers(0, 40, rng.integers(0, most)))  # unsorted, repeats possible

    decode = rng.permutation(rng.choice(60, rng.integers(0, 30), replace=False))
    plan = SimpleNamespace(instance=int(rng.integers(0, 3)), phase=str(rng.choice(["decode", "mixed", "prefill"])),
                           prefill_ids=ids(), chunk_ids=ids(), decode_ids=decode,
                           decode_host_resident=rng.random(decode.size) < 0.3, steps=int(rng.integers(1, 64)),
                           stop=str(rng.choice(["none", "first_finish"])), micro_batch=int(rng.integers(0, 3)))
    decision = SimpleNamespace(yield_ids=ids(), offload_ids=ids(), evict_ids=ids(), move_ids=ids(),
                               admits=[SimpleNamespace(ids=ids(4)) for _ in range(rng.integers(0, 3))],
                               partition_ids=ids(), pin_ids=ids(), prefill_to_host=bool(rng.random() < 0.3),
                               host_sync=bool(rng.random() < 0.3), cpu_attention=False,
                               padded=bool(rng.random() < 0.5), chunks_only=False)
    return DeferredDecision(decision, plan, folded)


def test_columns_fold_idle_changes_as_the_trace_does(tmp_path):
    rng = np.random.default_rng(3)
    records = []
    for k in range(60):
        folded = _deferred(rng, None).resolve() if k % 3 == 0 else None
        records.append(SimpleNamespace(summary=_deferred(rng, folded)))
    records.append(SimpleNamespace(summary=None))  # a record without a decision is skipped
    columns = DecisionColumns.of(records)
    writer._write_decisions(tmp_path / "columns.csv", columns)
    records_for_trace = [SimpleNamespace(decision=r.summary.resolve() if r.summary else None) for r in records]
    trace = trace_of(records_for_trace)
    assert len(columns) == len(trace) == 60
    assert read_decisions(tmp_path / "columns.csv") == trace
    reference_decisions(tmp_path / "rows.csv", records_for_trace)
    assert (tmp_path / "columns.csv").read_bytes() == (tmp_path / "rows.csv").read_bytes()


def test_ranges_read_back():
    rng = np.random.default_rng(1)
    for _ in range(50):
        ids = tuple(sorted(set(rng.integers(0, 40, rng.integers(0, 20)).tolist())))
        assert ids_of(ranges(ids)) == ids
    assert ranges((0, 1, 2, 5)) == "0-2 5" and ids_of("") == ()


def test_rows_are_sorted_within_and_only_within():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 9, 200)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    ids = rng.integers(0, 30, offsets[-1])
    expected = np.concatenate([np.sort(ids[a:b]) for a, b in zip(offsets[:-1], offsets[1:])])
    assert np.array_equal(sorted_within(ids.copy(), offsets), expected)
    assert sorted_within(np.array([5]), np.array([0, 0, 1, 1])).tolist() == [5]


# ---- the text of whole columns against the csv module --------------------------------------------------------

@pytest.mark.parametrize("block", [1, 7, 1 << 18])
@pytest.mark.parametrize("largest", [50, 10**17])  # fewer values than tokens (looked up), and more
def test_columns_text_is_the_csv_modules(block, largest, monkeypatch, tmp_path):
    monkeypatch.setattr(csvtext, "BLOCK_TOKENS", block)  # blocks of a row or less, and all rows in one
    rng = np.random.default_rng(block)
    rows = 300
    sizes = rng.integers(0, 25, rows)
    sizes[::9] = 0
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    ids = np.concatenate([np.sort(rng.integers(0, min(largest, 10 ** int(rng.integers(1, 14))), n)) for n in sizes])
    ints = rng.integers(-largest, largest, rows)
    ints[::4] = rng.integers(-3, 10, len(ints[::4]))
    words = ["mixed", "", "first_finish", "a,b", 'say "x"', "two\nlines", "prefill_to_host,host_sync,cpu_attention"]
    strs = [words[i] for i in rng.integers(0, len(words), rows)]
    csvtext.write(tmp_path / "t.csv", ["n", "ids", "s", "big", "tail"],
                  [csvtext.Numbers(np.arange(rows)), csvtext.Ranges(ids, offsets), csvtext.Strings(strs),
                   csvtext.Numbers(ints), csvtext.Ranges(np.zeros(0, np.int64), np.zeros(rows + 1, np.int64))])
    out = io.StringIO(newline="")
    w = csv.DictWriter(out, fieldnames=["n", "ids", "s", "big", "tail"])
    w.writeheader()
    for r in range(rows):
        w.writerow({"n": r, "ids": ranges(ids[offsets[r]:offsets[r + 1]].tolist()), "s": strs[r],
                    "big": int(ints[r]), "tail": ""})
    assert (tmp_path / "t.csv").read_bytes() == out.getvalue().encode()


def test_a_table_without_rows_is_its_header(tmp_path):
    csvtext.write(tmp_path / "t.csv", ["a", "b"], [csvtext.Numbers(np.zeros(0, np.int64)), csvtext.Strings([])])
    assert (tmp_path / "t.csv").read_bytes() == b"a,b\r\n"


def test_formatted_rows_are_savetxts(monkeypatch):
    monkeypatch.setattr(csvtext, "BLOCK_ROWS", 3)
    cols = [np.arange(10), np.linspace(-1, 1e6, 10), np.array(["a", "b"] * 5, dtype=object), np.full(10, np.nan)]
    fmt = ["%d", "%.6f", "%s", "%.1f"]
    table = np.empty((10, 4), dtype=object)
    for j, c in enumerate(cols):
        table[:, j] = c
    expected = io.StringIO()
    np.savetxt(expected, table, fmt=fmt, delimiter=",")
    got = io.StringIO()
    csvtext.formatted(got, fmt, cols)
    assert got.getvalue() == expected.getvalue()


# ---- switches -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_run():
    return simulate(dataclasses.replace(CASES["continuous-tiny-8"](), check_invariants=False), progress=False)


@pytest.mark.parametrize("name", writer.TABLES)
def test_each_table_can_be_turned_off(small_run, name, tmp_path):
    paths = write_results(small_run, tmp_path, {}, skip={name})
    written = {p.name for p in tmp_path.iterdir()}
    assert name not in paths and name not in written
    assert written == {"results.json", *writer.TABLES} - {name} == set(paths)


def test_an_unknown_table_is_refused(small_run, tmp_path):
    with pytest.raises(ValueError, match="decision.csv"):
        write_results(small_run, tmp_path, {}, skip={"decision.csv"})


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from batchgen.confdir import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=["+policy=coroutine", *overrides])


def test_output_switches_name_the_files_they_turn_off():
    from batchgen.config import OUTPUT_FILES, skipped_outputs

    assert skipped_outputs(_composed()) == set()
    for key, name in OUTPUT_FILES.items():
        assert skipped_outputs(_composed(f"output.{key}=false")) == {name}


@pytest.mark.parametrize("value", ["maybe", "1", "null"])
def test_a_switch_that_is_not_a_bool_is_a_config_error(value):
    from batchgen.config import skipped_outputs
    from batchgen.memory import ConfigError

    with pytest.raises(ConfigError, match=r"output\.decisions_csv must be true or false"):
        skipped_outputs(_composed(f"output.decisions_csv={value}"))
