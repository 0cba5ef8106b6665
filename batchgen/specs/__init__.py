"""Specs as data: model architectures, GPUs and clusters, loaded from the YAML files under conf/."""

from batchgen.specs.catalog import (
    cluster_names,
    hardware_names,
    load_cluster,
    load_hardware,
    load_model,
    model_names,
)
from batchgen.specs.hardware import ClusterSpec, HardwareSpec
from batchgen.specs.model import ModelSpec

__all__ = [
    "ClusterSpec",
    "HardwareSpec",
    "ModelSpec",
    "cluster_names",
    "hardware_names",
    "load_cluster",
    "load_hardware",
    "load_model",
    "model_names",
]
