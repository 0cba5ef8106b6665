"""Every key of a composed config is one the command reads: `+page_token=16` or `+output.csv=false` would
otherwise be silently ignored. `check_known_keys(cfg)` runs after Hydra's composition and before any work; it
raises one-line ConfigErrors that name the bad key, the likely one (difflib) and the valid ones.

Valid keys come from where they are read: the primary config file of the command (conf/config.yaml for
`python -m batchgen.experiment`, conf/run.yaml for `python -m batchgen.run`), its defaults list (the config
groups), and the dataclasses that take each section (MemorySettings, LatencySettings, Efficiency, the
workload's keys, ExecSettings for `backend=exec`, ModelSpec, ClusterSpec). The policy's knobs depend on the
policy and are checked by `make_policy`, whose error lists them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import fields
from functools import lru_cache
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchgen.confdir import conf_dir
from batchgen.memory import ConfigError

# command (as typed after `python -m`) -> its primary config file in conf/
COMMANDS = {"batchgen.experiment": "config", "batchgen.run": "run"}
# config folders that hold data the cluster refers to, not config groups of a command: the key that picks them
DATA_DIRS = {"hardware": ("cluster.gpu", "the GPU"), "host": ("cluster.host", "the nodes' host CPUs and DRAM")}
IGNORED = ("hydra",)  # Hydra's own node, validated by Hydra
UNCHECKED = ("policy",)  # knobs depend on the policy: make_policy names the valid ones


def _dataclass_keys(cls) -> list[str]:
    return [f.name for f in fields(cls)]


SIM_KEYS = ["overlap_copies"]  # conf/backend/sim.yaml's settings, read by batchgen.experiment


def _section_keys(section: str, cfg: Mapping[str, Any]) -> list[str] | None:
    """The keys the code reads from one section (None: not a section known here)."""
    if section == "memory":
        from batchgen.memory import MemorySettings
        return _dataclass_keys(MemorySettings)
    if section == "latency":
        from batchgen.latency import LatencySettings
        return _dataclass_keys(LatencySettings)
    if section == "efficiency":
        from batchgen.latency import Efficiency
        return ["auto", "inherit", *_dataclass_keys(Efficiency)]
    if section == "workload":
        from batchgen.workload.spec import VALID_KEYS
        return list(VALID_KEYS)
    if section == "model":
        from batchgen.specs import ModelSpec
        return ["path", *_dataclass_keys(ModelSpec)]  # path: a model directory, read by the executor
    if section == "cluster":
        from batchgen.specs import ClusterSpec
        return _dataclass_keys(ClusterSpec)
    if section == "backend":
        name = _backend_name(cfg)
        return ["name", *(_exec_keys() if name == "exec" else _dist_keys() if name == "dist" else SIM_KEYS)]
    return None


def _exec_keys() -> list[str]:
    from batchgen.exec.run import ExecSettings  # imports torch: only for backend=exec, which needs it anyway
    return _dataclass_keys(ExecSettings)


def _dist_keys() -> list[str]:
    from batchgen.dist.run import DistSettings  # imports torch: only for backend=dist
    return _dataclass_keys(DistSettings)


def _backend_name(cfg: Mapping[str, Any]) -> Any:
    backend = cfg.get("backend")
    return backend.get("name") if isinstance(backend, Mapping) else None


@lru_cache(maxsize=None)
def _primary(config_name: str) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(top-level keys, config groups of the defaults list, keys of each mapping section) of a config file."""
    node = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{config_name}.yaml"), resolve=False)
    groups, global_keys = [], []
    for entry in node.pop("defaults", []) or []:
        if isinstance(entry, Mapping):
            for key, option in entry.items():
                group = str(key).split()[-1].lstrip("/").split("@")[0]
                if group.startswith("hydra"):  # Hydra's own groups (hydra/help): not keys of the command
                    continue
                groups.append(group)
                global_keys += _global_keys(conf_dir() / group / f"{option}.yaml")
    keys = tuple(dict.fromkeys(k for k in [*node, *global_keys] if k not in IGNORED))
    sections = {k: tuple(v) for k, v in node.items() if isinstance(v, Mapping) and k not in IGNORED}
    return keys, tuple(g for g in groups if g != "_self_"), sections


