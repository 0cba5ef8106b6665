"""Run a job on real tensors: build the model, one host KV pool per node and one paged KV cache per rank (drawing
on its node's pool), then drive every instance's engine loop round-robin (one process; each instance runs on one
device).

Before any weight is built, a job is refused with one line when this backend cannot run it: a policy that asks
for what the executor does not perform (`exec_capabilities`: two-batch overlap), a machine that cannot hold the
weights, the KV budgets or the host KV pools (batchgen.exec.fits), a sequence longer than the device KV pool
or the host KV a node's pool holds. The host pools' budget is `backend.host_kv_gb` per node, or what the
machine's free memory leaves for them; the state's host accounting is given what a pool surely holds
(`HostPools`), so a policy plans within what the executor can hold."""

from __future__ import annotations

import copy
import time
from pathlib import Path
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from batchgen.core.sequences import InvariantError
from batchgen.engine import Engine, RunOutput, check_supported, finished_ids
from batchgen.exec.account import KVAccount
from batchgen.exec.backend import ExecBackend, exec_capabilities
from batchgen.exec.clock import check_clock, using
from batchgen.exec.fits import check_fits, free_bytes, host_kv_room
from batchgen.exec.host_pool import HostPool, tokens_within
from batchgen.exec.kv_cache import PagedKVCache
from batchgen.exec.models import (ExecModelConfig, ModelLoadError, MoEDecoder, UnsupportedModelError,
                                  init_random, load_model, load_tokenizer)
from batchgen.exec.models import invariant
from batchgen.exec.models.loading import read_config
from batchgen.exec.repeats import representative_run
from batchgen.exec.runner import InstanceRunner
from batchgen.exec.staging import BUFFERS, staging_pages
from batchgen.exec.sampling import SamplingParams
from batchgen.exec.sequences import SequenceTokens, random_prompts
from batchgen.exec.threads import pinned_threads, resolve_threads
from batchgen.exec.weight_stream import footprint, meta_model, stream_onto, stream_spec_of
from batchgen.job import Job, effective_cluster, prefill_as_performed, prepare
from batchgen.memory import ConfigError, batch_shape_of
from batchgen.policy.base import Capabilities
from batchgen.exec.load import LoadMeter

FinishObserver = Callable[[np.ndarray, SequenceTokens], None]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExecSettings:
    device: str | list[str] = "auto"   # cpu, cuda, cuda:N, auto (cuda when available), or one per instance
    dtype: str = "auto"                # float32, bfloat16, or auto (bf16 when every device is a GPU, else fp32)
    model_path: str | None = None      # a Hugging Face directory; None = random weights from the model spec
    kv_budget_mb: float = 256.0        # device memory per rank for KV: the paged pool, and (when the policy may run
                                       # sequences host-resident) the two staging buffers, carved out of it
    host_kv_gb: float | None = None    # host memory per node for its sequences' host KV copies (the node's host
                                       # pool; backend=dist: each process's); None: what the machine's free memory
                                       # leaves once weights and KV budgets are counted, shared by the pools
    staging_mb: float | None = None    # of kv_budget_mb, for the staging buffers (None: B_attn longest sequences)
    weights_seed: int = 0
    temperature: float = 0.0           # sampling for every request (0 = greedy)
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = True            # run every request to its workload output length (comparable work)
    stop: tuple[str, ...] = ()         # stop strings for every request (needs the model directory's tokenizer)
    threads: int | str | None = None   # intra-op CPU threads: N, auto (the physical cores this process may use),
                                       # None (as the process has them; the CLI's default is auto)
    repeats: int = 1                   # run the job this many times; the run of median BCT is reported (with
                                       # clock=cpu, the fastest: a neighbour only ever adds to a CPU time)
    batch_invariant: bool = False      # each token's result bitwise independent of its batch and of prefill vs
                                       # decode (models/invariant.py): a recomputed sequence continues exactly
    clock: str = "wall"                # wall, or cpu: the working thread's CPU time (batchgen.exec.clock)

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop or ()))

    def instance_devices(self, num_instances: int) -> list[torch.device]:
        names = list(self.device) if isinstance(self.device, (list, tuple)) else [self.device] * num_instances
        if len(names) != num_instances:
            raise ConfigError(f"backend.device lists {len(names)} devices but the job has {num_instances} "
                              "instances: give one device per instance, or a single device for all")
        return [self._device(n) for n in names]

    @staticmethod
    def _device(name: str) -> torch.device:
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(name)
        except RuntimeError as e:
            raise ConfigError(f"backend.device={name!r} is not a device: use cpu, cuda, cuda:N or auto") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"backend.device={name} but this machine has no CUDA device: use cpu or auto")
        return dev

    def resolved_dtype(self) -> torch.dtype:
        """The dtype a job will run in, from the settings alone (before its instances are laid out)."""
        names = list(self.device) if isinstance(self.device, (list, tuple)) else [self.device]
        return self.torch_dtype([self._device(n) for n in names])

    def torch_dtype(self, devices: list[torch.device]) -> torch.dtype:
        """One dtype everywhere: a sequence migrating between devices keeps exactly its KV."""
        if self.dtype == "auto":
            return torch.bfloat16 if all(d.type == "cuda" for d in devices) else torch.float32
        if self.dtype not in DTYPES:
            raise ConfigError(f"backend.dtype={self.dtype!r}: choose one of auto, {', '.join(DTYPES)}")
        return DTYPES[self.dtype]


