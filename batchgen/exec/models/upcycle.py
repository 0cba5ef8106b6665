"""Real weights for tests: turn a dense Llama-style checkpoint into a Mixtral-style MoE that computes the same
function ("upcycling"), and export a GGUF file as a plain Hugging Face directory.

`upcycle_dense_dir` copies the dense MLP into every expert (w1 = gate_proj, w3 = up_proj, w2 = down_proj) and
draws a random router. Every expert is then the same function and Mixtral renormalises its top-k weights to
sum to 1, so the MoE layer equals the dense MLP up to float rounding, whichever experts the router picks: an
exact oracle with real weights, in which the routing (and so the expert dispatch) is still nontrivial.

`export_gguf_to_hf` needs transformers, gguf and accelerate (the gguf extra; imported inside the function).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from batchgen.exec.models.loading import ModelLoadError, _weight_files

# Dense families whose layers are exactly a Mixtral layer with one expert: no attention/MLP bias, no q/k norm.
UPCYCLE_MODEL_TYPES = ("llama", "mistral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")
# Dense config keys carried over unchanged (dims, RoPE, norm eps, embedding tie, special tokens).
_KEPT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "rope_theta", "rope_parameters", "rope_scaling", "sliding_window", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "dtype",
              "torch_dtype")
_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def upcycled_config(dense: dict, num_experts: int, top_k: int) -> dict:
    """The Mixtral config.json for a dense Llama-style config.json."""
    model_type = dense.get("model_type")
    if model_type not in UPCYCLE_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} cannot be upcycled into Mixtral exactly; "
                         f"supported: {', '.join(UPCYCLE_MODEL_TYPES)}")
    for flag in ("attention_bias", "mlp_bias"):
        if dense.get(flag):
            raise ValueError(f"{flag}=true: Mixtral has no biases, so the upcycled model would differ")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
    config = {k: dense[k] for k in _KEPT_KEYS if k in dense}
    config.setdefault("sliding_window", None)  # Mixtral's own default is 4096 in some versions: be explicit
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=num_experts,
                  num_experts_per_tok=top_k, output_router_logits=False, router_aux_loss_coef=0.0,
                  router_jitter_noise=0.0)
    return config


def upcycle_dense_dir(src_dir: str | Path, dst_dir: str | Path, num_experts: int = 4, top_k: int = 2,
                      seed: int = 0) -> Path:
    """Write a Mixtral-style directory to `dst_dir` (created) from the dense Hugging Face directory `src_dir`.

    Weights keep their dtype. The router `block_sparse_moe.gate.weight` [num_experts, hidden] is Normal(0,
    1/sqrt(hidden)) from `seed`, drawn in float32 layer by layer. The weights go to one `model.safetensors`,
    written straight from the dense files' memory maps: the E expert copies are never materialised.
    """
    from safetensors import safe_open

    src, dst = Path(src_dir), Path(dst_dir)
    config_file = src / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {src}: a Hugging Face model directory needs one")
    dense = json.loads(config_file.read_text())
    config = upcycled_config(dense, num_experts, top_k)
    hidden, num_layers = int(dense["hidden_size"]), int(dense["num_hidden_layers"])
    files = _weight_files(src)
    gen = torch.Generator().manual_seed(seed)

    tensors: dict[str, torch.Tensor] = {}  # output name -> tensor (expert copies share the dense tensor)
    mlp: dict[tuple[int, str], torch.Tensor] = {}
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    for handle in handles:
        for key in handle.keys():
            parts = key.split(".")
            if (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "mlp"
                    and parts[4] in _MLP and parts[5] == "weight"):
                mlp[(int(parts[2]), parts[4])] = handle.get_tensor(key)
            else:
                tensors[key] = handle.get_tensor(key)
    extra = sorted(layer for layer, _ in mlp if layer >= num_layers)
    if extra:
        raise ModelLoadError(f"{src}: MLP weights for layer {extra[0]} but config.json has {num_layers} layers")
    for layer in range(num_layers):  # in layer order: the router draws do not depend on the files' order
        prefix = f"model.layers.{layer}.block_sparse_moe"
        for proj, name in _MLP.items():
            weight = mlp.get((layer, proj))
            if weight is None:
                raise ModelLoadError(f"{src}: no model.layers.{layer}.mlp.{proj}.weight "
                                     "(not a dense Llama-style checkpoint?)")
            for e in range(num_experts):
                tensors[f"{prefix}.experts.{e}.{name}.weight"] = weight
        router = torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5
        tensors[f"{prefix}.gate.weight"] = router.to(mlp[(layer, "gate_proj")].dtype)

    dst.mkdir(parents=True, exist_ok=True)
    _write_safetensors(dst / "model.safetensors", tensors)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format (8-byte little-endian header length, JSON header, raw little-endian data),
    written tensor by tensor, so tensors may share storage (`safetensors.torch.save_file` refuses that)."""
    from safetensors.torch import _TYPES

    names = {dtype: name for name, dtype in _TYPES.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))


def export_gguf_to_hf(gguf_path: str | Path, dst_dir: str | Path) -> Path:
    """Load a GGUF file with transformers (offline; it dequantises to float32) and save model and tokenizer to
    `dst_dir` as a Hugging Face directory with safetensors weights. Needs transformers, gguf and accelerate."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModuleNotFoundError(f"export_gguf_to_hf needs transformers, gguf and accelerate ({e}): pip install "
                                  '"batchgen[gguf]"') from None

    gguf_path, dst = Path(gguf_path), Path(dst_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    kw = dict(gguf_file=gguf_path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    # The weights are plain dense tensors now, but the model still carries the GGUF quantizer, which refuses to
    # serialise: check that nothing stayed packed (newer transformers keep GGUF blocks when a matmul kernel is
    # installed), then drop it.
    quantizer = getattr(model, "hf_quantizer", None)
    packed = list(getattr(quantizer, "packed_modules", None) or ())
    if packed or any(not p.dtype.is_floating_point for p in model.parameters()):
        raise RuntimeError(f"{gguf_path}: transformers kept quantized weights (e.g. {packed[:1]}); "
                           "cannot export a dense float checkpoint")
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))
    return dst
