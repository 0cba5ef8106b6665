"""From a Hydra config to a validated `Job`: every bad input is reported here, before any work starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchgen.confdir import conf_dir
from batchgen.job import Job
from batchgen.latency import LatencySettings, check_calibration, load_efficiency
from batchgen.memory import ConfigError, MemorySettings
from batchgen.overrides import check_known_keys
from batchgen.policy import make_policy, policy_names
from batchgen.specs import ClusterSpec, ModelSpec
from batchgen.workload import build_workload

BACKENDS = ("sim", "exec")


def _plain(node: Any) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})


def build_job(cfg: DictConfig, base_dir: Path | None = None, *, command: str | None = "batchgen.experiment") -> Job:
    """Validate the config and build the job; raises ConfigError with a message that says how to fix it.

    `command`: whose keys the config may hold (`check_known_keys`; conf/config.yaml's for batchgen.experiment),
    None to skip that check (a caller that checked its own config already)."""
    if command is not None:
        check_known_keys(cfg, command)
    if cfg.get("policy") is None:
        raise ConfigError(f"no policy chosen: add +policy=<name> with one of {', '.join(policy_names())}, "
                          "e.g. python -m batchgen.experiment +policy=coroutine")
    backend = cfg.get("backend", {}).get("name")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    try:
        policy = make_policy(_plain(cfg.policy))
        model = ModelSpec.from_dict(_plain(cfg.model))
        cluster = ClusterSpec.from_config(_plain(cfg.cluster), hardware_dir=conf_dir() / "hardware")
        memory = MemorySettings(**_plain(cfg.get("memory")))
        # null factors (conf/config.yaml lists every one, so that efficiency.compute=0.5 works without +): unset
        efficiency = load_efficiency({k: v for k, v in _plain(cfg.get("efficiency")).items() if v is not None},
                                     cluster.gpu.name)
        latency = LatencySettings(**_plain(cfg.get("latency")))
        if latency.calibration is not None and latency.name != "table":
            raise ConfigError(f"latency.calibration is read by latency=table only (this job uses "
                              f"latency={latency.name}): add latency=table, or drop latency.calibration")
        check_calibration(latency, model)
        workload = build_workload(cfg.workload, seed=_typed(cfg, "seed", int, 0), base_dir=base_dir,
                                  progress=progress_setting(cfg))
        return Job(model=model, cluster=cluster, workload=workload, policy=policy, memory=memory,
                   efficiency=efficiency, latency=latency, page_tokens=_typed(cfg, "page_tokens", int, 64),
                   routing_skew=_typed(cfg, "routing_skew", float, 0.0),
                   check_invariants=_typed(cfg, "check_invariants", bool, False))
    except ConfigError:
        raise
    except TypeError as e:  # unknown keyword in memory / latency
        raise ConfigError(f"bad setting: {e}") from e
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def progress_setting(cfg: DictConfig) -> Any:
    """output.progress (auto, true, false; see batchgen.progress), checked; auto when the config has none."""
    output = cfg.get("output")
    value = output.get("progress", "auto") if output is not None else "auto"
    if not (isinstance(value, bool) or value is None or value == "auto"):
        raise ConfigError(f"output.progress must be auto, true or false, got {value!r}")
    return value


def _typed(cfg: DictConfig, key: str, kind: type, default: Any) -> Any:
    value = cfg.get(key, default)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        what = {int: "a whole number", float: "a number", bool: "true or false"}[kind]
        raise ConfigError(f"{key} must be {what}, got {value!r}")
    return value
