"""Overrides work as typed: every `section.key` that batchgen's messages tell users to set composes without `+`,
and keys a command does not read are rejected with the valid ones listed (batchgen.overrides)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from batchgen.confdir import conf_dir
from batchgen.memory import ConfigError
from batchgen.overrides import SIM_KEYS, check_known_keys, valid_top_level_keys

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "batchgen"
SECTIONS = ("workload", "backend", "policy", "memory", "efficiency", "latency", "cluster", "model", "output", "job")
# section.key[.sub], not preceded by a word character, a dot, a slash (a path) or + (adding a key, not setting one),
# not followed by a word character or "(" (a method call: model.kv_cache_geometry())
KEY = re.compile(r"(?<![\w./+])(" + "|".join(SECTIONS) + r")\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)(=?)(?![\w(])")
# names in messages that look like config keys but are not: tensor and file names of Hugging Face checkpoints
NOT_KEYS = {"model.safetensors", "model.safetensors.index", "model.layers", "model.embed_tokens.weight",
            "model.norm.weight"}
# the command whose config a file's messages are about (batch jobs: conf/run.yaml)
RUN_FILES = ("batch/", "run.py")
# what a key needs selected to exist: the executor's settings, the coroutine policy's knobs
CONTEXT = {"backend": ("backend=exec",), "policy": ("+policy=coroutine",)}


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def keys_named_in_source() -> dict[tuple[str, str], list[str]]:
    """{(config name, section.key): [file:line, ...]} for every key a string literal of batchgen/ names: all of
    them in messages and other strings, and in docstrings those shown being set (`section.key=`)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        config = "run" if rel.startswith(RUN_FILES) else "config"
        tree = ast.parse(path.read_text(), filename=str(path))
        docs = _docstring_ids(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for m in KEY.finditer(node.value):
                key = f"{m.group(1)}.{m.group(2)}"
                if key in NOT_KEYS or (id(node) in docs and not m.group(3)):
                    continue
                found.setdefault((config, key), []).append(f"batchgen/{rel}:{node.lineno}")
    return found


FOUND = keys_named_in_source()


def compose_cfg(*overrides: str, config: str = "config"):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


@functools.lru_cache(maxsize=None)
def composed(overrides: tuple[str, ...], config: str):
    return compose_cfg(*overrides, config=config)


def test_the_source_names_the_keys_this_test_is_about():
    """Not vacuous: the messages the issue was about are found."""
    keys = {key for _, key in FOUND}
    for key in ("workload.max_input", "workload.max_output", "backend.kv_budget_mb", "backend.staging_mb",
                "policy.b_attn", "latency.calibration", "cluster.gpus_per_instance",
                "memory.activation_reserve_gb"):
        assert key in keys, f"{key} not found among {sorted(keys)}"


def _dist_only_keys() -> set[str]:
    """Settings of backend=dist that backend=exec does not have (backend.procs, ...)."""
    from dataclasses import fields

    from batchgen.dist.run import DistSettings
    from batchgen.exec.run import ExecSettings
    return {f.name for f in fields(DistSettings)} - {f.name for f in fields(ExecSettings)}


def context_for(key: str) -> tuple[str, ...]:
    """What `key` needs selected to exist; a policy knob: the policy whose file defines it (coroutine if none)."""
    section, _, name = key.partition(".")
    if section == "backend" and name in _dist_only_keys():
        return ("backend=dist",)
    if section == "backend" and name in SIM_KEYS:
        return ()  # the default backend, the simulator's own settings
    if section == "workload" and name.startswith("prefix"):  # a workload with shared prefixes, of either size key
        if name.startswith("prefix.outer"):
            return ("workload=fewshot_pass_at_k",)  # nested groups
        return ("workload=fewshot_eval",) if name == "prefix.groups" else ("workload=rl_rollout_grouped",)
    if section == "policy":
        for file in sorted((conf_dir() / "policy").glob("*.yaml")):
            if name.split(".")[0] in (OmegaConf.load(file) or {}):
                return (f"+policy={file.stem}",)
    return CONTEXT.get(section, ())


@pytest.mark.parametrize("config,key", sorted(FOUND), ids=[f"{c}:{k}" for c, k in sorted(FOUND)])
def test_every_key_a_message_names_works_as_typed(config, key):
    where = ", ".join(FOUND[(config, key)][:3])
    context = context_for(key)
    value = OmegaConf.select(composed(context, config), key)
    # set it to what it is (a changed backend.name would be another config), or null for a node or a missing key
    typed = (str(value).lower() if isinstance(value, bool) else f"'{value}'" if isinstance(value, str)
             else str(value) if isinstance(value, (int, float)) else "null")
    try:
        cfg = compose_cfg(*context, f"{key}={typed}", config=config)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors vary
        pytest.fail(f"{key} (named in {where}) does not compose without +: {str(e).splitlines()[0]}")
    check_known_keys(cfg, "batchgen.run" if config == "run" else "batchgen.experiment")


def test_shipped_configs_hold_only_known_keys():
    for overrides in [(), ("backend=exec",), ("backend=dist",), ("+policy=coroutine", "latency=table"),
                      ("+experiment=paper_scale_12k_4k", "workload=azure_conv", "efficiency=datasheet")]:
        check_known_keys(compose_cfg(*overrides))
    check_known_keys(compose_cfg("+policy=coroutine", config="run"), "batchgen.run")


@pytest.mark.parametrize("workload", sorted(p.stem for p in (conf_dir() / "workload").glob("*.yaml")))
def test_every_workload_takes_the_clips(workload):
    cfg = compose_cfg(f"workload={workload}", "workload.max_input=100", "workload.max_output=50")
    assert cfg.workload.max_input == 100 and cfg.workload.max_output == 50


def rejected(*overrides: str, command: str = "batchgen.experiment", config: str = "config") -> str:
    with pytest.raises(ConfigError) as e:
        check_known_keys(compose_cfg(*overrides, config=config), command)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_top_level_typo_suggests_the_key_and_lists_the_valid_ones():
    msg = rejected("+page_token=16")
    assert "unknown key page_token; did you mean page_tokens?" in msg
    for key in valid_top_level_keys():
        assert key in msg
    assert "hydra" not in msg


def test_a_data_folder_is_not_a_key():
    msg = rejected("+hardware=h20")
    assert "hardware is not a key" in msg and "cluster.gpu=h20" in msg
    assert "cluster.host=epyc_7453_1s" in rejected("+host=epyc_7453_1s")


def test_a_section_key_at_the_top_level():
    assert "did you mean cluster.num_gpus?" in rejected("+num_gpus=8")


@pytest.mark.parametrize("override,words", [
    ("+output.csv=false", ("unknown key output.csv", "sequences_csv", "plot")),
    ("+workload.max_inpt=5", ("workload.max_inpt", "did you mean workload.max_input?")),
    ("+memory.gpu_fraction=0.5", ("memory.gpu_fraction", "gpu_memory_fraction")),
    ("+latency.calibraton=x", ("did you mean latency.calibration?",)),
    ("+efficiency.computee=0.5", ("did you mean efficiency.compute?", "kernel_s")),
    ("+backend.kv_budget_mb=8", ("backend.kv_budget_mb", "backend=exec")),
    ("+model.layers=3", ("model.layers", "num_layers")),
    ("+cluster.gpus=8", ("cluster.gpus", "num_gpus")),
])
def test_unknown_section_keys(override, words):
    msg = rejected(override)
    for word in words:
        assert word in msg, msg


def test_executor_keys_with_the_executor():
    msg = rejected("backend=exec", "+backend.kv_budgt=8")
    assert "did you mean backend.kv_budget_mb?" in msg and "staging_mb" in msg
    check_known_keys(compose_cfg("backend=exec", "backend.kv_budget_mb=8", "backend.staging_mb=1"))


def test_every_unknown_key_is_named_at_once():
    msg = rejected("+page_token=16", "+output.csv=false")
    assert "page_token" in msg and "output.csv" in msg


def test_batch_run_config():
    msg = rejected("+policy=coroutine", "+job.inptu=x", command="batchgen.run", config="run")
    assert "did you mean job.input?" in msg
    msg = rejected("+policy=coroutine", "+output.plot=false", command="batchgen.run", config="run")
    assert "unknown key output" in msg


def test_calibration_without_the_table_is_an_error():
    from batchgen.config import build_job
    with pytest.raises(ConfigError, match="latency=table"):
        build_job(compose_cfg("+policy=coroutine", "latency.calibration=x.json"))


def test_a_single_efficiency_factor(tmp_path):
    from batchgen.config import build_job
    job = build_job(compose_cfg("+policy=coroutine", "efficiency.compute=0.5", "workload.num_sequences=10"))
    assert job.efficiency.compute == 0.5
    default = build_job(compose_cfg("+policy=coroutine", "workload.num_sequences=10"))
    assert default.efficiency.memory == job.efficiency.memory != 0.5


# The command line: exit 2 and one useful line (a few only: each run takes seconds).


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen.experiment", "+policy=coroutine", *args,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,words", [
    (("+page_token=16",), ("unknown key page_token", "did you mean page_tokens?")),
    (("+hardware=h20",), ("hardware is not a key", "cluster.gpu=h20")),
], ids=["typo", "hardware"])
def test_cli_rejects_unknown_keys(tmp_path, args, words):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for word in words:
        assert word in errors[0]
    assert not (tmp_path / "run" / "results.json").exists()
