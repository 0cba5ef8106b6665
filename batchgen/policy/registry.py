"""Policies by name, built from their Hydra config node."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from batchgen.policy.base import Policy
from batchgen.policy.continuous import ContinuousPolicy
from batchgen.policy.coroutine import CoroutinePolicy
from batchgen.policy.static import StaticPolicy

POLICIES: dict[str, type] = {"coroutine": CoroutinePolicy, "continuous": ContinuousPolicy, "static": StaticPolicy}
_FIXED = {"can_stream_weights", "uses_host_kv"}  # properties of the policy, not knobs


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
        default = getattr(cls, key, None)
        if key != "name" and isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"policy.{key} must be a number, got {value!r}")
    return cls(**cfg)