def _global_keys(path) -> list[str]:
    """The top-level keys a default group file writes when it is in the global package (backend=exec sets
    workload.*, cluster.* and page_tokens): a command's config holds them too."""
    if not path.is_file():
        return []
    text = path.read_text()
    if "@package _global_" not in "".join(line for line in text.splitlines() if line.startswith("#")):
        return []
    node = OmegaConf.to_container(OmegaConf.create(text), resolve=False) or {}
    return [k for k in node if k != "defaults"]


def valid_top_level_keys(command: str = "batchgen.experiment") -> list[str]:
    """The keys a command reads at the top level of its config: its file's, its groups, the policy."""
    keys, groups, _ = _primary(_config_name(command))
    return list(dict.fromkeys([*keys, *groups, "policy"]))


def _config_name(command: str) -> str:
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}: one of {', '.join(COMMANDS)}")
    return COMMANDS[command]


def _suggest(key: str, valid: Iterable[str], prefix: str = "") -> str:
    """' did you mean X?' for the closest valid key, or ''."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" did you mean {prefix}{close[0]}?" if close else ""


def check_known_keys(cfg: DictConfig | Mapping[str, Any], command: str = "batchgen.experiment") -> None:
    """Raise ConfigError naming every key of `cfg` that `command` does not read (and the valid keys).

    `command`: `batchgen.experiment` (conf/config.yaml) or `batchgen.run` (conf/run.yaml)."""
    plain = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    top = valid_top_level_keys(command)
    problems = []
    for key in plain:
        if key in IGNORED:
            continue
        if key not in top:
            problems.append(_top_level_problem(key, plain[key], plain, top, command))
            continue
        value = plain[key]
        if key in UNCHECKED or not isinstance(value, Mapping):
            continue
        valid = valid_section_keys(key, plain, command)
        if valid is None:
            continue
        for sub in value:
            if sub not in valid:
                problems.append(_section_problem(key, sub, valid, plain))
    if problems:
        raise ConfigError("; and ".join(problems))


def valid_section_keys(section: str, cfg: Mapping[str, Any], command: str = "batchgen.experiment") -> list[str] | None:
    """The keys `command` reads in one section of `cfg` (None: a section whose keys are not checked here)."""
    _, _, declared = _primary(_config_name(command))
    valid = _section_keys(section, cfg)
    if valid is None and section not in declared:
        return None
    return list(dict.fromkeys([*(valid or []), *declared.get(section, ())]))


def top_level_problem(key: str, value: Any, cfg: Mapping[str, Any], command: str = "batchgen.experiment") -> str:
    """The one-line message for a top-level key `command` does not read."""
    return _top_level_problem(key, value, cfg, valid_top_level_keys(command), command)


def section_problem(section: str, key: str, cfg: Mapping[str, Any], command: str = "batchgen.experiment") -> str:
    """The one-line message for `section.key` that `command` does not read."""
    return _section_problem(section, key, valid_section_keys(section, cfg, command) or [], cfg)


def _top_level_problem(key: str, value: Any, cfg: Mapping[str, Any], top: list[str], command: str) -> str:
    if key in DATA_DIRS:
        setting, what = DATA_DIRS[key]
        name = value.get("name") if isinstance(value, Mapping) else value
        folder = conf_dir() / key
        options = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        return (f"{key} is not a key of python -m {command}: choose {what} with {setting}={name or '<name>'} "
                f"(one of {options})")
    # a section's key typed at the top level (+num_gpus=8 for cluster.num_gpus=8)
    for section, sub in cfg.items():
        if isinstance(sub, Mapping) and section not in IGNORED and key in sub:
            return f"unknown key {key}; did you mean {section}.{key}? valid top-level keys: {', '.join(top)}"
    return f"unknown key {key};{_suggest(key, top)} valid top-level keys: {', '.join(top)}"


def _section_problem(section: str, key: str, valid: list[str], cfg: Mapping[str, Any]) -> str:
    if section == "backend" and _backend_name(cfg) not in ("exec", "dist") and key in _exec_keys():
        return (f"unknown key backend.{key}: backend.{key} is a setting of the executor (add backend=exec); the "
                f"simulator (backend={_backend_name(cfg)}) has: {', '.join(valid)}")
    return f"unknown key {section}.{key};{_suggest(key, valid, section + '.')} valid {section} keys: {', '.join(valid)}"