@dataclass
class ExecOutput(RunOutput):
    tokens: SequenceTokens | None = None
    kv_moves: dict | None = None  # KV operations the executor carried out (yield, restore, migrate, evict, offload)
    kv_account: KVAccount | None = None  # the KV bytes they (and the runs) copied, per kind, tier and GPU
    host_pools: list | None = None  # per host pool: its budget, capacity and peak use in pages, and a page's bytes
    kv_traffic: dict | None = None  # host-resident decode: bytes restored and appended, sequence-steps
    capabilities: Capabilities | None = None  # what the backend declared to the policy (the simulator can match it)
    # what the measurement ran on, resolved (never "auto"), and every repeat's BCT (this run's is their median)
    device: str = ""
    dtype: str = ""
    threads: int = 0
    interop_threads: int = 0
    repeat_bcts: list[float] = field(default_factory=list)
    # CPU seconds of the process / (wall seconds x threads): near 1 on an idle machine with threads <= cores; well
    # under 1 when other processes took the cores (the wall-clock BCT then holds time spent waiting for them)
    cpu_share: float = 0.0
    repeat_cpu_shares: list[float] = field(default_factory=list)
    repeats_same_decisions: bool = True
    clock: str = "wall"           # what the BCT and module seconds were timed with (batchgen.exec.clock)
    wall_bct_s: float = 0.0       # the engine run's wall seconds (beside a CPU-clock BCT)
    repeat_wall_bcts: list[float] = field(default_factory=list)
    load: dict | None = None      # the machine during the run (batchgen.exec.load.Load.to_dict)


def model_config(job: Job, settings: ExecSettings) -> ExecModelConfig:
    """The model's architecture, from config.json or the spec: known before any weight is built."""
    config = _model_config(job, settings)
    if settings.batch_invariant:
        try:
            invariant.check_supported(config.architecture)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return config


def cascades_as_performed(job: Job, settings: ExecSettings) -> Job:
    """The job with no cascade attention where the executor cannot perform it, so that its plans carry none:
    batch-invariant mode attends each query over its own context alone, and a sliding window sees only part of a
    prefix (batchgen.core.cascade)."""
    if getattr(job.policy, "cascade_attention", "off") == "off":
        return job
    if not settings.batch_invariant and model_config(job, settings).sliding_window is None:
        return job
    return dataclasses.replace(job, policy=dataclasses.replace(job.policy, cascade_attention="off"))


