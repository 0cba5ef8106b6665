"""The static plan: choose B_attn, B_moe, where running KV lives, where attention runs and which expert weights
stream, from the latency model, before the job runs (the paper's cost model; MoE-Gen's two constraints).

For every candidate (B_attn in powers of two, B_moe in powers of two up to the sequences a rank will see,
kv_residency device / host / mixed, attention gpu / cpu (not for MLA), and the number of MoE layers whose
experts stream from host through a two-layer ring buffer) the planner
1. checks memory: on the device, resident weights (+ ring buffer) + activations of the batch shape (staging
   area included; as in `plan_memory`, only when the policy declares `batch_shape`) + the fixed reserve + the
   device KV the candidate keeps (every running sequence's pages at the typical context for `device`;
   whatever is left for `mixed`, whose overflow runs host-resident); on the host, the node's weights + the KV
   of its B_moe x GPUs running sequences at their final length (mean prompt + mean output);
2. predicts one decode iteration at the typical context (mean prompt + half the mean output) with the same
   per-layer DAG the simulator prices runs with (batchgen.plan.decode), every rank of the instance alike;
3. keeps the candidate with the highest predicted decode throughput per instance over the whole batch, not
   the steady state: a rank's share of the workload's output lengths is replayed with the candidate's running
   set (batchgen.plan.waves), and the iterations of the drain, where few sequences are left, are priced at
   their own size (an iteration's fixed costs, streamed expert weights above all, do not shrink). `choose`:
   among those within `TIE` (1%) of it, the smallest B_moe, then the least host traffic, then device before
   mixed before host and GPU before CPU attention: a simpler plan for no measurable gain.
Only the policy's knobs set to "auto" are planned; explicit values restrict the candidates. Where B_moe is
bounded below a candidate by device KV (device residency) or host memory, the exact fill is planned too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchgen.latency import LatencyModel
from batchgen.memory import (BatchShape, ConfigError, MemorySettings, activation_bytes, batch_shape_of,
                             host_weight_bytes, prefill_ring_bytes, staging_bytes, weight_layout)
from batchgen.plan.decode import DecodeGrid, price_decode
from batchgen.workload.prefixes import shared_prefix_tokens
from batchgen.plan.waves import output_sketch, price_points, share_occupancy, share_outputs, weighted_seconds
from batchgen.specs import ClusterSpec, ModelSpec

AUTO = "auto"
PLANNED = ("b_attn", "b_moe", "kv_residency", "attention")
B_ATTN = (32, 64, 128, 256, 512, 1024)
PREFILL_CHUNKS = (32768, 16384, 8192, 4096, 2048)  # prompt tokens per rank per prefill forward, when planned
B_MOE_MAX_LOG2 = 15          # B_moe candidates 2^5 .. 2^15 per rank (and the exact fills below them)
MAX_MICRO_BATCHES = 64       # host-resident micro-batches per layer at most (a DAG under ~300 nodes)
RESIDENCY_ORDER = ("device", "mixed", "host")
TIE = 0.01


@dataclass(frozen=True)
class WorkloadStats:
    """What the planner needs from a workload."""

    num_sequences: int
    mean_input: float
    mean_output: float
    max_context: int
    output_sketch: tuple[float, ...] = ()  # percentiles of the output lengths (waves.output_sketch); () = all mean
    # where prompt prefixes are shared (`shared_prefix_tokens`): the tokens a sequence holds by reference (mean over
    # all), the prefixes of every group together (each segment of a nested group once), and whether host copies
    # share them once a node too (the backend's `host_prefixes`)
    shared: float = 0.0
    prefix_tokens: float = 0.0
    host_shared: bool = True

    @classmethod
    def of(cls, workload, page_tokens: int = 1, sharing: bool = False, host: bool = True) -> "WorkloadStats":
        """`sharing`: prefixes shared (a running sequence holds its group's by reference); `host`: on a node too."""
        w, inp, out = workload, np.asarray(workload.input_lens), np.asarray(workload.output_lens)
        shared, prefixes = shared_prefix_tokens(w.prefix_group, w.prefix_len, page_tokens, w.prefix_tree) if sharing \
            and w.prefix_group is not None else (0.0, 0.0)
        return cls(int(inp.size), float(inp.mean()), float(out.mean()), int((inp + out).max()), output_sketch(out),
                   shared, prefixes, host)

    @property
    def typical_context(self) -> int:
        """Mean prompt + half the mean output: the context of a running sequence, on average."""
        return int(round(self.mean_input + self.mean_output / 2))


@dataclass(frozen=True)
class Plan:
    """The chosen decode plan, its predicted speed and its memory use."""

    b_attn: int
    b_moe: int
    kv_residency: str
    attention: str
    streamed_layers: int        # MoE layers whose experts stream from host every iteration (0: all resident)
    device_seqs: int            # running sequences per rank with device KV (at the typical context)
    host_seqs: int              # running sequences per rank with host-resident KV
    typical_context: int
    layer_s: float              # predicted steady-state seconds of one MoE layer (of a dense layer if no MoE)
    iteration_s: float          # predicted seconds of one decode iteration
    tokens_per_s: float         # predicted decode tokens per second per instance, steady state
    batch_tokens_per_s: float   # the same over the batch's waves of running sets (what the planner maximises)
    host_bytes_per_iter: float  # predicted host <-> device bytes per decode iteration per instance
    device_gb: dict = field(default_factory=dict)  # per GPU: weights, kv, activations, staging, reserve, capacity
    host_gb: dict = field(default_factory=dict)    # per node: weights, kv, capacity
    candidates: int = 0         # candidates priced (that fit memory)
    ranks: int = 1              # ranks of an instance
    prefill_tokens: int = 0     # the planned prefill chunk per rank (0: the policy's own, not planned)
    instance_sizes: tuple = ()  # with cluster.gpus_per_instance=auto: (GPUs, prefill s, decode s) of each size
    prefill_modes: tuple = ()   # with policy.prefill_parallel=auto: (ep or dp, chunk, prefill s, decode s) of each

    def resolve(self, policy: Any) -> Any:
        """The policy with its "auto" knobs replaced by this plan's values (explicit ones are kept)."""
        chosen = {"b_attn": self.b_attn, "b_moe": self.b_moe, "kv_residency": self.kv_residency,
                  "attention": self.attention, "prefill_tokens_per_rank": self.prefill_tokens}
        return dataclasses.replace(policy, **{k: v for k, v in chosen.items() if getattr(policy, k, None) == AUTO})

    def describe(self) -> str:
        """One line: the choice, its predicted per-layer time and throughput, and its traffic."""
        weights = ("weights resident" if not self.streamed_layers
                   else f"experts of {self.streamed_layers} MoE layers streamed")
        where = {"device": "device KV", "host": "host-resident KV", "mixed": "device KV then host-resident"}
        attn = f", {self.attention.upper()} attention" if self.host_seqs else ""
        return (f"plan: b_attn={self.b_attn} b_moe={self.b_moe} ({where[self.kv_residency]}: "
                f"{self.device_seqs} device + {self.host_seqs} host per rank{attn}), {weights}; "
                f"predicted {self.layer_s * 1e3:.2f} ms/layer, {self.iteration_s:.3f} s/iteration, "
                f"{self.tokens_per_s:,.0f} decode tok/s per instance ({self.batch_tokens_per_s:,.0f} over the "
                "batch's waves), "
                f"{self.host_bytes_per_iter / 1e9:.1f} GB host<->device per iteration "
                f"(context {self.typical_context:,}; {self.candidates} candidates)"
                + (f"; prefill chunk {self.prefill_tokens:,} tokens per rank" if self.prefill_tokens else "")
                + self._instances() + self._prefill_modes())

    def _instances(self) -> str:
        if not self.instance_sizes:
            return ""
        each = ", ".join(f"{size}: {_seconds(prefill + decode)} s" for size, prefill, decode in self.instance_sizes)
        return f"; instance size planned (GPUs: predicted prefill + decode over the batch): {each}"

    def _prefill_modes(self) -> str:
        if not self.prefill_modes:
            return ""
        way = {"ep": "expert parallel", "dp": "data parallel"}
        each = ", ".join(f"{way[mode]}" + (f" at {chunk:,}" if mode == "dp" else "") + f": {_seconds(p)} + "
                         f"{_seconds(d)} s" for mode, chunk, p, d in self.prefill_modes)
        return f"; prefill planned (predicted prefill + decode over the batch): {each}"

    def to_dict(self) -> dict:
        """As plain JSON types (results.json): each instance size and each way of prefilling with its predicted
        prefill and decode seconds."""
        d = dataclasses.asdict(self)
        d["instance_sizes"] = [[size, round(p, 3), round(dec, 3)] for size, p, dec in self.instance_sizes]
        d["prefill_modes"] = [[mode, chunk, round(p, 3), round(dec, 3)] for mode, chunk, p, dec in self.prefill_modes]
        return d


def _seconds(s: float) -> str:
    return f"{s:,.0f}" if s >= 100 else f"{s:.3g}"


@dataclass(frozen=True)
class Candidate:
    """A priced candidate, as `choose` compares them."""

    tokens_per_s: float
    b_moe: int
    host_bytes: float = 0.0
    kv_residency: str = "device"
    attention: str = "gpu"
    streamed_layers: int = 0
    b_attn: int = 0
    payload: Any = field(default=None, compare=False)


def choose(candidates: list[Candidate], tie: float = TIE) -> Candidate:
    """The fastest candidate; among those within `tie` of it, the smallest B_moe, then the least host traffic,
    then device before mixed before host KV, GPU before CPU attention, fewer streamed layers, larger B_attn."""
    if not candidates:
        raise ValueError("choose: no candidates")
    top = max(c.tokens_per_s for c in candidates)
    near = [c for c in candidates if c.tokens_per_s >= top * (1 - tie)]
    return min(near, key=lambda c: (c.b_moe, c.host_bytes, RESIDENCY_ORDER.index(c.kv_residency),
                                    c.attention != "gpu", c.streamed_layers, -c.b_attn))


def needs_plan(policy: Any) -> bool:
    """Whether any of the policy's planned knobs is "auto"."""
    return any(getattr(policy, k, None) == AUTO for k in (*PLANNED, "prefill_tokens_per_rank"))


def plan_job(model: ModelSpec, cluster: ClusterSpec, lat: LatencyModel, settings: MemorySettings, policy: Any,
             stats: WorkloadStats, *, page_tokens: int) -> Plan:
    """Plan a job's "auto" knobs (see the module docstring); raises ConfigError if no candidate fits.
    Plans are cached by their inputs (a sweep prepares the same job many times)."""
    key = (model, cluster, lat.key(), settings, policy, stats, page_tokens)
    try:
        hash(key)
    except TypeError:  # an unhashable policy: plan without the cache
        return _plan_chunk(lat, model, cluster, settings, policy, stats, page_tokens)
    plan = _CACHE.get(key)
    if plan is None:
        plan = _CACHE[key] = _plan_chunk(lat, model, cluster, settings, policy, stats, page_tokens)
        if len(_CACHE) > 64:
            _CACHE.pop(next(iter(_CACHE)))
    return plan


def _plan_chunk(lat, model, cluster, settings, policy, stats, page_tokens) -> Plan:
    """A planned prefill chunk (`prefill_tokens_per_rank: auto`) only changes the activations the chunk holds,
    and so what is left for weights and KV: each chunk's plan, and the LARGEST chunk whose plan is within `TIE`
    of the best decode throughput (the planner does not price prefill; a larger chunk costs fewer forwards, and
    only the chunk that would evict weights or KV from the device is worth shrinking)."""
    if getattr(policy, "prefill_tokens_per_rank", None) != AUTO:
        return _Planner(lat, model, cluster, settings, policy, stats, page_tokens).run()
    plans, errors = [], []
    for chunk in PREFILL_CHUNKS:
        try:
            plan = _Planner(lat, model, cluster, settings, dataclasses.replace(policy, prefill_tokens_per_rank=chunk),
                            stats, page_tokens).run()
        except ConfigError as e:
            errors.append(e)
            continue
        if plans and plan.batch_tokens_per_s < plans[-1].batch_tokens_per_s * (1 + TIE):
            break  # halving the chunk no longer frees memory that decode can use: smaller ones gain no more
        plans.append(dataclasses.replace(plan, prefill_tokens=chunk))
    if not plans:
        raise errors[-1]
    top = max(p.batch_tokens_per_s for p in plans)
    return next(p for p in plans if p.batch_tokens_per_s >= top * (1 - TIE))


_CACHE: dict = {}


def _fits(room: float, prefixes: float, own: float, whole: float) -> int:
    """How many sequences `room` bytes hold: each its `own` bytes beside every group's prefix once (`prefixes`), or,
    where that is fewer, each its `whole` bytes (a prefix per sequence at most)."""
    return max(int((room - prefixes) // own) if room > prefixes else 0, int(room // whole))


def _held(n: int, prefixes: float, own: float, whole: float) -> float:
    """The bytes `n` sequences take by `_fits`' count."""
    return min(prefixes + n * own, n * whole)


def _batch_shape(policy: Any, b_attn: int, b_moe: int, residency: str, max_context: int) -> BatchShape | None:
    """The batch shape a candidate's activations take: the policy's own `batch_shape` on the candidate's
    knobs, so that the plan and the memory budget (`plan_memory`) agree; None if the policy declares none
    (then, as in the memory budget, the fixed activation reserve stands for every activation)."""
    trial = {k: v for k, v in (("b_attn", b_attn), ("b_moe", b_moe), ("kv_residency", residency))
             if hasattr(policy, k)}
    return batch_shape_of(dataclasses.replace(policy, **trial) if trial else policy, max_context)


@dataclass
class _Cell:
    b_moe: int
    residency: str
    streamed: int          # MoE layers whose weights stream
    streamed_bytes: float  # weight bytes streamed per iteration, one rank
    n_dev: int
    n_host: int
    device: dict
    host: dict


class _Planner:
    def __init__(self, lat, model, cluster, settings, policy, stats, page_tokens):
        self.lat, self.m, self.c, self.s, self.policy = lat, model, cluster, settings, policy
        self.b_attn, self.b_moe, self.residency, self.attention = (getattr(policy, k, AUTO) for k in PLANNED)
        self.stats, self.P = stats, page_tokens
        self.can_stream = bool(getattr(policy, "can_stream_weights", False))
        self.overlap = bool(getattr(policy, "comm_overlap", False))  # priced for device-resident cells only
        m = model
        # a rank is a TP-attention group of `degree` GPUs where the latency model says so (tp_attention.py):
        # memory is per GPU, batches and KV pools per group, experts spread over every GPU of the instance
        self.degree = int(getattr(lat, "attention_tp", 1))
        self.R = lat.ep_ranks // self.degree
        self.groups_per_node = max(cluster.node_size // self.degree, 1)
        kv_split = self.degree if m.attention == "gqa" else 1  # GQA splits a token's KV heads over the group
        self.weights = lat.weight_bytes_per_rank()
        n_moe = m.num_moe_layers
        per_rank_experts = -(-m.num_experts // lat.ep_ranks) if m.is_moe else 0
        self.layer_experts = per_rank_experts * m.expert_params * m.weight_bytes  # one MoE layer, one rank
        self.n_moe = n_moe
        self.capacity = (cluster.gpu.hbm_bytes * settings.gpu_memory_fraction - settings.activation_reserve_gb * 1e9
                         - prefill_ring_bytes(model, lat, policy))
        self.page_bytes = page_tokens * m.kv_bytes_per_token
        # one device-resident sequence, on each GPU of its rank; where prefixes are shared, its own pages past its
        # group's prefix (`whole_seq_bytes`: without), every group's prefix once a rank (`_fits`)
        ctx = stats.typical_context
        self.whole_seq_bytes = math.ceil((ctx + page_tokens) / page_tokens) * self.page_bytes / kv_split
        self.seq_bytes = math.ceil((ctx - stats.shared + page_tokens) / page_tokens) * self.page_bytes / kv_split
        self.prefix_bytes = stats.prefix_tokens / page_tokens * self.page_bytes / kv_split
        self.host_usable = cluster.host_mem_bytes_per_node * settings.host_memory_fraction
        self.host_weights = host_weight_bytes(model, lat, cluster.node_size)
        # its host copy at its final length (past its group's prefix, held once on a node, where prefixes are shared)
        self.whole_final_bytes = (stats.mean_input + stats.mean_output) * m.kv_bytes_per_token
        self.final_seq_bytes = self.whole_final_bytes - stats.shared * m.kv_bytes_per_token * stats.host_shared
        self.host_prefix_bytes = stats.prefix_tokens * m.kv_bytes_per_token * stats.host_shared
        self._share = None   # a rank's share of the output lengths (batch_throughputs), built once

    # ---- candidates ----------------------------------------------------------------------------------
    def _values(self, knob, auto_values):
        return tuple(auto_values) if knob == AUTO else (knob,)

    def b_moe_values(self) -> list[int]:
        if self.b_moe != AUTO:
            return [int(self.b_moe)]
        values = {min(1 << k, self.per_rank) for k in range(5, B_MOE_MAX_LOG2 + 1)}
        return sorted(values)

    def residencies(self) -> tuple[str, ...]:
        # a CPU device is the host: "host-resident" KV would sit in the same memory, restored by memcpy; the
        # micro-batches' all-to-all overlap is priced for device-resident KV only
        if self.overlap and self.residency not in (AUTO, "device"):
            raise ConfigError(f"policy.comm_overlap prices device-resident decode only: set "
                              f"policy.kv_residency=device or auto (not {self.residency}), or "
                              "policy.comm_overlap=false")
        return self._values(self.residency, ("device",) if self.on_cpu or self.overlap else RESIDENCY_ORDER)

    @property
    def on_cpu(self) -> bool:
        return self.c.gpu.kind == "cpu"

    def attentions(self) -> tuple[str, ...]:
        cpu_ok = self.m.attention != "mla" and not self.on_cpu
        if self.attention == "cpu" and not cpu_ok:
            raise ConfigError(f"policy.attention=cpu is not offered for {self.m.name}: its MLA latent KV must be "
                              "up-projected on the GPU; use policy.attention=gpu or auto")
        return self._values(self.attention, ("gpu", "cpu") if cpu_ok else ("gpu",))

    def layouts(self, free: float, residency: str) -> list[tuple[int, float, float]]:
        """(MoE layers streamed, resident weight bytes, bytes streamed per iteration) of each layout to try: the
        fewest streamed layers that let the weights fit `free` bytes (with a page of KV), and for device / mixed
        residency also more, to make room for device KV; every decoder layer streamed whole where even every MoE
        layer's experts leave too much resident (batchgen.memory.weight_layout, as the memory budget has it)."""
        if self.weights + self.page_bytes <= free:
            k_min = 0
        elif not (self.can_stream and self.m.is_moe and self.layer_experts > 0):
            return []
        else:
            k_min = max(2, math.ceil((self.weights + 2 * self.layer_experts + self.page_bytes - free)
                                     / self.layer_experts - 1e-9))
            if k_min > self.n_moe:
                resident, streamed, whole = weight_layout(self.m, self.lat, self.n_moe, free - self.page_bytes)
                return [(self.n_moe, resident, streamed)] if whole else []
        if residency == "host" or not (self.can_stream and self.m.is_moe):
            ks = [k_min]
        else:
            ks = sorted({k_min, max(k_min, 2) + (self.n_moe - max(k_min, 2)) // 2, self.n_moe} - {1})
        return [(k, *weight_layout(self.m, self.lat, k, free - self.page_bytes)[:2]) for k in ks]

    def cells(self, b_attn: int) -> list[_Cell]:
        out = []
        m, stats = self.m, self.stats
        values = self.b_moe_values()
        covered = lambda fill, b: self.b_moe == AUTO and b // 2 >= values[0] and fill <= b // 2  # noqa: E731
        for b_moe in values:
            if self.b_attn == AUTO and b_attn // 2 >= b_moe and b_attn != B_ATTN[0]:
                continue  # one micro-batch either way: the next smaller B_attn covers it
            running = b_moe  # what host memory holds of it: the running KV at its final length
            held = _fits(self.host_usable - self.host_weights, self.host_prefix_bytes,
                         self.groups_per_node * self.final_seq_bytes, self.groups_per_node * self.whole_final_bytes)
            if held < b_moe:
                if held < 1 or covered(held, b_moe):
                    continue  # nothing fits, or the next smaller candidate covers it
                running = held  # host memory bounds the running set below B_moe
                if self.b_moe == AUTO:
                    b_moe = held  # the exact fill: B_moe is the cap on host-resident sequences
            for residency in self.residencies():
                shape = _batch_shape(self.policy, b_attn, b_moe, residency, stats.max_context)
                staging = shape.staging_seqs if shape else 0
                act = activation_bytes(m, shape, stats.max_context) if shape else 0.0
                free = self.capacity - act
                for k, resident, streamed in self.layouts(free, residency):
                    kv_free = free - resident
                    cap = _fits(kv_free, self.prefix_bytes, self.seq_bytes, self.whole_seq_bytes)
                    if residency == "device":
                        # device KV bounds the running set (the policy yields what does not fit); below the
                        # next smaller candidate, that candidate covers it
                        if cap < 1 or (cap < running and covered(cap, b_moe)):
                            continue
                        n_dev, n_host = min(running, cap), 0
                    elif residency == "mixed":
                        n_dev = min(running, cap)
                        n_host = running - n_dev
                        if (n_dev == 0 or n_host == 0) and self.residency == AUTO:
                            continue  # the same as host or device, which are candidates too
                    else:
                        n_dev, n_host = 0, running
                    if n_host and math.ceil(n_host / b_attn) > MAX_MICRO_BATCHES:
                        continue
                    out.append(self._cell(b_moe, residency, (k, resident, streamed), n_dev, n_host, kv_free, act,
                                          staging))
        return out

    def _cell(self, b_moe, residency, layout, n_dev, n_host, kv_free, act, staging) -> _Cell:
        k, resident, streamed = layout
        dev_kv = _held(n_dev, self.prefix_bytes, self.seq_bytes, self.whole_seq_bytes) if residency == "device" \
            else max(kv_free, 0.0)
        device = {"weights": resident, "kv": dev_kv, "activations": act,
                  "staging": staging_bytes(self.m, staging, self.stats.max_context),
                  "reserve": self.s.activation_reserve_gb * 1e9,
                  "capacity": self.c.gpu.hbm_bytes * self.s.gpu_memory_fraction}
        host = {"weights": self.host_weights,
                "kv": _held(n_dev + n_host, self.host_prefix_bytes, self.groups_per_node * self.final_seq_bytes,
                            self.groups_per_node * self.whole_final_bytes),
                "capacity": self.host_usable}
        return _Cell(b_moe, residency, k, streamed, n_dev, n_host, device, host)

    # ---- pricing -----------------------------------------------------------------------------------
    def price(self, b_attn: int, cpu: bool, cells: list[_Cell]):
        ctx = self.stats.typical_context
        n_dev = np.array([[c.n_dev for c in cells]], float)
        n_host = np.array([[c.n_host for c in cells]], float)
        gate = n_dev + n_host
        grid = DecodeGrid(n_dev, n_dev * ctx, np.ceil(n_dev / b_attn), n_host, n_host * ctx, gate)
        prefetch = np.array([c.streamed_bytes / max(self.n_moe, 1) for c in cells])
        p = price_decode(self.lat, grid, b_attn, cpu_attention=cpu, prefetch_bytes=prefetch, replicas=self.R,
                         overlap=self.overlap)
        return p

    def run(self) -> Plan:
        rows: list[Candidate] = []
        n_dense, n_moe = self.lat.layer_counts()
        for b_attn in self._values(self.b_attn, B_ATTN):
            b_attn = int(b_attn)
            cells = self.cells(b_attn)
            if not cells:
                continue
            for attention in self.attentions():
                cpu = attention == "cpu"
                # without host-resident sequences CPU attention is GPU attention: priced once (unless asked for)
                mine = [c for c in cells if not (cpu and c.n_host == 0 and self.attention == AUTO)]
                if not mine:
                    continue
                p = self.price(b_attn, cpu, mine)
                batch = self.batch_throughputs(b_attn, cpu, mine)
                for j, c in enumerate(mine):
                    it = float(p.iteration_s[j])
                    tps = (c.n_dev + c.n_host) * self.R / it if it > 0 else 0.0
                    batch_tps = batch[j]
                    layer = float(p.moe_layer_s[j]) if n_moe else it / max(n_dense, 1)
                    rows.append(Candidate(batch_tps, c.b_moe, self._host_bytes(c, b_attn, cpu), c.residency,
                                          attention, c.streamed, b_attn, payload=(c, it, layer, tps)))
        if not rows:
            raise ConfigError(self._why_nothing_fits())
        best = choose(rows)
        c, it, layer, steady = best.payload
        gb = lambda d: {k: round(v / 1e9, 3) for k, v in d.items()}  # noqa: E731
        return Plan(b_attn=best.b_attn, b_moe=c.b_moe, kv_residency=c.residency, attention=best.attention,
                    streamed_layers=c.streamed, device_seqs=c.n_dev, host_seqs=c.n_host,
                    typical_context=self.stats.typical_context, layer_s=layer, iteration_s=it,
                    tokens_per_s=steady, batch_tokens_per_s=best.tokens_per_s,
                    host_bytes_per_iter=best.host_bytes, device_gb=gb(c.device),
                    host_gb=gb(c.host), candidates=len(rows), ranks=self.R)

    @property
    def per_rank(self) -> int:
        """Sequences one rank will see over the job (the input spread evenly)."""
        return max(1, math.ceil(self.stats.num_sequences / (self.c.num_gpus // self.degree)))

    def batch_throughputs(self, b_attn: int, cpu: bool, cells: list[_Cell]) -> list[float]:
        """Each cell's decode tokens per second per instance over a rank's whole share of the batch (waves.py):
        the iterations at each running-set size as the share drains, priced at that size (device KV first)."""
        if self._share is None:
            self._share = share_outputs(self.stats.output_sketch, self.per_rank, self.stats.mean_output)
        variants, spans = [], []
        for c in cells:
            n = min(c.n_dev + c.n_host, self.per_rank)
            points = price_points(n) if n else []
            spans.append((len(variants), points))
            variants += [dataclasses.replace(c, n_dev=min(m, c.n_dev), n_host=m - min(m, c.n_dev)) for m in points]
        seconds = self.price(b_attn, cpu, variants).iteration_s if variants else ()
        out = []
        for c, (start, points) in zip(cells, spans):
            if not points:
                out.append(0.0)
                continue
            hist = share_occupancy(self.stats.output_sketch, self.per_rank, self.stats.mean_output, points[-1], self.P)
            total = weighted_seconds(hist, points, [float(x) for x in seconds[start:start + len(points)]])
            out.append(float(self._share.sum()) * self.R / total if total > 0 else 0.0)
        return out

    def _host_bytes(self, c: _Cell, b_attn: int, cpu: bool) -> float:
        """Host <-> device bytes of one decode iteration of the instance under this cell (under TP attention
        every GPU of a group restores its share of the KV: MLA's whole latent, GQA's heads)."""
        m = self.m
        kv = m.kv_bytes_per_token_per_layer
        if cpu:
            per_seq = m.num_layers * (2 * m.num_heads * m.head_dim * m.act_bytes + kv)
        else:
            copies = 1 if m.attention == "gqa" else self.degree
            per_seq = m.num_layers * (self.stats.typical_context + 1) * kv * copies
        return self.R * c.n_host * per_seq + self.R * self.degree * c.streamed_bytes

    def _why_nothing_fits(self) -> str:
        gb = 1e9
        return (f"no plan fits {self.m.name} on {self.c.gpu.name} (policy knobs b_attn={self.b_attn}, "
                f"b_moe={self.b_moe}, kv_residency={self.residency}, attention={self.attention}): "
                f"{self.weights / gb:.1f} GB of weights per GPU against {self.capacity / gb:.1f} GB usable, "
                f"{self.host_usable / gb:.0f} GB usable host memory per node; set smaller explicit batches "
                "(policy.b_moe, policy.b_attn), allow host-resident KV (policy.kv_residency=auto), or add "
                "memory")
