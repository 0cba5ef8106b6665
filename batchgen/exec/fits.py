"""Refuse, before any allocation, a job this machine cannot hold.

Random weights are built in full before anything runs: `backend=exec` with the default Qwen3-30B spec (122 GB
in fp32) or DeepSeek-R1 grew to 23.8 GB of resident memory on a 24 GB machine until the kernel killed it, and
other jobs with it. So the weights (one copy per device that runs an instance) and the KV budget of the ranks
on each device are compared with what the device has free, and a job that cannot fit stops with one line.
Weights the memory plan streams (`batchgen.exec.weight_stream`) count as their host copy in host memory and
their staging slots on the device, as the executor allocates them.

Host memory also holds the host KV pools (`batchgen.exec.host_pool`: every node's host copies, in one process;
backend=dist, one pool per process): `host_kv_room` is what the machine leaves for them once everything above
is counted (their budget when `backend.host_kv_gb` is not given), and an explicit budget is counted with the rest.
"""
from __future__ import annotations

from pathlib import Path

import torch

from batchgen.memory import ConfigError

# A checkpoint's tensors are usually stored in bf16 / fp16: its file size / 2 estimates its parameter count.
CHECKPOINT_BYTES_PER_PARAM = 2
SAFETY = 0.9  # leave a tenth of the free memory for activations, the allocator and everything else


def free_bytes(device: torch.device) -> int | None:
    """Memory `device` has free now: CUDA's own count, or the kernel's MemAvailable for the CPU (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def parameter_count(job, model_path: str | None) -> tuple[int, str] | None:
    """(parameters, where the count comes from): the spec's, or a checkpoint's size on disk; None for a model
    directory without safetensors (the loader then says what is wrong with it)."""
    if model_path:
        files = list(Path(model_path).glob("*.safetensors"))
        if not files:
            return None
        return sum(f.stat().st_size for f in files) // CHECKPOINT_BYTES_PER_PARAM, f"the checkpoint in {model_path}"
    return int(job.model.total_params), f"model={job.model.name}"


def _needs(job, model_path, kv_budget_mb, devices, dtype, ranks_per_instance, streamed, weight_copies, extra=0.0):
    """(bytes each device needs, and what the error message says about them), or None for a model directory
    whose size is unknown. `extra`: bytes each weight copy's holder keeps beyond the model (check_fits)."""
    counted = parameter_count(job, model_path)
    if counted is None:
        return None
    params, source = counted
    weights = params * torch.tensor([], dtype=dtype).element_size()
    host_copy = staging = off_device = 0
    if streamed is not None and streamed.layers:
        host_copy, staging = streamed.host_bytes, streamed.staging_bytes
        off_device = min(streamed.streamed_bytes, weights)
    on_device = weights - off_device + staging
    host = torch.device("cpu")
    need: dict[torch.device, float] = {}
    for device in dict.fromkeys(devices):  # weights (and the host copies of streamed ones) once per device
        need[device] = need.get(device, 0.0) + (on_device + extra) * weight_copies
        need[host] = need.get(host, 0.0) + host_copy * weight_copies
    for device in devices:  # each instance's ranks keep their KV on its device
        need[device] += ranks_per_instance * kv_budget_mb * 2**20
    return need, params, source, weights, host_copy, staging, off_device, extra


def host_kv_room(job, model_path: str | None, kv_budget_mb: float, devices: list[torch.device],
                 dtype: torch.dtype, ranks_per_instance: int, free=free_bytes, streamed=None,
                 weight_copies: int = 1) -> float | None:
    """Bytes of host memory left for host KV pools once the weights, device KV budgets and streamed weights'
    host copies that live there are counted (with the same safety margin as `check_fits`); None when the
    machine's free memory is unknown."""
    have = free(torch.device("cpu"))
    if have is None:
        return None
    needs = _needs(job, model_path, kv_budget_mb, devices, dtype, ranks_per_instance, streamed, weight_copies)
    used = needs[0].get(torch.device("cpu"), 0.0) if needs is not None else 0.0
    return max(SAFETY * have - used, 0.0)


