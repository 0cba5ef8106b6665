"""A small model directory to try batch jobs on a machine without a model hub: random weights, a real tokenizer.

`python -m batchgen.batch.demo [DIR]` (default outputs/demo-model) writes a Mixtral-format Hugging Face directory
(config.json, model.safetensors, tokenizer.json trained here on a few paragraphs, tokenizer_config.json with a ChatML
chat template) and an example requests file. The text it generates is gibberish (the weights are random), but every path
of a batch job runs on it exactly as on a real checkpoint: tokenization, chat templates, stop strings, EOS, the output
format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from batchgen.batch.chat import CHATML as CHAT_TEMPLATE
from batchgen.exec.models import ExecModelConfig, init_random

DEFAULT_DIR = "outputs/demo-model"  # under outputs/ (git-ignored), never the checkout's root
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|im_end|>"

_CORPUS = """\
Batch inference runs millions of prompts through a model, and the only goal is to finish the whole batch early.
A mixture of experts routes every token to a few of many feed-forward experts, so each expert sees a small batch
unless many sequences are combined. A coroutine can yield at a module boundary, wait on the host, and resume on
another device when its turn comes. The quick brown fox jumps over the lazy dog; pack my box with five dozen
liquor jugs. What is the capital of France? Paris is the capital of France. Two plus two is four, and seven
times six is forty-two. Write a short poem about the sea: the sea is grey, the waves are slow, the gulls are
crying as they go. Summarize the following text in one sentence. Translate into French: good morning, how are
you today? Once upon a time there was a small engine that could carry more than anyone believed.
"""


def demo_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on the corpus above: any text encodes (bytes are in the base vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return tok


def demo_config(vocab_size: int, eos_id: int, max_context: int = 2048) -> dict:
    """A tiny Mixtral: 4 experts, top-2, 2 layers; small enough to run a few hundred requests in seconds."""
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "_name_or_path": "batchgen-demo-moe",
            "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "num_local_experts": 4,
            "num_experts_per_tok": 2, "max_position_embeddings": max_context, "rope_theta": 1e6,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": eos_id, "torch_dtype": "float32"}


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Our parameters under the Hub's names (the fused expert layout the loader accepts)."""
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith(".mlp.w_up") or name.endswith(".mlp.w_down"):
            continue
        if name.endswith(".mlp.w_gate"):
            prefix = name.removesuffix(".w_gate")
            out[f"model.{prefix}.experts.gate_up_proj"] = torch.cat([p, model.state_dict()[prefix + ".w_up"]], dim=-2)
            out[f"model.{prefix}.experts.down_proj"] = model.state_dict()[prefix + ".w_down"]
        else:
            out[name if name == "lm_head.weight" else "model." + name] = p
    return {k: v.contiguous() for k, v in out.items()}


EXAMPLE_REQUESTS = [
    {"custom_id": "greeting", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "batchgen-demo-moe", "messages": [{"role": "user", "content": "Good morning, how are you?"}],
              "max_tokens": 16, "temperature": 0}},
    {"custom_id": "capital", "method": "POST", "url": "/v1/completions",
     "body": {"model": "batchgen-demo-moe", "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0.7, "seed": 1, "stop": ["."]}},
    {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
     "body": {"model": "batchgen-demo-moe", "prompt": [17, 42, 99, 7], "max_tokens": 4, "temperature": 0,
              "return_token_ids": True}},
]


def write_demo_model(path: str | Path, seed: int = 0, requests: bool = True) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = demo_tokenizer()
    eos_id = tok.token_to_id(EOS)
    config = demo_config(tok.get_vocab_size(), eos_id)
    model = init_random(ExecModelConfig.from_hf_config(config), seed=seed)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(checkpoint_tensors(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": EOS, "bos_token": None, "pad_token": "<|endoftext|>"},
        indent=2) + "\n")
    if requests:
        (path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EXAMPLE_REQUESTS))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=DEFAULT_DIR,
                        help=f"directory to write (created if missing; default {DEFAULT_DIR}, beside the runs' "
                             "outputs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    path = write_demo_model(args.dir, args.seed)
    print(f"wrote a demo model and {path / 'requests.jsonl'} to {path}")


if __name__ == "__main__":
    main()
