"""Bad input gets a clear error before the simulation starts.

Most cases run in-process: the config is composed with Hydra's compose API and validated by
`build_job` + `prepare` (everything a backend does before its first step), which must raise ConfigError
with a message naming the problem and the fix. A few cases then run the real command line to prove it exits
with status 2, prints a one-line `error: ...` (no traceback) and writes no results.json. Errors that Hydra
itself raises (an unknown config group option, an override of a key that does not exist) are accepted as
long as they name the bad value and the valid ones.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from batchgen.confdir import conf_dir
from batchgen.config import build_job
from batchgen.job import prepare
from batchgen.memory import ConfigError
from batchgen.policy import policy_names

CONF = conf_dir()
POLICIES = ("continuous", "coroutine", "flexgen", "moe_lightning", "pd_disagg", "sglang_opt", "static",
            "zero_inference")
SMALL = "workload.num_sequences=50"


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def config_error(tmp_path: Path, *overrides: str) -> str:
    """Compose, build and prepare the job; it must fail with ConfigError. Returns the message."""
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as info:
        prepare(build_job(cfg, base_dir=tmp_path))
    return str(info.value)


def hydra_error(*overrides: str) -> str:
    with pytest.raises(HydraException) as info:
        compose_cfg(*overrides)
    return str(info.value)


def assert_mentions(message: str, *words: str) -> None:
    for word in words:
        assert word in message, f"{word!r} not in the error message:\n{message}"


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen.experiment", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def assert_no_results(tmp_path: Path) -> None:
    assert not list(tmp_path.rglob("results.json")), "a failed run must not write results.json"


def assert_clean_cli_error(tmp_path: Path, proc: subprocess.CompletedProcess) -> str:
    """Exit 2, one `error: ...` line as the last thing on stderr, no traceback, no results."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one final 'error: ...' line:\n{proc.stderr}"
    assert_no_results(tmp_path)
    return errors[0]


# ---------------------------------------------------------------------------------------------------------------
# Unknown names: the valid ones are listed.


def test_policy_names_match_the_config_group():
    assert tuple(policy_names()) == POLICIES == tuple(group_options("policy"))


def test_no_policy(tmp_path):
    msg = config_error(tmp_path)
    assert_mentions(msg, "+policy=", *POLICIES)


def test_unknown_policy(tmp_path):
    msg = hydra_error("+policy=nope")
    assert_mentions(msg, "nope", *POLICIES)


def test_unknown_policy_name_inside_the_node(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "policy.name=nope")
    assert_mentions(msg, "nope", *POLICIES)


@pytest.mark.parametrize("group", ["model", "cluster", "workload"])
def test_unknown_group_option(group):
    valid = group_options(group)
    assert len(valid) >= 3
    msg = hydra_error("+policy=coroutine", f"{group}=nope")
    assert_mentions(msg, "nope", group, *valid)


def test_unknown_backend(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "backend.name=real")
    assert_mentions(msg, "real", "sim")


# ---------------------------------------------------------------------------------------------------------------
# Numbers out of range.


@pytest.mark.parametrize("value", [0, -8])
def test_zero_or_negative_gpus(tmp_path, value):
    msg = config_error(tmp_path, "+policy=coroutine", f"cluster.num_gpus={value}")
    assert_mentions(msg, "cluster.num_gpus", str(value), "positive")


@pytest.mark.parametrize("override,key", [("cluster.gpus_per_node=0", "cluster.gpus_per_node"),
                                          ("cluster.gpus_per_instance=-1", "cluster.gpus_per_instance"),
                                          ("cluster.num_gpus=1.5", "cluster.num_gpus")])
def test_bad_cluster_shape(tmp_path, override, key):
    msg = config_error(tmp_path, "+policy=coroutine", override)
    assert_mentions(msg, key)


