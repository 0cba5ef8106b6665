"""Executor throughput on CPU: coroutine and continuous on our engine against transformers `generate` with
static batches, same weights, same prompts, same KV memory budget, measured side by side in one run.

    python benchmarks/exec_throughput.py [--prompts 256] [--kv-mb 24] [--threads 2] [--device cpu|cuda]

Throughput counts each request's own output tokens (static batches also compute padding, which is their
cost, not output). The last line reads `coroutine/hf_generate=<ratio> coroutine/continuous=<ratio>`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from batchgen.confdir import conf_dir
from batchgen.exec.run import ExecSettings, execute
from batchgen.job import Job
from batchgen.policy import make_policy
from batchgen.results import summarize
from batchgen.specs import load_cluster, load_model
from batchgen.workload import build_workload


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


def hf_generate(model, prompts: list[np.ndarray], outputs: np.ndarray, batch: int) -> tuple[float, float]:
    """Static batches in input order, left-padded, each run until its longest request is done.
    Returns (seconds, mean tokens per routed expert per MoE call)."""
    rows, calls = [], []
    spec_e, spec_k = model.config.num_local_experts, model.config.num_experts_per_tok

    def count(_module, args, _out):
        rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    hooks = [layer.mlp.register_forward_hook(count) if hasattr(layer, "mlp") else
             layer.block_sparse_moe.register_forward_hook(count) for layer in model.model.layers]
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(prompts), batch):
            group = prompts[lo:lo + batch]
            width = max(len(p) for p in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(group):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            new = int(outputs[lo:lo + batch].max())
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
    ap.add_argument("--kv-mb", type=float, default=24.0, help="KV cache budget for every engine")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: every engine runs there")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = load_model("small_moe")
    wcfg = OmegaConf.create({"name": "bench", "num_sequences": args.prompts,
                             "input": {"kind": "uniform", "low": 32, "high": 256},
                             "output": {"kind": "longtail", "mean": 64, "max": 256}})
    workload = build_workload(wcfg, seed=0)
    cluster = load_cluster("h100_8")
    import dataclasses
    cluster = dataclasses.replace(cluster, num_gpus=1)
    page = 16
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (4 if args.dtype == "float32" else 2)
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(spec, Path(tmp)).to(device=args.device, dtype=getattr(torch, args.dtype))
        settings = ExecSettings(device=args.device, dtype=args.dtype, model_path=tmp, kv_budget_mb=args.kv_mb)
        results = {}
        for name in ("coroutine", "continuous"):
            policy = make_policy(OmegaConf.to_container(OmegaConf.load(conf_dir() / "policy" / f"{name}.yaml")))
            out = execute(Job(spec, cluster, workload, policy, page_tokens=page), settings)
            s = summarize(out)
            results[name] = (s["bct_s"], s["mean_expert_batch"])
            prompts = out.tokens.prompts
            print(f"{name:11s} {s['bct_s']:7.1f} s  {s['output_tokens'] / s['bct_s']:8.1f} tok/s  "
                  f"expert batch {s['mean_expert_batch']:.1f} tokens/expert  yields {s['yields']} "
                  f"recomputes {s['recomputes']}", flush=True)
        # the largest static batch whose padded KV fits the same budget
        longest = int((workload.input_lens + workload.output_lens).max())
        batch = max(1, int(args.kv_mb * 2**20 // (longest * kv_per_token)))
        seconds, hf_batch = hf_generate(hf, prompts, workload.output_lens, batch)
        results["hf_generate"] = (seconds, hf_batch)
        tokens = int(workload.output_lens.sum())
        print(f"{'hf_generate':11s} {seconds:7.1f} s  {tokens / seconds:8.1f} tok/s  expert batch {hf_batch:.1f} "
              f"tokens/expert  (static batches of {batch})")
    co = results["coroutine"][0]
    print(f"coroutine/hf_generate={results['hf_generate'][0] / co:.2f} "
          f"coroutine/continuous={results['continuous'][0] / co:.2f}")


if __name__ == "__main__":
    main()
