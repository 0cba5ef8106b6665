"""The command line is checked before Hydra (batchgen.cli): a mistyped key, with or without +, and an unknown config
name each get one line naming the fix, never Hydra's advice to add + or its multi-line block; --help says what
the command does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.cli import command_line_problem
from batchgen.confdir import conf_dir

EXPERIMENT, RUN = "batchgen.experiment", "batchgen.run"


@pytest.mark.parametrize("command,args,fix", [
    (EXPERIMENT, ["+policy=coroutine", "workload.num_sequence=100"], "did you mean workload.num_sequences?"),
    (EXPERIMENT, ["+policy=coroutine", "policy.b_moee=64"], "did you mean policy.b_moe?"),
    (RUN, ["+policy=coroutine", "job.inptu=x"], "did you mean job.input?"),
    (EXPERIMENT, ["+policy=corutine"], "did you mean coroutine"),
    (EXPERIMENT, ["+policy=coroutine", "model=qwen3_30b"], "did you mean qwen3_30b_a3b"),
    (EXPERIMENT, ["+policy=coroutine", "cluster=h100"], "did you mean h100_8"),
    (EXPERIMENT, ["+policy=coroutine", "workload=smal"], "did you mean small?"),
    (EXPERIMENT, ["+policy=coroutine", "num_gpus=8"], "did you mean cluster.num_gpus?"),
    (EXPERIMENT, ["policy=coroutine"], "add it with a + (+policy=coroutine)"),
    (EXPERIMENT, ["+policy=coroutine", "+model=tiny_moe"], "drop the + (model=tiny_moe)"),
    (EXPERIMENT, ["+policy=coroutine", "+workload.num_sequences=3"], "drop the + (workload.num_sequences=3)"),
    (EXPERIMENT, ["-m", "+policy=coroutine,statc"], "did you mean static?"),
    (EXPERIMENT, ["+policy=coroutine", "backend=exec", "backend.kv_budget=8"], "did you mean backend.kv_budget_mb?"),
    (EXPERIMENT, ["+policy=coroutine", "polcy.b_moe=3"], "did you mean policy?"),
    (EXPERIMENT, ["policy.b_moe=3"], "+policy=NAME"),
])
def test_a_mistyped_command_line_gets_one_line_naming_the_fix(command, args, fix):
    problem = command_line_problem(args, command)
    assert problem is not None and "\n" not in problem
    assert fix in problem, problem


def test_an_unknown_name_says_where_the_names_are():
    problem = command_line_problem(["+policy=coroutine", "cluster=h100"], EXPERIMENT)
    assert str(conf_dir() / "cluster") in problem and "h20_128" in problem


def test_plain_and_plus_forms_give_the_same_line():
    """`workload.num_sequence=100` is caught before Hydra, `+workload.num_sequence=100` after composition
    (check_known_keys): the user reads the same line either way."""
    from hydra import compose, initialize_config_dir

    from batchgen.memory import ConfigError
    from batchgen.overrides import check_known_keys

    plain = command_line_problem(["+policy=coroutine", "workload.num_sequence=100"], EXPERIMENT)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["+policy=coroutine", "+workload.num_sequence=100"])
    with pytest.raises(ConfigError) as e:
        check_known_keys(cfg, EXPERIMENT)
    assert str(e.value) == plain


@pytest.mark.parametrize("command,args", [
    (EXPERIMENT, ["+policy=coroutine"]),
    (EXPERIMENT, ["-m", "+policy=coroutine,static", "cluster=h100_8,h20_8", "workload.num_sequences=10,20"]),
    (EXPERIMENT, ["+policy=coroutine", "+experiment=rl_rollout", "policy.partition=false"]),
    (EXPERIMENT, ["+policy=coroutine", "backend=exec", "backend.kv_budget_mb=8", "hydra.run.dir=x"]),
    (EXPERIMENT, ["+policy=coroutine", "hydra/launcher=joblib", "workload=glob(*)"]),
    (EXPERIMENT, ["+policy=coroutine", "+page_token=16"]),  # added with +: check_known_keys' business
    (EXPERIMENT, ["+policy=coroutine", "~workload.output", "+workload.output={kind:fixed,value:64}"]),
    (EXPERIMENT, ["--help"]),
    (RUN, ["+policy=coroutine", "job.input=a.jsonl", "job.output=b.jsonl", "model.path=m"]),
])
def test_a_good_command_line_passes(command, args):
    assert command_line_problem(args, command) is None


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_cli_answers_a_typo_without_plus_in_one_line(tmp_path):
    proc = run_cli(tmp_path, EXPERIMENT, "+policy=coroutine", "workload.num_sequence=100")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "did you mean workload.num_sequences?" in proc.stderr and "To append" not in proc.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("command,words", [
    (EXPERIMENT, ("+policy=", "model=", "cluster=", "workload.num_sequences", "backend=exec", "--cfg job")),
    (RUN, ("+policy=", "job.input", "job.output", "model.path", "job.estimate", "--cfg job")),
])
def test_help_says_what_the_command_does(tmp_path, command, words):
    proc = run_cli(tmp_path, command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) < 45, proc.stdout
    for word in words:
        assert word in proc.stdout
    assert "coroutine" in proc.stdout  # the policies are listed
    assert "powered by Hydra" not in proc.stdout


def test_a_launcher_whose_plugin_is_missing_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("hydra_plugins.") else real(name, *a))
    problem = command_line_problem(["-m", "hydra/launcher=slurm", "+policy=coroutine"], EXPERIMENT)
    assert problem == ('hydra/launcher=slurm needs a Hydra plugin that is not installed: pip install "batchgen[slurm]" '
                       "(hydra-submitit-launcher)")
    assert "pip install hydra-joblib-launcher" in command_line_problem(["-m", "hydra/launcher=joblib"], EXPERIMENT)
    assert command_line_problem(["-m", "hydra/launcher=basic", "+policy=coroutine"], EXPERIMENT) is None


def _leaves(node, prefix: str = "") -> list[str]:
    from collections.abc import Mapping

    out = []
    for key, value in node.items():
        out += _leaves(value, f"{prefix}{key}.") if isinstance(value, Mapping) and value else [f"{prefix}{key}"]
    return out


@pytest.mark.parametrize("command,config,context", [
    (EXPERIMENT, "config", ["+policy=coroutine"]),
    (EXPERIMENT, "config", ["+policy=continuous", "backend=exec"]),
    (EXPERIMENT, "config", ["+policy=coroutine", "backend=dist"]),
    (RUN, "run", ["+policy=coroutine"]),
])
def test_every_key_of_the_config_passes_as_typed(command, config, context):
    """The check never rejects a key Hydra would take: every leaf of the composed config, set without +."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config, overrides=context), resolve=False)
    keys = _leaves({k: v for k, v in cfg.items() if k != "hydra"})
    assert len(keys) > 40
    assert command_line_problem([*context, *(f"{k}=1" for k in keys)], command) is None
