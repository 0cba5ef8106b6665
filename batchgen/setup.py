"""What every command builds from its config besides the workload: the policy, the cluster, the memory settings
and the latency model's settings, each validated with a message that says how to fix it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchgen.confdir import conf_dir
from batchgen.latency import Efficiency, LatencySettings, check_calibration, load_efficiency
from batchgen.memory import ConfigError, MemorySettings
from batchgen.policy import make_policy, policy_names
from batchgen.plan.planner import AUTO
from batchgen.policy.base import Policy
from batchgen.specs import ClusterSpec, ModelSpec, cluster_from_config


@dataclass(frozen=True)
class Setup:
    policy: Policy | None
    cluster: ClusterSpec
    memory: MemorySettings
    efficiency: Efficiency
    latency: LatencySettings
    page_tokens: int
    routing_skew: float
    check_invariants: bool
    instances_planned: bool = False  # cluster.gpus_per_instance=auto: the job's planner sizes the instances


def plain(node: Any) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})


def policy_config(name: str, model: ModelSpec, **overrides) -> dict:
    """Policy `name`'s config file as a run composes it for `model`, then `overrides`: its interpolations of the
    model resolved (continuous and sglang_opt read ${model.max_context} for SGLang's output reserve; loaded
    alone, the file would give 0, the reserve of a model whose context is unknown)."""
    path = conf_dir() / "policy" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no policy {name!r}: choose one of {', '.join(policy_names())}")
    root = OmegaConf.create({"model": {"max_context": model.max_context}})
    root.policy = OmegaConf.load(path)
    return {**OmegaConf.to_container(root.policy, resolve=True), **overrides}


def model_path(cfg: DictConfig) -> str | None:
    """A model directory given as model.path (or, for the executor, backend.model_path)."""
    backend = cfg.get("backend") or {}
    return cfg.model.get("path") or (backend.get("model_path") if backend.get("name") in ("exec", "dist") else None)


def model_spec(cfg: DictConfig, element_bytes: float | None = None) -> ModelSpec:
    """The model's shape and name: from config.json when a model directory is given (what actually runs, in
    `element_bytes` per weight or the checkpoint's own), else the `model` group's spec."""
    path = model_path(cfg)
    if not path:
        try:
            return ModelSpec.from_dict({k: v for k, v in plain(cfg.model).items() if k != "path"})
        except ValueError as e:
            raise ConfigError(str(e)) from e
    from batchgen.exec.models import ModelLoadError, UnsupportedModelError
    from batchgen.exec.models.loading import checkpoint_bytes, checkpoint_name, read_config

    try:
        config = read_config(path)
    except (ModelLoadError, UnsupportedModelError) as e:
        raise ConfigError(f"model.path: {e}") from e
    return config.to_spec(checkpoint_name(path), element_bytes or checkpoint_bytes(path))


def build_setup(cfg: DictConfig, *, policy_required: bool = True, command: str = "batchgen.experiment") -> Setup:
    """Raises ConfigError. `command`: how the user starts it, for the message when no policy was chosen."""
    if cfg.get("policy") is None and policy_required:
        raise ConfigError(f"no policy chosen: add +policy=<name> with one of {', '.join(policy_names())}, "
                          f"e.g. python -m {command} +policy=coroutine")
    try:
        policy = make_policy(plain(cfg.policy)) if cfg.get("policy") is not None else None
        cluster_cfg = plain(cfg.cluster)
        instances_planned = cluster_cfg.get("gpus_per_instance") == AUTO
        if instances_planned:  # checked as one instance; batchgen.instances picks the size
            cluster_cfg["gpus_per_instance"] = None
        cluster = cluster_from_config(cluster_cfg, hardware_dir=conf_dir() / "hardware")
        memory = MemorySettings(**plain(cfg.get("memory")))
        # null factors (the config lists every one, so that efficiency.compute=0.5 works without +): unset
        efficiency = load_efficiency({k: v for k, v in plain(cfg.get("efficiency")).items() if v is not None},
                                     cluster.gpu.name)
        latency = LatencySettings(**plain(cfg.get("latency")))
        if latency.calibration is not None and latency.name != "table":
            raise ConfigError(f"latency.calibration is read by latency=table only (this job uses "
                              f"latency={latency.name}): add latency=table, or drop latency.calibration")
        return Setup(policy, cluster, memory, efficiency, latency, page_tokens=typed(cfg, "page_tokens", int, 64),
                     routing_skew=typed(cfg, "routing_skew", float, 0.0),
                     check_invariants=typed(cfg, "check_invariants", bool, False),
                     instances_planned=instances_planned)
    except ConfigError:
        raise
    except TypeError as e:  # unknown keyword in memory / latency
        raise ConfigError(f"bad setting: {e}") from e
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def checked_calibration(setup: Setup, model: ModelSpec) -> None:
    try:
        check_calibration(setup.latency, model)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def typed(cfg: DictConfig, key: str, kind: type, default: Any) -> Any:
    value = cfg.get(key, default)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        what = {int: "a whole number", float: "a number", bool: "true or false"}[kind]
        raise ConfigError(f"{key} must be {what}, got {value!r}")
    return value
