"""Executor throughput: coroutine with host-resident decode against batchgen's own `continuous` and `static`
(the clean ablation: same engine, same kernels, only the scheduling differs) and against transformers
`generate`; same weights, same prompts, same device KV budget, measured side by side in one run.

    python benchmarks/exec_throughput.py [--prompts 256] [--kv-mb 48] [--threads 1] [--device cpu|cuda] [--rounds 1]
        [--b-moe 256] [--b-attn 64] [--staging-mb 16] [--residency host|mixed|device] [--attention auto|gpu|cpu]

The KV budget is device memory for KV, the same for every engine: continuous and static page their running
sequences in it; coroutine keeps the KV of up to b_moe running sequences per rank in host memory and uses the
budget for its prefills. Its attention runs either beside the host KV on the CPU (`cpu`), or on the device
(`gpu`) over each layer's KV restored per micro-batch of at most b_attn sequences into two staging buffers,
which then take --staging-mb out of the budget. `auto`: cpu on a CPU device (where the staging copy is a
RAM-to-RAM memcpy that buys nothing), gpu on CUDA. On CPU `coroutine_staged` (attention gpu) also runs, to
show the restore path and its price.
transformers runs static batches in input order, each as large as its own padded KV (its longest prompt plus
its longest output, per row) fits the budget.

Throughput counts each request's own output tokens (static batches also compute padding, which is their
cost, not output). Beside each engine: the expert batch (tokens per expert per MoE call, decode only where
known), the mean running sequences, and the KV bytes restored from host. On CPU, glibc is told to keep freed
memory (mallopt) for every engine alike: otherwise every large activation is a fresh mmap whose page faults
cost as much as the copy itself on these VMs. The last line reads
`coroutine/hf_generate=<r> coroutine/continuous=<r> coroutine/static=<r>`. With `--rounds N` the engines run N times,
each round in another order (rotated), and each ratio is the median of the rounds' own ratios (one round's engines
ran minutes apart, so a shared machine's changes of speed move a single round's ratio by more than a tenth); the
last line then gives each median with the rounds' lowest and highest, `coroutine/continuous=<median> (<lo>-<hi>)`.

Recorded results (with the machine and the date): benchmarks/results/exec_throughput.md.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from batchgen.exec.run import ExecSettings, execute
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.results import summarize
from batchgen.setup import policy_config
from batchgen.specs import load_cluster, load_model
from batchgen.workload import build_workload

PAGE = 16


def keep_freed_memory() -> bool:
    """glibc: serve large allocations from the heap and never trim it (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-3, 32 * 2**20) and libc.mallopt(-1, 2**31 - 1))


def hf_model(spec, path: Path):
    """The same architecture in transformers, seeded, saved where our loader reads it."""
    import transformers
    cfg = transformers.MixtralConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.moe_intermediate_size, num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k, max_position_embeddings=spec.max_context, initializer_range=0.05,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def hf_batches(input_lens: np.ndarray, output_lens: np.ndarray, kv_tokens: int) -> list[tuple[int, int]]:
    """Static batches in input order, each as large as its own padded KV allows: rows x (longest prompt +
    longest output of the batch) <= kv_tokens. Returns (start, end) pairs."""
    out, lo = [], 0
    while lo < input_lens.size:
        hi = lo + 1
        while hi < input_lens.size and (hi + 1 - lo) * (input_lens[lo:hi + 1].max()
                                                        + output_lens[lo:hi + 1].max()) <= kv_tokens:
            hi += 1
        out.append((lo, hi))
        lo = hi
    return out