@pytest.mark.parametrize("workload,override,key", [
    ("fixed_1k_1k", "workload.input.value=-5", "workload.input"),
    ("fixed_1k_1k", "workload.output.value=-5", "workload.output"),
    ("small", "workload.input.low=-5", "workload.input"),
    ("small", "workload.output.mean=-5", "workload.output"),
    ("azure_conv", "+workload.max_input=-5", "workload.max_input"),
])
def test_negative_length(tmp_path, workload, override, key):
    msg = config_error(tmp_path, "+policy=coroutine", f"workload={workload}", override)
    assert_mentions(msg, key, "-5")


@pytest.mark.parametrize("workload", ["small", "azure_conv"])
@pytest.mark.parametrize("value", [-3, 0])
def test_bad_num_sequences(tmp_path, workload, value):
    msg = config_error(tmp_path, "+policy=coroutine", f"workload={workload}", f"workload.num_sequences={value}")
    assert_mentions(msg, "workload.num_sequences", str(value), "positive")


# ---------------------------------------------------------------------------------------------------------------
# Memory: weights that fit nowhere, or only with weight streaming.


@pytest.mark.parametrize("model,cluster", [("mixtral_8x7b", "a5000_1"), ("deepseek_r1", "h100_8")])
def test_weights_fit_nowhere(tmp_path, model, cluster):
    """The experts could be streamed (coroutine), but host memory cannot hold the weights either."""
    msg = config_error(tmp_path, "+policy=coroutine", f"model={model}", f"cluster={cluster}",
                       "cluster.host_mem_gb_per_node=64", SMALL)
    assert_mentions(msg, model, "fit nowhere", "cluster.host_mem_gb_per_node")


def test_kimi_fits_nowhere_on_one_a5000(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "model=kimi_k2", "cluster=a5000_1",
                       "cluster.host_mem_gb_per_node=64", SMALL)
    assert_mentions(msg, "kimi_k2", "fit nowhere", "host")


def test_too_big_for_one_gpu_suggests_more_gpus(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "model=kimi_k2", "cluster=a5000_1",
                       "cluster.host_mem_gb_per_node=4000", SMALL)
    assert_mentions(msg, "kimi_k2", "cluster.num_gpus")


def test_continuous_cannot_stream_weights_suggests_coroutine(tmp_path):
    msg = config_error(tmp_path, "+policy=continuous", "model=deepseek_r1", "cluster=h100_8", SMALL)
    assert_mentions(msg, "deepseek_r1", "continuous", "coroutine")
    # ... and the same job is fine for coroutine, which streams the experts from host memory.
    prepare(build_job(compose_cfg("+policy=coroutine", "model=deepseek_r1", "cluster=h100_8", SMALL),
                      base_dir=tmp_path))


def test_continuous_suggestion_is_a_valid_override(tmp_path):
    msg = config_error(tmp_path, "+policy=continuous", "model=deepseek_r1", "cluster=h100_8", SMALL)
    assert_mentions(msg, "+policy=coroutine")


def test_prompt_longer_than_context(tmp_path):
    msg = config_error(tmp_path, "+policy=continuous", "model=llama2_7b", "workload=longbench_12k_4k")
    assert_mentions(msg, "sequence", "llama2_7b", "4,096", "workload.max_input")


@pytest.mark.parametrize("workload", ["rl_rollout", "rl_rollout_grouped"])
def test_outputs_past_the_context_name_the_cap_that_fits(tmp_path, workload):
    """rl_rollout's outputs reach 65,536 tokens, past Qwen3-30B-A3B's 40,960: the error names both and the
    workload.max_output that fits, and that override builds a job whose longest sequence fits the context."""
    cfg = compose_cfg("+policy=coroutine", f"workload={workload}")
    with pytest.raises(ConfigError) as info:
        build_job(cfg, base_dir=tmp_path)
    msg = str(info.value)
    assert_mentions(msg, workload, "qwen3_30b_a3b", "40,960", "65,536", "workload.max_output=")
    assert "\n" not in msg
    fix = next(w for w in msg.split() if w.startswith("workload.max_output="))
    job = build_job(compose_cfg("+policy=coroutine", f"workload={workload}", fix), base_dir=tmp_path)
    w = job.workload
    assert int((w.input_lens + w.output_lens).max()) <= job.model.max_context
    # the largest cap that surely fits: the context less the longest prompt
    assert int(fix.split("=")[1]) == job.model.max_context - int(w.input_lens.max()) == int(w.output_lens.max())


