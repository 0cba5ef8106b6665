"""Look up the specs shipped as YAML under conf/ by name.

The simulator and the planner need hardware specs by name outside Hydra (a cluster names its GPU; scripts
compare GPUs), so these loaders read the same files Hydra composes, from the same conf directory.
"""

from pathlib import Path
from typing import Any, Mapping

from omegaconf import OmegaConf

from batchgen.specs.hardware import ClusterSpec, HardwareSpec
from batchgen.specs.host import DEFAULT_HOST, HostSpec
from batchgen.specs.model import ModelSpec, check_keys, plain_dict


def _fallback_conf_dir() -> Path:
    """The checkout's top-level conf/ when running from a clone, else batchgen/conf inside an installed wheel."""
    here = Path(__file__).resolve()
    checkout = here.parents[2] / "conf"
    return checkout if checkout.is_dir() else here.parents[1] / "conf"


def _conf_dir(conf_dir: str | Path | None) -> Path:
    if conf_dir is not None:
        return Path(conf_dir)
    try:  # batchgen.confdir is the single place that decides where conf/ lives
        from batchgen.confdir import conf_dir as shared_conf_dir
    except ImportError:
        return _fallback_conf_dir()
    return Path(shared_conf_dir())


def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _load_yaml(folder: Path, name: str, what: str) -> dict:
    names = _names(folder)
    if name not in names:
        valid = ", ".join(names) or "(none)"
        raise ValueError(f"unknown {what} {name!r}: choose one of {valid} (files in {folder})")
    path = folder / f"{name}.yaml"
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of field names to values")
    return data


def hardware_names(conf_dir: str | Path | None = None) -> list[str]:
    return _names(_conf_dir(conf_dir) / "hardware")


def model_names(conf_dir: str | Path | None = None) -> list[str]:
    return _names(_conf_dir(conf_dir) / "model")


def cluster_names(conf_dir: str | Path | None = None) -> list[str]:
    return _names(_conf_dir(conf_dir) / "cluster")


def load_hardware_file(name: str, hardware_dir: str | Path | None = None) -> HardwareSpec:
    """Load `<hardware_dir>/<name>.yaml` (default: conf/hardware)."""
    folder = Path(hardware_dir) if hardware_dir is not None else _conf_dir(None) / "hardware"
    return HardwareSpec.from_dict(_load_yaml(folder, name, "GPU"))


def host_names(conf_dir: str | Path | None = None) -> list[str]:
    return _names(_conf_dir(conf_dir) / "host")


def load_host_file(name: str, host_dir: str | Path | None = None) -> HostSpec:
    """Load `<host_dir>/<name>.yaml` (default: conf/host)."""
    folder = Path(host_dir) if host_dir is not None else _conf_dir(None) / "host"
    return HostSpec.from_dict(_load_yaml(folder, name, "host"))


def load_host(name: str, conf_dir: str | Path | None = None) -> HostSpec:
    return load_host_file(name, _conf_dir(conf_dir) / "host")


def load_hardware(name: str, conf_dir: str | Path | None = None) -> HardwareSpec:
    return load_hardware_file(name, _conf_dir(conf_dir) / "hardware")


def load_model(name: str, conf_dir: str | Path | None = None) -> ModelSpec:
    return ModelSpec.from_dict(_load_yaml(_conf_dir(conf_dir) / "model", name, "model"))


def load_cluster(name: str, conf_dir: str | Path | None = None) -> ClusterSpec:
    root = _conf_dir(conf_dir)
    return cluster_from_config(_load_yaml(root / "cluster", name, "cluster"), root / "hardware")


def cluster_from_config(d: Mapping[str, Any], hardware_dir: str | Path | None = None) -> ClusterSpec:
    """A cluster from its YAML, whose `gpu` is a hardware name (a file in `hardware_dir`, default conf/hardware)
    and `host` a host name (a file in the `host` folder beside it; DEFAULT_HOST if absent); mappings of fields or
    spec objects are accepted too, for tests and sweeps."""
    d = plain_dict(d, "cluster")
    check_keys(d, ClusterSpec, "cluster")
    gpu, host = d["gpu"], d.get("host", DEFAULT_HOST)
    if isinstance(gpu, str):
        gpu = load_hardware_file(gpu, hardware_dir)
    elif isinstance(gpu, Mapping):
        gpu = HardwareSpec.from_dict(gpu)
    if isinstance(host, str):
        host = load_host_file(host, None if hardware_dir is None else Path(hardware_dir).parent / "host")
    elif isinstance(host, Mapping):
        host = HostSpec.from_dict(host)
    return ClusterSpec(**{**d, "gpu": gpu, "host": host})


def efficiency_names(conf_dir: str | Path | None = None) -> list[str]:
    """Shipped efficiency files (conf/efficiency), minus the two that only select: auto and datasheet."""
    return [n for n in _names(_conf_dir(conf_dir) / "efficiency") if n not in ("auto", "datasheet")]


def load_efficiency_dict(name: str, conf_dir: str | Path | None = None) -> dict:
    """The factors of conf/efficiency/<name>.yaml, with `inherit: <other file>` resolved (the file's own keys
    win over the inherited ones; `modules` merge per module)."""
    folder = _conf_dir(conf_dir) / "efficiency"
    seen: list[str] = []
    layers = []
    while name is not None:
        if name in seen:
            raise ValueError(f"efficiency files inherit in a cycle: {' -> '.join(seen + [name])}")
        seen.append(name)
        data = _load_yaml(folder, name, "efficiency file")
        layers.append(data)
        name = data.pop("inherit", None)
    merged: dict = {}
    for data in reversed(layers):
        merged = merge_factors(merged, data)
    return merged


def merge_factors(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict:
    """Efficiency factors `over` laid on `base`: top-level keys replace, `modules` merge module by module."""
    modules = {m: dict(f) for m, f in (base.get("modules") or {}).items()}
    for module, factors in (over.get("modules") or {}).items():
        modules[module] = {**modules.get(module, {}), **factors}
    merged = {**base, **over}
    if modules:
        merged["modules"] = modules
    return merged
