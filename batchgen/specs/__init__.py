"""Specs as data: model architectures, GPUs, hosts and clusters, loaded from the YAML files under conf/."""

from batchgen.specs.catalog import (
    cluster_from_config,
    cluster_names,
    hardware_names,
    host_names,
    load_cluster,
    load_hardware,
    load_host,
    load_model,
    model_names,
)
from batchgen.specs.hardware import ClusterSpec, HardwareSpec
from batchgen.specs.host import DEFAULT_HOST, HostSpec
from batchgen.specs.model import ModelSpec

__all__ = [
    "ClusterSpec",
    "DEFAULT_HOST",
    "cluster_from_config",
    "HardwareSpec",
    "HostSpec",
    "ModelSpec",
    "cluster_names",
    "hardware_names",
    "host_names",
    "load_cluster",
    "load_hardware",
    "load_host",
    "load_model",
    "model_names",
]