@pytest.mark.parametrize("overrides", [
    ("workload.prefix.length.high=38000",),
    ("model=tiny_moe", "model.max_context=131072", "workload.prefix.length.high=99999")],
                         ids=["qwen3-38k-prefixes", "tiny_moe-99k-prefixes"])
def test_activations_past_the_gpu_are_named_not_the_weights(tmp_path, overrides):
    """static pads every prefill to the longest prompt: with few-shot prefixes of up to 38K (99K) tokens its
    activations alone pass the GPU. The error says so, with their size; not "needs 0.0 GB of weights"."""
    msg = config_error(tmp_path, "+policy=static", "workload=fewshot_eval", *overrides)
    assert_mentions(msg, "activations of policy static's batch shape", "prompt tokens per prefill forward",
                    "workload.max_input", "smaller batches")
    assert "spread the experts" not in msg and not re.search(r"-[\d.]+ GB", msg)  # no negative "usable" GB
    act, usable = (float(x) for x in re.findall(r"([\d.]+) GB (?:per GPU|usable)", msg))
    assert act > usable > 70  # an H100's 85.5 GB x 0.9 less the 1 GB reserve


def test_weights_that_fit_nowhere_beside_the_activations_name_no_negative_memory(tmp_path):
    """DeepSeek-R1 under static on one A5000: its batch shape's activations alone pass the GPU, and the weights do
    not fit either. The error says nothing is left for them and what takes the memory, not "only -96 GB"."""
    msg = config_error(tmp_path, "+policy=static", "model=deepseek_r1", "cluster=a5000_1", SMALL)
    assert_mentions(msg, "deepseek_r1", "none of its", "activations", "smaller batches")
    assert not re.search(r"-[\d.]+ GB", msg)


# ---------------------------------------------------------------------------------------------------------------
# Files.


def test_missing_trace_names_the_paths_tried(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "workload=azure_conv", "workload.trace=missing.csv")
    shipped = Path(__file__).resolve().parents[1] / "batchgen" / "data" / "traces"
    assert_mentions(msg, "missing.csv", str(tmp_path / "missing.csv"), str(shipped / "missing.csv"),
                    "azure_conv_2023.csv")


def test_trace_relative_to_the_launch_directory(tmp_path):
    """The counterpart: a trace in the directory the command was started from is found."""
    (tmp_path / "mine.csv").write_text("input_len,output_len\n10,20\n30,40\n")
    job = build_job(compose_cfg("+policy=coroutine", "workload=azure_conv", "workload.trace=mine.csv"),
                    base_dir=tmp_path)
    assert list(job.workload.input_lens) == [10, 30] and list(job.workload.output_lens) == [20, 40]


# ---------------------------------------------------------------------------------------------------------------
# Policy knobs: unknown names and wrong types.


def test_unknown_policy_knob_rejected_by_hydra():
    msg = hydra_error("+policy=coroutine", "policy.b_moee=5")
    assert_mentions(msg, "b_moee")


def test_unknown_policy_knob_added_with_plus(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "+policy.b_moee=5")
    assert_mentions(msg, "b_moee", "b_moe", "b_attn")


@pytest.mark.parametrize("policy,key", [("coroutine", "b_moe"), ("coroutine", "host_watermark"),
                                        ("continuous", "max_running"), ("static", "batch_size")])
def test_knob_wrong_type(tmp_path, policy, key):
    msg = config_error(tmp_path, f"+policy={policy}", f"policy.{key}=abc")
    assert_mentions(msg, f"policy.{key}", "abc", "number")


@pytest.mark.parametrize("policy,key", [("coroutine", "b_moe"), ("static", "batch_size")])
def test_knob_out_of_range(tmp_path, policy, key):
    msg = config_error(tmp_path, f"+policy={policy}", f"policy.{key}=0")
    assert_mentions(msg, f"policy.{key}", "0")