def _model_config(job: Job, settings: ExecSettings) -> ExecModelConfig:
    if settings.model_path:
        try:
            return read_config(settings.model_path)
        except (ModelLoadError, UnsupportedModelError) as e:  # bad input: say so before any work starts
            raise ConfigError(f"backend.model_path: {e}") from e
    try:
        return ExecModelConfig.from_spec(job.model)
    except ValueError as e:
        raise ConfigError(f"model {job.model.name} cannot run on the executor: {e}") from e


def build_model(job: Job, settings: ExecSettings, device: torch.device, dtype: torch.dtype) -> MoEDecoder:
    if settings.model_path:
        try:
            return load_model(settings.model_path, dtype=dtype, device=device)
        except (ModelLoadError, UnsupportedModelError) as e:
            raise ConfigError(f"backend.model_path: {e}") from e
    return init_random(model_config(job, settings), seed=settings.weights_seed, dtype=dtype, device=device)


@dataclass(frozen=True)
class HostPools:
    """The host KV pools of a run: each holds at most `budget_pages` pages of `page_bytes`, and the state is given
    `tokens` of host KV per node (what a pool that size surely holds, however the copies fill their last pages,
    within what the cluster spec plans)."""

    count: int                 # pools of this process (backend=exec: one per node; dist: its own)
    budget_pages: int
    page_bytes: int
    tokens: int
    setting: str               # where the budget comes from, for the errors that name it
    per_pool_bytes: float | None = None  # the machine's memory for each pool (None: unknown, the spec's plan)
    explicit: bool = False     # per_pool_bytes is backend.host_kv_gb's

    @property
    def explicit_bytes(self) -> float:
        """An explicit budget's bytes per pool, 0 when it is derived (check_fits counts it with the rest)."""
        return self.per_pool_bytes if self.explicit else 0.0

    def fix(self) -> str:
        return (f"raise backend.host_kv_gb ({self.setting}; a page of KV takes {self.page_bytes:,} bytes), or "
                "shorten the longest requests")


