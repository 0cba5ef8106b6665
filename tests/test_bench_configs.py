"""Policies composed from their config files outside Hydra (the estimate, the benchmark scripts) read the model as a
run does: `batchgen.setup.policy_config`."""

import sys
from pathlib import Path

import pytest

from batchgen.memory import ConfigError
from batchgen.policy import make_policy, policy_names
from batchgen.setup import policy_config
from batchgen.specs import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_file_composes_with_the_models_context(name):
    spec = load_model("small_moe")
    policy = make_policy(policy_config(name, spec))
    assert policy.name == name
    if name in ("continuous", "sglang_opt"):
        assert policy.model_context == spec.max_context  # ${model.max_context} resolved, not 0 or a string
        assert make_policy(policy_config(name, spec, page_lookahead=7)).page_lookahead == 7  # overrides on top


def test_an_unknown_policy_name_says_which_exist():
    with pytest.raises(ConfigError, match="no policy 'contnuous'.*continuous"):
        policy_config("contnuous", load_model("small_moe"))


def test_the_benchmark_scripts_compose_policies_so():
    import sim_scale
    assert sim_scale._load_policy("sglang_opt", load_model("llama2_7b")).model_context == 4096
    pytest.importorskip("transformers")
    import exec_throughput
    assert exec_throughput.policy_config is policy_config
