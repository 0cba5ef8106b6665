"""The benchmark scripts compose policies from their config files as a run does: each one they use is accepted."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("transformers")
import exec_throughput  # noqa: E402

from batchgen.policy import make_policy  # noqa: E402
from batchgen.specs import load_model  # noqa: E402


@pytest.mark.parametrize("name", ["coroutine", "continuous", "static"])
def test_exec_throughput_policies_resolve_the_models_context(name):
    spec = load_model("small_moe")
    policy = make_policy(exec_throughput.policy_config(name, spec))
    assert policy.name == name
    if name == "continuous":
        assert policy.model_context == spec.max_context  # ${model.max_context} resolved, not a string
