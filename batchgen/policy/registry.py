"""Policies by name, built from their Hydra config node."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from batchgen.policy.base import Policy, PolicyDefaults
from batchgen.policy.continuous import ContinuousPolicy
from batchgen.policy.coroutine import CoroutinePolicy
from batchgen.policy.offload import FlexGenPolicy, MoELightningPolicy, ZeroInferencePolicy
from batchgen.policy.pd_disagg import PDDisaggPolicy
from batchgen.policy.sglang_opt import SGLangOptPolicy
from batchgen.policy.static import StaticPolicy

POLICIES: dict[str, type] = {"coroutine": CoroutinePolicy, "continuous": ContinuousPolicy, "static": StaticPolicy,
                             "sglang_opt": SGLangOptPolicy, "pd_disagg": PDDisaggPolicy, "flexgen": FlexGenPolicy,
                             "moe_lightning": MoELightningPolicy, "zero_inference": ZeroInferencePolicy}
for _cls in POLICIES.values():  # the optional members of the Policy protocol, with their defaults
    if not issubclass(_cls, PolicyDefaults):
        raise TypeError(f"policy class {_cls.__name__} must inherit batchgen.policy.base.PolicyDefaults")
_FIXED = {"can_stream_weights", "uses_host_kv"}  # properties of the policy, not knobs
# whole-number knobs that also take "auto" (resolved before the job runs)
_AUTO_KNOBS = {"attention_tp", "prefill_tokens_per_rank"}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(cfg: Mapping[str, Any]) -> Policy:
    cfg = dict(cfg)
    name = cfg.get("name")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(policy_names())} "
                         "(e.g. +policy=coroutine)")
    cls = POLICIES[name]
    knobs = {f.name for f in fields(cls)} - _FIXED - {"name"}
    unknown = sorted(set(cfg) - knobs - {"name"})
    if unknown:
        raise ValueError(f"policy {name} has no setting {', '.join(unknown)}: valid settings are "
                         f"{', '.join(sorted(knobs))}")
    for key, value in cfg.items():
        if key != "name" and not (value == "auto" and (key in _AUTO_KNOBS or key in getattr(cls, "engine_knobs", ()))):
            _check_type(name, key, value, type(getattr(cls, key)))
    return cls(**cfg)


def _check_type(policy: str, key: str, value: Any, kind: type) -> None:
    """Knobs are typed by their defaults: a fraction where a count is due, or a word where a switch is
    due, is a mistake the user should hear about before the run, not a crash or a silent `True` later."""
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(kind, lambda v: True)
    if not ok(value):
        what = {bool: "true or false", int: "a whole number", float: "a number"}[kind]
        raise ValueError(f"policy.{key} of policy {policy} must be {what}, got {value!r}")
