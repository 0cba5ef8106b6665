"""Predict a batch job's completion time under each policy before any model is loaded.

`python -m batchgen.run ... job.estimate=true` reads the input file's prompt lengths and max_tokens, and this
module simulates the job on the chosen cluster under every policy it is given (`batchgen.sim.run.simulate`) and
prints the predicted batch completion time (BCT) of each.

What is assumed, and said in the printout (`format_estimate`):

- Output lengths are not known in advance (a request ends at EOS), so they are drawn from a distribution
  (`output`, default `DEFAULT_OUTPUT`: the output lengths of the shipped Azure LLM conversation trace, 2023),
  clipped at each request's max_tokens; a request with ignore_eos runs to exactly max_tokens. The predicted
  times scale with the drawn lengths: a job whose answers are longer than the assumed ones takes longer.
- Prompt lengths may be guesses (`EstimateInput.approximate_prompts`: no tokenizer was at hand).
- Large jobs on clusters of several independent node groups simulate one group's share (`share`): see below.

How `output` is written (a plain mapping; a Hydra node converted to one):

- ``{trace: azure_conv_2023.csv}``: resample (with replacement) the output lengths of a trace, a shipped one
  (`batchgen.workload.shipped_traces`) or a CSV path, read by `batchgen.workload.load_trace`;
- ``{kind: fixed | uniform | longtail, ...}``: a length distribution (`batchgen.workload.make_distribution`);
- ``{kind: max_tokens}``: every request runs to its max_tokens (the upper bound of the job).

Speed: 100K requests on 128 GPUs must print in under a minute on two cores. Two things make that so, neither of
which changes what the simulator or the policies do:

- the policies are simulated in parallel processes (`workers`; default: one per policy, at most one per core);
  this is exact: each process runs the same deterministic simulation;
- `share`: the job's upper-level split sends request i to expert-parallel instance i mod I (round-robin,
  `batchgen.job.prepare`), and instances on different nodes share nothing in the simulator (no host memory, no
  link) except one thing: coroutine's cross-instance MIGRATE, which steals suspended work from other instances
  once its own prompts are done. So a cluster of G groups of whole nodes (each holding whole instances) is
  simulated as one group running its round-robin share of the requests (about 1/G of them): the group that gets
  the longest request, since in a long tail the largest straggler's group is the slowest one, and the slowest
  group sets the completion time. This is an approximation: the other groups' shares are statistically the same
  but not identical, and coroutine cannot steal across groups in the tail. With `share=None` (default) it is used when
  the job has at least `SHARE_MIN_REQUESTS` requests and the cluster splits into more than one group; small
  jobs are simulated whole (they are fast anyway, and their shares differ more).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.latency import Efficiency, LatencySettings, load_efficiency
from batchgen.memory import ConfigError, MemorySettings
from batchgen.setup import plain
from batchgen.specs import ClusterSpec, ModelSpec
from batchgen.workload.prefix_tree import PrefixTree

# The shipped Azure conversation trace (19,366 real requests, 2023): output median 129, P95 451, P99 601, max 1000
# tokens. Real chat answers, not a shape anyone here chose; see batchgen/data/traces/README.md.
DEFAULT_OUTPUT: Mapping[str, Any] = {"trace": "azure_conv_2023.csv"}

# Jobs at least this large on a cluster of several independent node groups simulate one group's share.
SHARE_MIN_REQUESTS = 20_000


@dataclass(frozen=True)
class EstimateInput:
    """What the input file says about every sequence (a request's choice: one per request unless it asks for n):
    prompt tokens, max_tokens and ignore_eos."""

    prompt_lens: np.ndarray   # int64 >= 1 per sequence
    max_tokens: np.ndarray    # int64 >= 1 per sequence
    ignore_eos: np.ndarray    # bool per sequence
    approximate_prompts: bool = False  # prompt lengths were guessed (no tokenizer): the printout says so
    requests: int | None = None  # the requests those sequences answer (None: one sequence each)
    prefix_group: np.ndarray | None = None  # sequences that share a prompt prefix (a request's n choices), with ...
    prefix_len: np.ndarray | None = None    # ... its length (batchgen.workload.prefixes; None: nothing shared)
    prefix_tree: PrefixTree | None = None   # ... and the groups nested in groups (batchgen.workload.prefix_tree)

    def __post_init__(self) -> None:
        p = np.asarray(self.prompt_lens)
        m = np.asarray(self.max_tokens)
        e = np.asarray(self.ignore_eos)
        if p.ndim != 1 or m.shape != p.shape or e.shape != p.shape:
            raise ValueError(f"prompt_lens, max_tokens and ignore_eos must be 1-D arrays of one length, got "
                             f"shapes {p.shape}, {m.shape}, {e.shape}")
        for name, a in (("prompt_lens", p), ("max_tokens", m)):
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
            if a.size and a.min() < 1:
                bad = int(np.argmax(a < 1))
                raise ValueError(f"{name} must be >= 1 everywhere, got {a[bad]} at request {bad}")
        object.__setattr__(self, "prompt_lens", p.astype(np.int64))
        object.__setattr__(self, "max_tokens", m.astype(np.int64))
        object.__setattr__(self, "ignore_eos", e.astype(bool))

    def __len__(self) -> int:
        return int(self.prompt_lens.size)


# -- output lengths ----------------------------------------------------------------------------------------------

def _trace_outputs(trace: str | Path) -> tuple[np.ndarray, Path]:
    from batchgen.workload import load_trace, resolve_trace

    path = resolve_trace(trace)
    return load_trace(path)[1], path


def draw_output_lens(inp: EstimateInput, output: Mapping, seed: int) -> np.ndarray:
    """One output length per request: drawn from `output` (see the module docstring), clipped at the request's
    max_tokens; exactly max_tokens where ignore_eos is set. Same seed, same lengths."""
    if not isinstance(output, Mapping):
        raise ValueError(f"the output-length config must be a mapping, got {output!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    n = len(inp)
    rng = np.random.default_rng(seed)
    cfg = dict(output)
    if "trace" in cfg:
        if set(cfg) != {"trace"}:
            raise ValueError(f"an output-length trace takes no other key, got {sorted(set(cfg) - {'trace'})}")
        outs, _ = _trace_outputs(cfg["trace"])
        drawn = rng.choice(outs, size=n) if n else np.empty(0, np.int64)
    elif cfg.get("kind") == "max_tokens":
        if set(cfg) != {"kind"}:
            raise ValueError(f"output kind max_tokens takes no other key, got {sorted(set(cfg) - {'kind'})}")
        drawn = inp.max_tokens
    else:
        from batchgen.workload import make_distribution

        try:
            dist = make_distribution(cfg)
        except ValueError as e:
            raise ValueError(f"output lengths: {e} (or give {{trace: <file>}} or {{kind: max_tokens}})") from None
        drawn = dist.sample(n, rng)
    lens = np.minimum(np.asarray(drawn, dtype=np.int64), inp.max_tokens)
    return np.where(inp.ignore_eos, inp.max_tokens, np.maximum(lens, 1)).astype(np.int64)


def describe_output(output: Mapping) -> str:
    """The output-length assumption in words."""
    cfg = dict(output)
    if "trace" in cfg:
        try:
            outs, path = _trace_outputs(cfg["trace"])
            stats = (f" (median {np.median(outs):.0f}, P99 {np.percentile(outs, 99):.0f}, max {outs.max()} tokens, "
                     f"{outs.size:,} requests)")
        except (OSError, ValueError):
            path, stats = Path(str(cfg["trace"])), ""
        what = ("the Azure LLM conversation trace (2023)" if path.name == "azure_conv_2023.csv"
                else "the Azure LLM code trace (2023)" if path.name == "azure_code_2023.csv" else f"trace {path.name}")
        return f"resampled from the output lengths of {what}{stats}"
    if cfg.get("kind") == "max_tokens":
        return "every request runs to its max_tokens (an upper bound)"
    params = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "kind")
    return f"drawn from a {cfg.get('kind')} distribution ({params})"


# -- the estimate ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EstimateRow:
    policy: str
    bct_s: float                 # predicted batch completion time (nan on error)
    tokens_per_s: float          # output tokens / BCT
    wall_s: float                # seconds this policy's simulation took
    error: str | None = None     # why the policy cannot run the job (memory, context): no figures then
    decode_expert_batch: float | None = None  # mean tokens per routed expert in decode iterations
    gpu_idle_frac: float | None = None        # share of GPU time neither computing nor communicating
    prefill_frac: float | None = None         # share of instance time in forwards that prefill
    mean_running: float | None = None         # running sequences per instance, time-weighted
    plan: str | None = None                   # what the static planner chose for "auto" knobs
    simulated_requests: int = 0               # requests actually simulated (one group's share, or all)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Share:
    """How the job was simulated: `groups` independent node groups, one of them run on `requests` requests."""

    groups: int
    requests: int
    gpus: int

    @property
    def approximate(self) -> bool:
        return self.groups > 1


def independent_groups(model: ModelSpec, cluster: ClusterSpec) -> tuple[int, int]:
    """(number of groups, GPUs per group): the smallest sets of whole nodes that hold whole instances.
    A dense model runs every GPU as its own instance (`batchgen.job.effective_cluster`)."""
    size = cluster.instance_size if model.is_moe else 1
    gpus = max(size, cluster.node_size)  # one divides the other (ClusterSpec checks it)
    return max(cluster.num_gpus // gpus, 1), gpus


def group_share(model: ModelSpec, cluster: ClusterSpec, n: int, group: int = 0
                ) -> tuple[ClusterSpec, np.ndarray, int]:
    """Group `group`'s sub-cluster and its requests under the round-robin split over instances (request i goes
    to instance i mod I; group j holds instances j*k .. j*k+k-1, so its requests, kept in input order, fall on the
    sub-cluster's k instances in the same round-robin order). Returns (sub-cluster, request indices, groups)."""
    groups, gpus = independent_groups(model, cluster)
    if groups == 1:
        return cluster, np.arange(n), 1
    if not 0 <= group < groups:
        raise ValueError(f"group must be in [0, {groups}), got {group}")
    size = cluster.instance_size if model.is_moe else 1
    instances, per_group = cluster.num_gpus // size, gpus // size
    sub = dataclasses.replace(cluster, num_gpus=gpus, name=f"{cluster.name} (1 of {groups} groups)")
    return sub, np.flatnonzero((np.arange(n) % instances) // per_group == group), groups


def straggler_group(model: ModelSpec, cluster: ClusterSpec, prompts: np.ndarray, outputs: np.ndarray) -> int:
    """The group that gets the longest request (prompt + output): in a long tail the slowest group is the one
    its largest straggler lands in, and the slowest group sets the completion time."""
    groups, gpus = independent_groups(model, cluster)
    size = cluster.instance_size if model.is_moe else 1
    longest = int(np.argmax(prompts + outputs))
    return (longest % (cluster.num_gpus // size)) // (gpus // size) if groups > 1 else 0


def _summary_row(policy_name: str, out, total_output_tokens: int, wall: float, simulated: int) -> EstimateRow:
    from batchgen.results.metrics import summarize

    s = summarize(out)
    plan = getattr(out.prepared, "plan", None)
    plan_text = None
    if plan is not None:
        p = out.prepared.policy
        knobs = [f"{k}={getattr(p, k)}" for k in ("b_attn", "b_moe", "kv_residency", "attention") if hasattr(p, k)]
        plan_text = "planned " + " ".join(knobs)
    bct = float(s["bct_s"])
    return EstimateRow(policy=policy_name, bct_s=bct,
                       tokens_per_s=total_output_tokens / bct if bct > 0 else math.nan, wall_s=wall,
                       decode_expert_batch=s.get("decode_expert_batch"), gpu_idle_frac=s.get("gpu_idle_frac"),
                       prefill_frac=s.get("prefill_frac"), mean_running=s.get("mean_running"), plan=plan_text,
                       simulated_requests=simulated)


def _run_one(model: ModelSpec, cluster: ClusterSpec, prompts: np.ndarray, outputs: np.ndarray,
             policy_cfg: Mapping, total_output_tokens: int, efficiency: Efficiency | dict, latency: LatencySettings,
             memory: MemorySettings, page_tokens: int, name: str, prefixes: tuple | None = None) -> EstimateRow:
    """One policy's simulation (run in-process or in a worker process). `efficiency` may come as its dict
    (`Efficiency.to_dict`): its read-only factor maps do not unpickle."""
    from batchgen.job import Job
    from batchgen.policy import make_policy
    from batchgen.sim.run import simulate
    from batchgen.workload import Workload

    start = time.perf_counter()
    policy_name = str(policy_cfg.get("name"))
    if not isinstance(efficiency, Efficiency):
        efficiency = Efficiency.from_dict(efficiency)
    try:
        job = Job(model=model, cluster=cluster, workload=Workload(name, prompts, outputs, *(prefixes or ())),
                  policy=make_policy(policy_cfg), memory=memory, efficiency=efficiency, latency=latency,
                  page_tokens=page_tokens)
        out = simulate(job)
    except ConfigError as e:
        return EstimateRow(policy_name, math.nan, math.nan, time.perf_counter() - start, error=str(e),
                           simulated_requests=int(prompts.size))
    return _summary_row(policy_name, out, total_output_tokens, time.perf_counter() - start, int(prompts.size))


def estimate(model: ModelSpec, cluster: ClusterSpec, inp: EstimateInput, policies: Sequence[Mapping], *,
             output: Mapping = DEFAULT_OUTPUT, seed: int = 0, efficiency: Efficiency | None = None,
             latency: LatencySettings | None = None, memory: MemorySettings | None = None,
             page_tokens: int = 64, progress: bool = False, share: bool | None = None,
             workers: int | None = None) -> list[EstimateRow]:
    """Simulate the job under every policy (config dicts as `batchgen.policy.make_policy` takes them) and return
    one row per policy, in the order given. A policy that cannot run the job (ConfigError: memory, context) gets
    a row with its error; a malformed policy config raises ValueError before anything runs.

    efficiency: None loads the fitted factors of the cluster's GPU when they ship (as `efficiency=auto` does);
    share: simulate one independent node group's share (True), the whole cluster (False), or decide by size
    (None: see the module docstring); workers: processes to run policies in (None: one per policy, at most
    one per core; 1 runs in this process). progress: one line on stderr per finished policy."""
    from batchgen.policy import make_policy

    if len(inp) == 0:
        raise ValueError("the input has no requests: nothing to estimate")
    policies = [plain(p) for p in policies]
    for p in policies:
        make_policy(p)  # a typo in a policy config fails here, before minutes of simulation
    if efficiency is None:
        efficiency = load_efficiency({"auto": True}, cluster.gpu.name)
    latency = latency if latency is not None else LatencySettings()
    memory = memory if memory is not None else MemorySettings()

    outputs = draw_output_lens(inp, output, seed)
    n = len(inp)
    groups, _ = independent_groups(model, cluster)
    use_share = (groups > 1 and n >= SHARE_MIN_REQUESTS) if share is None else bool(share)
    if use_share:
        sim_cluster, idx, groups = group_share(model, cluster, n,
                                               straggler_group(model, cluster, inp.prompt_lens, outputs))
    else:
        sim_cluster, idx, groups = cluster, np.arange(n), 1
    prompts, outs = inp.prompt_lens[idx], outputs[idx]
    total_tokens = int(outputs.sum())
    prefixes = None if inp.prefix_group is None else (inp.prefix_group[idx], inp.prefix_len[idx], inp.prefix_tree)
    args = dict(total_output_tokens=total_tokens, efficiency=efficiency, latency=latency, memory=memory,
                page_tokens=page_tokens, name="estimate", prefixes=prefixes)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(len(policies), cores) if workers is None else max(1, int(workers))
    rows: list[EstimateRow | None] = [None] * len(policies)
    start = time.perf_counter()
    if progress:
        what = f"{idx.size:,} of {n:,} requests (one of {groups} node groups)" if use_share else f"{n:,} requests"
        print(f"estimate: simulating {what} under {len(policies)} policies"
              + (f" in {min(workers, len(policies))} processes" if workers > 1 and len(policies) > 1 else ""),
              file=sys.stderr, flush=True)

    def note(row: EstimateRow) -> None:
        if progress:
            what = f"BCT {row.bct_s:,.0f} s" if row.ok else f"cannot run: {row.error}"
            print(f"estimate: {row.policy}: {what} ({row.wall_s:.1f} s to simulate, "
                  f"{time.perf_counter() - start:.1f} s so far)", file=sys.stderr, flush=True)

    if workers <= 1 or len(policies) <= 1:
        for i, p in enumerate(policies):
            rows[i] = _run_one(model, sim_cluster, prompts, outs, p, **args)
            note(rows[i])
    else:
        # spawn, not fork: the caller may hold threads (torch) that a forked child would inherit half-way
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            args["efficiency"] = efficiency.to_dict()
            futures = {pool.submit(_run_one, model, sim_cluster, prompts, outs, p, **args): i
                       for i, p in enumerate(policies)}
            for f in as_completed(futures):
                rows[futures[f]] = f.result()
                note(rows[futures[f]])
    return [r for r in rows if r is not None]


# -- the printout ------------------------------------------------------------------------------------------------

def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _duration(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def format_estimate(rows: Sequence[EstimateRow], inp: EstimateInput, output: Mapping, model: ModelSpec,
                    cluster: ClusterSpec) -> str:
    """A table of the predicted completion time per policy, and the assumptions it rests on."""
    n = len(inp)
    what = f"{n:,} requests" if inp.requests in (None, n) else f"{inp.requests:,} requests ({n:,} choices)"
    lines = [f"Estimated completion of {what} ({int(inp.prompt_lens.sum()):,} prompt tokens) of "
             f"{model.name} on {cluster.name} ({cluster.num_gpus} x {cluster.gpu.name}), simulated:", ""]
    ok = [r for r in rows if r.ok]
    best = min((r.bct_s for r in ok), default=math.nan)
    header = (f"{'policy':<12} {'BCT':>10} {'BCT s':>12} {'vs best':>8} {'out tok/s':>12} {'decode expert batch':>20} "
              f"{'GPU idle':>9} {'sim wall s':>11}")
    lines += [header, "-" * len(header)]
    for r in rows:
        if not r.ok:
            lines.append(f"{r.policy:<12} cannot run this job: {r.error}")
            continue
        bct = f"{r.bct_s:,.0f}" if r.bct_s >= 100 else f"{r.bct_s:.3g}"
        lines.append(f"{r.policy:<12} {_duration(r.bct_s):>10} {bct:>12} {r.bct_s / best:>7.2f}x "
                     f"{r.tokens_per_s:>12,.0f} {_fmt(r.decode_expert_batch, '.1f'):>20} "
                     f"{_fmt(None if r.gpu_idle_frac is None else 100 * r.gpu_idle_frac, '.0f') + '%':>9} "
                     f"{r.wall_s:>11.1f}")
    for r in rows:
        if r.ok and r.plan:
            lines.append(f"  {r.policy}: {r.plan}")
    ignore = int(inp.ignore_eos.sum())
    lines += ["", "Assumptions (the figures depend on them):"]
    if dict(output).get("kind") == "max_tokens":
        lines.append("- every request runs to its max_tokens: an upper bound, since requests that end at EOS "
                     "finish earlier")
    else:
        lines.append(f"- output lengths are unknown until EOS, so they were {describe_output(output)}, clipped at "
                     f"each request's max_tokens" + (f"; {ignore:,} request(s) with ignore_eos run to exactly "
                                                     "max_tokens" if ignore else "")
                     + ". Longer answers than assumed mean a later completion; "
                       "job.estimate_output={kind:max_tokens} gives the upper bound.")
    if inp.approximate_prompts:
        lines.append("- prompt lengths are approximate (no tokenizer was available: estimated from the text)")
    sims = {r.simulated_requests for r in rows}
    simulated = max(sims) if sims else n
    if simulated < n:
        groups, gpus = independent_groups(model, cluster)
        lines.append(f"- to be fast, one of the cluster's {groups} independent groups of {gpus} GPUs was simulated, "
                     f"running its round-robin share ({simulated:,} of {n:,} requests; the group that gets the "
                     "longest request): an approximation, since the other groups' shares are statistically equal "
                     "but not identical and coroutine's cross-instance migration cannot reach other groups here "
                     "(job.estimate_share=false simulates the whole cluster)")
    return "\n".join(lines)