def hf_generate(model, prompts: list[np.ndarray], outputs: np.ndarray, batches) -> tuple[float, float]:
    """Left-padded static batches, each run until its longest request is done.
    Returns (seconds, mean tokens per routed expert per MoE call)."""
    rows = []
    spec_e, spec_k = model.config.num_local_experts, model.config.num_experts_per_tok

    def count(_module, args, _out):
        rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    hooks = [layer.mlp.register_forward_hook(count) if hasattr(layer, "mlp") else
             layer.block_sparse_moe.register_forward_hook(count) for layer in model.model.layers]
    start = time.perf_counter()
    with torch.inference_mode():
        for lo, hi in batches:
            group = prompts[lo:hi]
            width = max(len(p) for p in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(group):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            new = int(outputs[lo:hi].max())
            ids, mask = ids.to(model.device), mask.to(model.device)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for h in hooks:
        h.remove()
    calls = len(rows)
    return seconds, (sum(rows) / calls) * spec_k / spec_e if calls else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--kv-mb", type=float, default=48.0, help="device KV memory for every engine")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: every engine runs there")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--b-moe", type=int, default=256, help="coroutine: running sequences per rank")
    ap.add_argument("--b-attn", type=int, default=64, help="coroutine: attention micro-batch (and staging) size")
    ap.add_argument("--staging-mb", type=float, default=16.0,
                    help="coroutine with attention gpu: of --kv-mb, for the two staging buffers")
    ap.add_argument("--residency", default="host", choices=["host", "mixed", "device"])
    ap.add_argument("--attention", default="auto", choices=["auto", "gpu", "cpu"],
                    help="coroutine: host-resident attention on the device (staged) or beside the KV on the CPU")
    ap.add_argument("--engines", default=None,
                    help="comma-separated, of coroutine, coroutine_staged, continuous, static, hf_generate "
                         "(default: all; coroutine_staged on CPU only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines this many times, each round in a rotated order; ratios: the rounds' medians")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = keep_freed_memory() if args.device == "cpu" else False
    attention = args.attention if args.attention != "auto" else ("cpu" if args.device == "cpu" else "gpu")
    spec = load_model("small_moe")
    wcfg = OmegaConf.create({"name": "bench", "num_sequences": args.prompts,
                             "input": {"kind": "uniform", "low": 32, "high": 256},
                             "output": {"kind": "longtail", "mean": 64, "max": 256}})
    workload = build_workload(wcfg, seed=0)
    cluster = dataclasses.replace(load_cluster("h100_8"), num_gpus=1)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (4 if args.dtype == "float32" else 2)
    kv_tokens = int(args.kv_mb * 2**20 // kv_per_token)
    context = workload.input_lens + workload.output_lens
    print(f"small_moe ({spec.num_experts} experts, top-{spec.top_k}, {spec.num_layers} layers), {args.prompts} prompts "
          f"(inputs 32-256, long-tailed outputs of mean {workload.output_lens.mean():.0f}, max "
          f"{workload.output_lens.max()}), {args.device} {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"malloc tuned: {tuned}")
    print(f"KV budget {args.kv_mb:g} MB = {kv_tokens:,} tokens: about {kv_tokens / context.mean():.0f} sequences "
          f"at their mean final context ({context.mean():.0f} tokens); coroutine b_moe {args.b_moe}, b_attn "
          f"{args.b_attn}, kv_residency {args.residency}, attention {attention} (staged runs: "
          f"{args.staging_mb:g} MB of the budget for staging)", flush=True)
    engines = (args.engines.split(",") if args.engines else
               ["coroutine"] + (["coroutine_staged"] if args.device == "cpu" and attention == "cpu" else [])
               + ["continuous", "static", "hf_generate"])
    coroutine = dict(b_moe=args.b_moe, b_attn=args.b_attn, kv_residency=args.residency)
    policies = {
        "coroutine": policy_config("coroutine", spec, **coroutine, attention=attention),
        "coroutine_staged": policy_config("coroutine", spec, **coroutine, attention="gpu"),
        "continuous": policy_config("continuous", spec),
        "static": policy_config("static", spec),
    }
    unknown = sorted(set(engines) - set(policies) - {"hf_generate"})
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}: choose from {', '.join([*policies, 'hf_generate'])}")
    tokens = int(workload.output_lens.sum())
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(spec, Path(tmp)).to(device=args.device, dtype=getattr(torch, args.dtype))
        settings = ExecSettings(device=args.device, dtype=args.dtype, model_path=tmp, kv_budget_mb=args.kv_mb)
        bench = _Bench(args, policies, spec, cluster, workload, settings, hf, kv_tokens, tokens)
        for k in range(args.rounds):
            order = engines[k % len(engines):] + engines[:k % len(engines)]
            if args.rounds > 1:
                print(f"round {k + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            rounds.append({name: bench.run(name) for name in order})
    _ratios(rounds)


@dataclasses.dataclass
class _Bench:
    """What every engine's run shares: the same weights, prompts and KV budget."""

    args: argparse.Namespace
    policies: dict
    spec: object
    cluster: object
    workload: object
    settings: ExecSettings
    hf: object
    kv_tokens: int
    tokens: int
    prompts: list | None = None  # the executor's prompts, which transformers then runs

    def run(self, name: str) -> float:
        """One run of engine `name`, printed; returns its seconds."""
        if name == "hf_generate":
            return self._hf_generate()
        args, workload = self.args, self.workload
        staged = name.startswith("coroutine")
        mine = dataclasses.replace(self.settings, staging_mb=args.staging_mb) if staged else self.settings
        out = execute(Job(self.spec, self.cluster, workload, make_policy(self.policies[name]), page_tokens=PAGE), mine)
        s = summarize(out)
        self.prompts = out.tokens.prompts
        traffic = out.kv_traffic or {}
        pool = int(out.prepared.state.gpu_pages[0]) * PAGE
        decode_batch = s.get("decode_expert_batch")
        decode_batch = "n/a" if decode_batch is None else f"{decode_batch:.1f}"
        print(f"{name:16s} {s['bct_s']:7.1f} s  {self.tokens / s['bct_s']:7.1f} tok/s  expert batch "
              f"{s['mean_expert_batch']:5.1f} tokens/expert (decode {decode_batch})"
              f"  running {s.get('mean_running', float('nan')):5.1f} (peak {traffic.get('peak_rank_running', 0)})"
              f"  KV pool {pool:,} tokens  restored {traffic.get('restored_bytes', 0) / 1e9:.2f} GB"
              f"  host-resident steps {traffic.get('host_resident_seq_steps', 0):,}"
              f"/{traffic.get('seq_steps', 0):,}"
              f"  prefill {s['prefill_s']:.1f} s  yields {s['yields']} recomputes {s['recomputes']}", flush=True)
        return s["bct_s"]

    def _hf_generate(self) -> float:
        """transformers on the executor's prompts (the same ones drawn where no executor ran before it)."""
        workload = self.workload
        if self.prompts is None:
            from batchgen.exec.sequences import random_prompts
            self.prompts = random_prompts(workload.input_lens, self.spec.vocab_size,
                                          seed=self.settings.weights_seed + 1)
        batches = hf_batches(workload.input_lens, workload.output_lens, self.kv_tokens)
        sizes = [hi - lo for lo, hi in batches]
        secs, hf_batch = hf_generate(self.hf, self.prompts, workload.output_lens, batches)
        print(f"{'hf_generate':16s} {secs:7.1f} s  {self.tokens / secs:7.1f} tok/s  expert batch {hf_batch:5.1f} "
              f"tokens/expert  ({len(batches)} static batches of {min(sizes)}-{max(sizes)}, mean "
              f"{np.mean(sizes):.1f}, each padded to its own longest)", flush=True)
        return secs


def _ratios(rounds: list[dict[str, float]]) -> None:
    """The last line: each engine's seconds over coroutine's, the median of the rounds' own ratios (with their
    range where there are several rounds)."""
    parts = []
    for k in ("hf_generate", "continuous", "static"):
        ratios = [r[k] / r["coroutine"] for r in rounds if k in r and r.get("coroutine")]
        if not ratios:
            continue
        text = f"coroutine/{k}={float(np.median(ratios)):.2f}"
        parts.append(text + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""))
    if parts:
        print(" ".join(parts))


if __name__ == "__main__":
    main()