def check_fits(job, model_path: str | None, kv_budget_mb: float, devices: list[torch.device], dtype: torch.dtype,
               ranks_per_instance: int, free=free_bytes, streamed=None, weight_copies: int = 1,
               host_kv_bytes: float = 0.0, host_kv: str = "", extra_per_copy: float = 0.0) -> None:
    """Raise ConfigError when some device cannot hold its weights and KV budget.

    `weight_copies`: whole copies of the weights each device holds at once (backend=dist: every process on the
    machine builds the whole model before keeping its expert shard).

    `streamed` (a `weight_stream.Footprint`, from the memory plan): weights that live on the host and pass
    through staging slots on the device. Each device then holds the resident weights and the slots, and the
    host holds the streamed weights' packed copy, once per device (pinned for a CUDA device). A CPU device is
    the host: both count there.

    `host_kv_bytes`: host KV pools of an explicit budget, all of them, counted in host memory; `host_kv` says
    what they are (the setting and how many pools), for the error.

    `extra_per_copy`: bytes each holder of a weight copy keeps beyond the whole model (backend=dist's
    data-parallel prefill: its expert shard and two ring slots, beside the host copy of every expert)."""
    needs = _needs(job, model_path, kv_budget_mb, devices, dtype, ranks_per_instance, streamed, weight_copies,
                   extra_per_copy)
    if needs is not None:
        _check_devices(free, dtype, weight_copies, *needs)
    host = torch.device("cpu")
    if host_kv_bytes:
        have = free(host)
        used = needs[0].get(host, 0.0) if needs is not None else 0.0
        if have is not None and used + host_kv_bytes > SAFETY * have:
            raise ConfigError(f"{host_kv} take {host_kv_bytes / 1e9:.2f} GB of host memory, which with "
                              f"{used / 1e9:.2f} GB of weights and KV budgets there needs "
                              f"{(used + host_kv_bytes) / 1e9:.2f} GB, but the machine has {have / 1e9:.1f} GB free: "
                              "lower backend.host_kv_gb (or leave it unset: the free memory then sets it)")


def _check_devices(free, dtype, weight_copies, need, params, source, weights, host_copy, staging,
                   off_device, extra) -> None:
    dtype_name = str(dtype).removeprefix("torch.")
    for device, bytes_ in need.items():
        have = free(device)
        if not bytes_ or have is None or bytes_ <= SAFETY * have:
            continue
        if host_copy:
            raise ConfigError(
                f"{source} has {params / 1e9:.1f}B parameters in {dtype_name}; the memory plan streams "
                f"{off_device / 1e9:.2f} GB of them from host copies ({host_copy / 1e9:.2f} GB per device in host "
                f"memory) through {staging / 1e9:.2f} GB of staging buffers, so {device} needs "
                f"{bytes_ / 1e9:.2f} GB (resident weights, staging, KV budget and host copies where they live "
                f"there) but has {have / 1e9:.1f} GB free: choose a smaller model (model=tiny_moe or "
                "model=small_moe), a smaller backend.kv_budget_mb, backend.dtype=bfloat16, or a machine with more "
                "memory")
        copies = f" in each of {weight_copies} processes" if weight_copies > 1 else ""
        fewer = ", fewer processes (backend.procs)" if weight_copies > 1 else ""
        raise ConfigError(
            f"{source} has {params / 1e9:.1f}B parameters: {weights / 1e9:.1f} GB of {dtype_name} weights{copies} "
            f"plus {(bytes_ - weights * weight_copies) / 1e9:.1f} GB of KV budget"
            + (f" and of data-parallel prefill's expert shards and ring ({extra / 1e9:.1f} GB a process: "
               "policy.prefill_parallel=ep frees them)" if extra else "") + f" on {device}, which has "
            f"{have / 1e9:.1f} GB free: choose a smaller model (model=tiny_moe or model=small_moe), a smaller "
            f"backend.kv_budget_mb, backend.dtype=bfloat16{fewer}, or a device with more memory")
