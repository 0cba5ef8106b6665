"""The batch caps that vLLM and SGLang choose for themselves from the GPU they run on: what `continuous` and
`sglang_opt` take for their knobs set to "auto", so that a baseline runs at its engine's own defaults rather
than at a number picked for it.

Both engines read the device once at start-up and pick the caps from its memory (and, for vLLM, its name):

- vLLM 0.11 (`EngineArgs.get_batch_defaults`, vllm/engine/arg_utils.py), for the offline `LLM` class that a
  batch job uses: on a GPU with at least 70 GiB that is not an A100 (H100, H20, H200, MI300X),
  max_num_seqs 1024 and max_num_batched_tokens 16384; on every other GPU (A100s included, a larger budget
  lowered their throughput there: vLLM PR #17885) 256 and 8192.
- SGLang 0.5 (`ServerArgs`' GPU memory settings, python/sglang/srt/server_args.py): chunked_prefill_size 2048
  below 35 GiB of device memory, 4096 below 60 GiB, 8192 below 160 GiB (H100, A100 80 GB, H20, H200), 16384
  above (B200, MI300X). Its running-request cap is derived from the KV pool (`sglang_opt`'s max_running 0).

Device memory is the spec's `hbm_bytes` (the total the driver reports where the hardware file records it), and
the name test reads the hardware file's name, as vLLM reads the device's.
"""

from __future__ import annotations

_GiB = 2**30
_MiB = 2**20


def vllm_offline_caps(gpu) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of vLLM's offline engine on `gpu` (a HardwareSpec)."""
    if gpu.hbm_bytes >= 70 * _GiB and "a100" not in gpu.name.lower():
        return 1024, 16384
    return 256, 8192


def kv_pool_running_cap(pages_capacity, running_cap: int) -> int:
    """SGLang's running-request cap when none is set: what the rank's KV pool holds (one page per sequence at
    least, so memory, through the admission's reserve, binds before the cap), at most `running_cap` (its
    largest request pool)."""
    return max(1, min(int(running_cap), int(pages_capacity.min())))


def sglang_chunked_prefill_size(gpu) -> int:
    """SGLang's chunked_prefill_size on `gpu` (a HardwareSpec)."""
    mib = gpu.hbm_bytes / _MiB
    for below, size in ((35 * 1024, 2048), (60 * 1024, 4096), (160 * 1024, 8192)):
        if mib < below:
            return size
    return 16384