def host_pools(job: Job, settings: ExecSettings, config: ExecModelConfig, dtype: torch.dtype,
               devices: list[torch.device], count: int, per_machine: int, ranks_per_instance: int,
               streamed=None, weight_copies: int = 1) -> HostPools:
    """`count` pools here, `per_machine` of them sharing this machine's memory (more under backend=dist: one per
    process). A pool's budget: backend.host_kv_gb, or the memory the machine leaves for host KV
    (`fits.host_kv_room`) split among the pools; unknown free memory: what the cluster spec plans."""
    w, page = job.workload, job.page_tokens
    page_bytes = PagedKVCache.page_bytes(**config.kv_cache_geometry()._asdict(), page_size=page, dtype=dtype)
    planned = prepare(job, host_prefixes=True).budget.host_kv_tokens_per_node
    smallest, copies = (max(int(w.input_lens.min()), 1), len(w)) if len(w) else (1, 0)

    def pages_for(tokens: int) -> int:  # the pages `tokens` in at most `copies` copies can take
        return -(-tokens // page) + min(copies, -(-tokens // smallest))

    gb = settings.host_kv_gb
    if gb is not None:
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0:
            raise ConfigError(f"backend.host_kv_gb={gb!r}: give a positive number of GB per node (or null: from the "
                              "machine's free memory)")
        per_pool, setting = gb * 1e9, f"now {gb:g} GB per node"
    else:
        room = host_kv_room(job, settings.model_path, settings.kv_budget_mb, devices, dtype, ranks_per_instance,
                            free=free_bytes, streamed=streamed, weight_copies=weight_copies)
        per_pool = None if room is None else room / per_machine
        setting = ("unset: the cluster spec's" if room is None else
                   f"unset: {per_pool / 1e9:.2f} GB per pool, the machine's free memory over {per_machine} pools")
    if per_pool is None:
        tokens, pages = planned, pages_for(planned)
    else:
        fit = int(per_pool // page_bytes)
        tokens = min(planned, tokens_within(fit, page, smallest, copies))
        pages = min(fit, pages_for(tokens))
    return HostPools(count, max(pages, 1), page_bytes, tokens, setting, per_pool, gb is not None)


@dataclass(frozen=True)
class KVPools:
    """Each rank's KV memory as the executor allocates it: the paged pool and the staging buffers."""

    geometry: dict
    pool_bytes: int
    staging_pages: int | None
    num_pages: int
    max_context: int
    budget: object = None  # the memory plan against this pool (`MemoryBudget`: which weights stream)


def kv_pools(job: Job, settings: ExecSettings, config: ExecModelConfig, dtype: torch.dtype,
             host: HostPools | None = None) -> KVPools:
    """Sized from the config alone, so that a job whose requests cannot fit is refused before any weight is
    built; `prepare` with the resulting pool (and the host pools' tokens) checks every sequence against it."""
    w = job.workload
    geometry = config.kv_cache_geometry()._asdict()  # GQA: K and V heads; MLA: one latent "head", no V pool
    max_context = int((w.input_lens + w.output_lens).max()) if w.input_lens.size else 1
    # the policy as it will run ("auto" knobs planned), for its staging buffers
    policy = prepare(job, host_prefixes=True).policy
    pool_bytes, pages_each = _split_budget(settings, job, policy, geometry, dtype, max_context, config.is_mla)
    per_page = PagedKVCache.page_bytes(**geometry, page_size=job.page_tokens, dtype=dtype)
    num_pages = pool_bytes // per_page
    per_token = per_page // job.page_tokens
    need_mb = -(-(max_context + job.page_tokens) * per_token // 2**20) + settings.kv_budget_mb - pool_bytes / 2**20
    fix = (f"raise backend.kv_budget_mb (now {settings.kv_budget_mb:g}; a token's KV takes {per_token:,} bytes in "
           f"{str(dtype).removeprefix('torch.')}, so the longest request, {max_context:,} tokens, needs about "
           f"{max(need_mb, 1):,.0f} MB) or shorten the longest requests")
    if num_pages < 1:
        raise ConfigError(f"backend.kv_budget_mb={settings.kv_budget_mb:g} holds no KV page of {per_page:,} bytes: "
                          f"{fix}")
    budget = prepare(job, kv_pages_per_gpu=num_pages, pool_fix=fix, host_prefixes=True, **host_kw(host)).budget
    return KVPools(geometry, pool_bytes, pages_each, num_pages, max_context, budget)


def host_kw(host: HostPools | None) -> dict:
    """`prepare`'s host KV arguments for the host pools (none without them)."""
    return {} if host is None else {"host_kv_tokens": host.tokens, "host_fix": host.fix()}


def _split_budget(settings: ExecSettings, job: Job, policy, geometry: dict, dtype: torch.dtype,
                  max_context: int, is_mla: bool) -> tuple[int, int | None]:
    """(bytes for the paged KV pool, pages per staging buffer or None): a policy that may run sequences
    host-resident gets two staging buffers (one layer of B_attn longest sequences each, or `staging_mb`)
    out of kv_budget_mb, so that it uses no more device memory for KV than a policy that cannot. With CPU
    attention (GQA/MHA; MLA falls back to staging) nothing is staged."""
    budget = int(settings.kv_budget_mb * 2**20)
    shape = batch_shape_of(policy, max_context)
    if shape is None or not shape.staging_seqs or (getattr(policy, "attention", None) == "cpu" and not is_mla):
        return budget, None
    page = job.page_tokens
    per_page = PagedKVCache.page_bytes(**geometry, page_size=page, dtype=dtype) // geometry["num_layers"]
    if settings.staging_mb is None:
        pages_each = staging_pages(shape.staging_seqs, max_context, page)
    else:
        pages_each = int(settings.staging_mb * 2**20) // (BUFFERS * per_page)
    longest = -(-max_context // page)
    if pages_each < longest:
        raise ConfigError(f"backend.staging_mb: a staging buffer of {pages_each} pages cannot hold the longest "
                          f"sequence ({max_context:,} tokens = {longest} pages of one layer, {per_page:,} bytes "
                          "each): give it more")
    kv_bytes = budget - BUFFERS * pages_each * per_page
    if kv_bytes < per_page * geometry["num_layers"]:
        raise ConfigError(f"backend.kv_budget_mb={settings.kv_budget_mb}: the staging buffers of host-resident "
                          f"decode take {BUFFERS * pages_each * per_page / 2**20:.1f} MB of it (2 x {pages_each} "
                          f"pages of one layer, for B_attn={shape.staging_seqs} sequences of {max_context:,} "
                          "tokens), leaving no KV page: raise the budget, lower policy.b_attn or set "
                          "backend.staging_mb")
    return kv_bytes, pages_each


def execute(job: Job, settings: ExecSettings, *, prompts: list[np.ndarray] | None = None,
            params: list[SamplingParams] | None = None, on_finish: FinishObserver | None = None,
            resumed: list[list[int]] | None = None, after_run: Callable[[SequenceTokens], None] | None = None
            ) -> ExecOutput:
    """`prompts`: real prompt token ids, one per workload sequence, of the workload's input lengths; None:
    synthetic prompts of those lengths (seeded by `settings.weights_seed`). `params`: each sequence's own
    sampling and stopping (its max_tokens the workload's output length); None: the settings' for every one.
    `on_finish(ids, tokens)`: called after every run in which sequences ended, with their ids and the run's
    tokens (a batch job writes each result the moment it is known), in every repeat. `resumed`: tokens each
    sequence generated in an earlier, interrupted run (see `SequenceTokens`); the workload's input lengths then
    count them (prompt + resumed) and its output lengths what is left. `after_run(tokens)`: called after every
    run (a batch job checkpoints the unfinished sequences' tokens from it).

    With `settings.repeats` = N the job runs N times on the same weights and prompts; the run returned is the
    one of median BCT (the lower median for even N, so that every number reported comes from one real run),
    carrying every run's BCT (`repeat_bcts`)."""
    start = time.perf_counter()
    job = prefill_as_performed(job, dp_prefill=False)  # no expert weights are streamed in
    if isinstance(settings.repeats, bool) or not isinstance(settings.repeats, int) or settings.repeats < 1:
        raise ConfigError(f"backend.repeats={settings.repeats!r}: give a whole number >= 1")
    with pinned_threads(resolve_threads(settings.threads)) as threads, invariant.mode(settings.batch_invariant):
        cluster = effective_cluster(job)
        devices = settings.instance_devices(cluster.num_instances)
        check_clock(settings.clock, {d.type for d in devices}, threads)
        dtype = settings.torch_dtype(devices)
        config = model_config(job, settings)
        job = cascades_as_performed(job, settings)
        _check_lengths(job, config)
        check_runs_here(prepare(job, host_prefixes=True).policy, exec_capabilities(config))
        pools = kv_pools(job, settings, config, dtype)
        stream = stream_spec_of(pools.budget, job.model)  # the weights the memory plan keeps on the host
        streamed = footprint(meta_model(config, dtype), stream)
        host = host_pools(job, settings, config, dtype, devices, cluster.num_nodes, cluster.num_nodes,
                          cluster.instance_size, streamed=streamed)
        check_fits(job, settings.model_path, settings.kv_budget_mb, devices, dtype, cluster.instance_size,
                   free=free_bytes, streamed=streamed, host_kv_bytes=host.explicit_bytes * host.count,
                   host_kv=f"backend.host_kv_gb={settings.host_kv_gb:g} GB per node x {host.count} node"
                           f"{'s' if host.count > 1 else ''} of host KV pools" if host.explicit_bytes else "")
        pools = kv_pools(job, settings, config, dtype, host)  # every sequence against the host KV too
        done_before = [len(r) for r in resumed] if resumed is not None else [0] * len(job.workload)
        params = _checked_params(job, settings, params, done_before)
        # streamed weights are built on the CPU and never occupy the device (`weight_stream.stream_onto`)
        model = build_model(job, settings, torch.device("cpu") if stream else devices[0], dtype).eval()
        models = {dev: model if i == 0 else copy.deepcopy(model)  # one copy of the weights per device
                  for i, dev in enumerate(dict.fromkeys(devices))}
        streamers = {dev: stream_onto(m, stream, dev) for dev, m in models.items()}
        prompts = _checked_prompts(job, settings, model.config, prompts, done_before)
        with using(settings.clock):
            runs = [_run_once(job, settings, models, devices, dtype, pools, host, prompts, params, on_finish,
                              resumed, after_run, streamers)
                    for _ in range(settings.repeats)]
    names = sorted({str(d) for d in devices})
    for r in runs:
        r.device = names[0] if len(names) == 1 else ",".join(names)
        r.dtype = str(dtype).removeprefix("torch.")
        r.threads, r.interop_threads = threads, torch.get_num_interop_threads()
    out = representative_run(runs)
    out.wall_s = time.perf_counter() - start
    return out


def _check_lengths(job: Job, c: ExecModelConfig) -> None:
    w = job.workload
    too_long = np.flatnonzero(w.input_lens + w.output_lens > c.max_position_embeddings)
    if too_long.size:
        i = int(too_long[0])
        raise ConfigError(f"sequence {i} needs {int(w.input_lens[i] + w.output_lens[i]):,} positions (input "
                          f"{int(w.input_lens[i]):,} + output {int(w.output_lens[i]):,}) but the model allows "
                          f"{c.max_position_embeddings:,}: clip the workload (workload.max_input / "
                          "workload.max_output)")


def _checked_prompts(job: Job, settings: ExecSettings, c: ExecModelConfig, prompts: list[np.ndarray] | None,
                     done_before: list[int]) -> list[np.ndarray]:
    """The prompts every repeat runs (synthetic when None), after checking they fit the model."""
    w = job.workload
    if prompts is None:
        return random_prompts(w.input_lens, c.vocab_size, seed=settings.weights_seed + 1, prefix_group=w.prefix_group,
                              prefix_len=w.prefix_len, tree=w.prefix_tree)
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    lens = [len(p) + d for p, d in zip(prompts, done_before)]
    if len(prompts) != len(w) or lens != [int(n) for n in w.input_lens]:
        raise ConfigError(f"prompts: {len(prompts)} prompts of lengths {lens[:8]} do not match the workload's "
                          f"{len(w.input_lens)} input lengths {[int(n) for n in w.input_lens[:8]]}")
    return prompts


def _checked_params(job: Job, settings: ExecSettings, params: list[SamplingParams] | None,
                    done_before: list[int]) -> list[SamplingParams]:
    w = job.workload
    if params is None:
        try:
            return [SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                                   max_tokens=int(n), ignore_eos=settings.ignore_eos, stop=settings.stop)
                    for n in w.output_lens]
        except ValueError as e:
            raise ConfigError(f"backend sampling settings: {e}") from e
    budgets = [p.max_tokens - d for p, d in zip(params, done_before)]
    if len(params) != len(w) or budgets != [int(n) for n in w.output_lens]:
        raise ConfigError(f"params: {len(params)} sampling settings with max_tokens {budgets[:8]} do not match the "
                          f"workload's {len(w)} output lengths {[int(n) for n in w.output_lens[:8]]}")
    return params


def text_decoder(model_path: str | None, params: list[SamplingParams]) -> Callable[[list[int]], str] | None:
    """Token ids -> text with the model directory's tokenizer, which stop strings need (None without one)."""
    if model_path and (Path(model_path) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(model_path)
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
    if any(p.stop for p in params):
        raise ConfigError("stop strings need a tokenizer: set backend.model_path to a directory with "
                          "tokenizer.json")
    return None


def _run_once(job: Job, settings: ExecSettings, models: dict, devices: list[torch.device], dtype: torch.dtype,
              pools: KVPools, host: HostPools, prompts: list[np.ndarray], params: list[SamplingParams],
              on_finish: FinishObserver | None, resumed: list[list[int]] | None = None,
              after_run: Callable[[SequenceTokens], None] | None = None, streamers: dict | None = None) -> ExecOutput:
    """One run of the whole job on already built models: fresh host pools (one per node), KV caches, state and
    sampled tokens. `streamers`: per device, the model's weight streamer (None where every weight is resident)."""
    start, cpu_start, meter = time.perf_counter(), time.process_time(), LoadMeter()
    cluster = effective_cluster(job)
    c = models[devices[0]].config
    prepared = prepare(job, kv_pages_per_gpu=pools.num_pages, host_prefixes=True, prefix_fetch=True,
                       resume_prefix=True, **host_kw(host))
    node = prepared.state.topo.gpu_node
    device_of = [devices[gpu // cluster.instance_size] for gpu in range(cluster.num_gpus)]
    geometry = pools.geometry
    host_pool = [HostPool(geometry["num_layers"], 1 if geometry.get("v_head_dim") == 0 else 2, job.page_tokens,
                          geometry["num_kv_heads"], geometry["head_dim"], dtype, pages=pools.num_pages,
                          budget_pages=host.budget_pages,
                          pinned=any(d.type == "cuda" for d, n in zip(device_of, node) if n == k))
                 for k in range(cluster.num_nodes)]
    caches = [PagedKVCache.from_budget(**geometry, page_size=job.page_tokens, budget_bytes=pools.pool_bytes,
                                       dtype=dtype, device=device_of[gpu], max_context=pools.max_context,
                                       staging_pages=pools.staging_pages, host_pool=host_pool[node[gpu]])
              for gpu in range(cluster.num_gpus)]
    tokens = SequenceTokens(prompts, params, c.eos_token_ids, text_decoder(settings.model_path, params),
                            resumed=resumed)
    streamers = streamers or {}
    planned = stream_spec_of(prepared.budget, job.model)
    built = {s.spec if s else None for s in streamers.values()} or {None}
    if built != {planned}:
        raise InvariantError(f"the memory plan streams {planned} but the models were built streaming {built}")
    policy = prepared.policy
    runners = [InstanceRunner(models[dev], attention_tp=policy.attention_tp, streamer=streamers.get(dev))
               for dev in devices]
    backend = ExecBackend(prepared.state, runners, caches, tokens, job_seed=settings.weights_seed,
                          check=job.check_invariants)

    def on_step(plan, result) -> None:
        ended = finished_ids(plan, result)
        if ended.size and on_finish:
            on_finish(ended, tokens)
        if after_run:
            after_run(tokens)

    engine = Engine(policy, backend, gpus_per_node=prepared.cluster.node_size,
                    check_invariants=job.check_invariants, on_step=on_step if on_finish or after_run else None)
    engine_start = time.perf_counter()
    engine.run_in_turn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    engine_wall = time.perf_counter() - engine_start
    engine.finish()
    return ExecOutput(job, prepared, engine.records, wall, backend.events, backend="exec",
                      tokens=tokens, kv_moves=dict(backend.moves), kv_traffic=dict(backend.traffic),
                      kv_account=backend.account, host_pools=[pool_use(p) for p in host_pool],
                      capabilities=backend.capabilities, cpu_share=cpu / (wall * torch.get_num_threads()),
                      clock=settings.clock, wall_bct_s=engine_wall, load=meter.read().to_dict())


def pool_use(pool: HostPool) -> dict:
    return {"budget_pages": pool.budget_pages, "capacity_pages": pool.capacity_pages(), "peak_pages": pool.peak_used,
            "page_bytes": pool.page_bytes}


def check_runs_here(policy, capabilities) -> None:
    """The engine's `check_supported`, before any weight is built, its refusal naming this backend (and, for
    two-batch overlap, why it has none)."""
    try:
        check_supported(policy, capabilities)
    except ConfigError as e:
        why = (" runs every forward whole (one process has no all-to-all for a second micro-batch to hide, so "
               "the overlap would only be priced, never performed)" if "two-batch" in str(e) else "")
        raise ConfigError(f"backend=exec{why}: {e}") from None
