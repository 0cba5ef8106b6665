"""Scheduling policies: pure decisions over a snapshot (no simpy, no torch)."""

from batchgen.policy.base import Admit, Decision, Policy, Snapshot
from batchgen.policy.registry import make_policy, policy_names

__all__ = ["Admit", "Decision", "Policy", "Snapshot", "make_policy", "policy_names"]