def test_integer_knob_given_a_fraction(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "policy.b_moe=1.5", SMALL)
    assert_mentions(msg, "policy.b_moe", "1.5")


def test_bool_knob_given_a_string(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "policy.migrate=abc", SMALL)
    assert_mentions(msg, "policy.migrate", "abc")


# ---------------------------------------------------------------------------------------------------------------
# Top-level settings.


@pytest.mark.parametrize("override,key", [("routing_skew=-1", "routing_skew"), ("seed=-1", "seed"),
                                          ("memory.gpu_memory_fraction=0", "memory.gpu_memory_fraction"),
                                          ("+efficiency.nope=1", "nope")])
def test_bad_top_level_setting(tmp_path, override, key):
    msg = config_error(tmp_path, "+policy=coroutine", override)
    assert_mentions(msg, key)


def test_zero_page_tokens(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "page_tokens=0")
    assert_mentions(msg, "page_tokens")


def test_page_tokens_wrong_type_names_the_key(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "page_tokens=abc")
    assert_mentions(msg, "page_tokens", "abc")


def test_check_invariants_wrong_type(tmp_path):
    msg = config_error(tmp_path, "+policy=coroutine", "check_invariants=abc")
    assert_mentions(msg, "check_invariants", "abc")


# ---------------------------------------------------------------------------------------------------------------
# The command line: exit 2, one `error: ...` line, no traceback, no results.json.


@pytest.mark.parametrize("args,words", [
    ((), ("+policy=", *POLICIES)),
    (("+policy=coroutine", "cluster.num_gpus=0"), ("cluster.num_gpus", "0")),
    (("+policy=coroutine", "workload=fixed_1k_1k", "workload.input.value=-5"), ("workload.input", "-5")),
    (("+policy=coroutine", "workload=azure_conv", "workload.trace=missing.csv"), ("missing.csv", "tried")),
    (("+policy=coroutine", "model=mixtral_8x7b", "cluster=a5000_1", "cluster.host_mem_gb_per_node=64", SMALL),
     ("fit nowhere",)),
    (("+policy=continuous", "model=deepseek_r1", "cluster=h100_8", SMALL), ("coroutine",)),
    (("+policy=continuous", "model=llama2_7b", "workload=longbench_12k_4k"), ("sequence", "4,096")),
    (("+policy=coroutine", "workload=rl_rollout_grouped"), ("40,960", "65,536", "workload.max_output=")),
    (("+policy=coroutine", "policy.b_moe=abc"), ("policy.b_moe", "abc")),
    (("+policy=coroutine", "latency=table", "latency.calibration=nope.json"), ("nope.json", "batchgen.profile")),
    (("+policy=coroutine", "latency=table", "latency.calibration=cpu_epyc_milan_2c-tiny_moe.json"),
     ("tiny_moe", "qwen3_30b_a3b", "batchgen.profile model=qwen3_30b_a3b")),
    (("+policy=coroutine", "backend=exec", "model=deepseek_r1"), ("671.0B parameters", "model=tiny_moe")),
], ids=["no-policy", "zero-gpus", "negative-length", "missing-trace", "fits-nowhere", "continuous-too-big",
        "context", "output-past-context", "wrong-type", "missing-calibration", "calibration-of-another-model", "exec-model-too-large"])
def test_cli_prints_one_error_line_and_exits_2(tmp_path, args, words):
    line = assert_clean_cli_error(tmp_path, run_cli(tmp_path, *args))
    assert_mentions(line, *words)


@pytest.mark.parametrize("args,valid", [
    (("+policy=nope",), POLICIES),
    (("+policy=coroutine", "model=nope"), tuple(group_options("model"))),
    (("+policy=coroutine", "policy.b_moee=5"), ("b_moee",)),
], ids=["policy", "model", "knob"])
def test_cli_unknown_names_list_the_valid_names_in_one_line(tmp_path, args, valid):
    """Caught before Hydra (batchgen.cli): one line, not Hydra's block or its advice to add +."""
    line = assert_clean_cli_error(tmp_path, run_cli(tmp_path, *args))
    assert_mentions(line, *valid)
