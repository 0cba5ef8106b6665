"""Build a `MoEDecoder` from a local Hugging Face directory (config.json + safetensors), or with random weights.

Checkpoint names are the Hub's. Two expert layouts are accepted, because both exist in the wild:

- per expert (what the Hub holds and what transformers 5.24's `save_pretrained` writes): Mixtral
  `block_sparse_moe.experts.{i}.w1/w3/w2.weight` (gate/up/down) and `block_sparse_moe.gate.weight`; Qwen3-MoE
  `mlp.experts.{i}.gate_proj/up_proj/down_proj.weight` and `mlp.gate.weight`; DeepSeek-V3 the same, plus
  `mlp.gate.e_score_correction_bias` and `mlp.shared_experts.gate_proj/up_proj/down_proj.weight`;
- fused (transformers 5's in-memory state dict, e.g. saved with `safetensors.torch.save_file`):
  `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, then up) and `mlp.experts.down_proj` [E, H, I],
  router `mlp.gate.weight` (Mixtral included: transformers 5 renames its `block_sparse_moe` to `mlp`).

DeepSeek-V3's attention is MLA (`self_attn.q_a_proj`/`q_a_layernorm`/`q_b_proj` or `q_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), its first `first_k_dense_replace` layers are dense
(`mlp.gate_proj/up_proj/down_proj`), and its multi-token-prediction layers (`model.layers.{n}.*` for n >=
num_hidden_layers, which transformers also skips) are ignored.

Every tensor in the files must map to a parameter and every parameter must be filled exactly once: a
checkpoint for another model fails loudly instead of running with some weights left uninitialised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.exec.models.config import ExecModelConfig, UnsupportedModelError
from batchgen.exec.models.decoder import MoEDecoder

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")
_PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                     "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}
_MOE_PREFIXES = {"mixtral": ("block_sparse_moe", "mlp"), "qwen3_moe": ("mlp",), "deepseek_v3": ("mlp",)}


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and, if any, the parameter."""


@dataclass(frozen=True)
class _Piece:
    param: str                   # name in MoEDecoder.state_dict()
    expert: int | None = None    # one expert's slice of a stacked [E, ...] parameter; None: the whole parameter
    split: int | None = None     # fused gate_up: start row (dim -2) of this piece in the file's tensor


@dataclass(frozen=True)
class _Source:
    shape: tuple[int, ...]       # the shape the file's tensor must have
    pieces: tuple[_Piece, ...]


def _sources(model: MoEDecoder) -> dict[str, _Source]:
    """Checkpoint tensor name -> where it goes, for every name this model accepts (both expert layouts)."""
    c, shapes = model.config, {n: tuple(p.shape) for n, p in model.state_dict().items()}
    table: dict[str, _Source] = {}

    def direct(ckpt: str, param: str) -> None:
        table[ckpt] = _Source(shapes[param], (_Piece(param),))

    direct("model.embed_tokens.weight", "embed_tokens.weight")
    direct("model.norm.weight", "norm.weight")
    if not c.tie_word_embeddings:
        direct("lm_head.weight", "lm_head.weight")
    for layer in range(c.num_layers):
        ours = f"layers.{layer}"
        for name in shapes:
            if name.startswith(ours + ".") and ".mlp." not in name:  # attention, q/k norms, layer norms
                direct("model." + name, name)
        if not c.is_moe_layer(layer):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                direct(f"model.{ours}.mlp.{proj}.weight", f"{ours}.mlp.{proj}.weight")
            continue
        E, I = c.num_experts, c.moe_intermediate_size
        w_gate, w_up, w_down = (f"{ours}.mlp.{p}" for p in EXPERT_PARAMS)
        for name in shapes:  # DeepSeek: the router's e_score_correction_bias and the shared experts
            if name.startswith(f"{ours}.mlp.") and name not in (w_gate, w_up, w_down, f"{ours}.mlp.gate.weight"):
                direct("model." + name, name)
        for prefix in _MOE_PREFIXES[c.architecture]:
            ckpt = f"model.{ours}.{prefix}"
            direct(f"{ckpt}.gate.weight", f"{ours}.mlp.gate.weight")
            for e in range(E):
                for name, param in zip(_PER_EXPERT_NAMES[c.architecture], (w_gate, w_up, w_down)):
                    table[f"{ckpt}.experts.{e}.{name}.weight"] = _Source(shapes[param][1:], (_Piece(param, e),))
            gate_shape = shapes[w_gate]
            table[f"{ckpt}.experts.gate_up_proj"] = _Source(
                (E, 2 * I, gate_shape[2]), (_Piece(w_gate, split=0), _Piece(w_up, split=I)))
            direct(f"{ckpt}.experts.down_proj", w_down)
    return table


def _canonical_name(param: str, expert: int | None, arch: str) -> str:
    """The Hub name of a parameter (or of one expert's slice), for 'missing parameter' messages."""
    if expert is None:
        if param.endswith(".mlp.gate.weight"):  # the router: Mixtral's Hub name is block_sparse_moe.gate
            param = param.replace(".mlp.", f".{_MOE_PREFIXES[arch][0]}.")
        return param if param == "lm_head.weight" else "model." + param
    layer_prefix, kind = param.rsplit(".mlp.", 1)
    name = _PER_EXPERT_NAMES[arch][EXPERT_PARAMS.index(kind)]
    return f"model.{layer_prefix}.{_MOE_PREFIXES[arch][0]}.experts.{expert}.{name}.weight"


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names shard {f.name}, which is not in {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no weights in {path}: expected model.safetensors or sharded *.safetensors files "
                             "(.bin/.pt checkpoints are not supported; convert them to safetensors)")
    return files


def read_config(path: str | Path) -> ExecModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path}: a Hugging Face model directory needs one")
    try:
        return ExecModelConfig.from_hf_config(json.loads(config_file.read_text()))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({e})") from e
    except KeyError as e:
        raise ModelLoadError(f"{config_file}: missing field {e}") from e
    except (UnsupportedModelError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{config_file}: {e}") from e


def checkpoint_name(path: str | Path) -> str:
    """What results call a model directory's model: config.json's own name for it, else the directory's."""
    path = Path(path)
    try:
        name = json.loads((path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        name = None
    return str(name) if name else path.resolve().name


def checkpoint_bytes(path: str | Path) -> float:
    """Bytes per weight the checkpoint holds (config.json's torch_dtype or dtype; bf16 when it does not say)."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        d = {}
    dtype = str(d.get("torch_dtype") or d.get("dtype") or "bfloat16")
    return {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(dtype, 1.0 if "float8" in dtype else 2.0)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> MoEDecoder:
    """Weights are cast to `dtype` on load; parameters are allocated on `device` once, never initialised."""
    from safetensors import safe_open

    path = Path(path)
    config = read_config(path)
    files = _weight_files(path)
    model = _empty_model(config, dtype, device)
    params = dict(model.named_parameters())
    table = _sources(model)
    filled: dict[tuple[str, int | None], str] = {}  # (param, expert or None) -> file that filled it
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    source = table.get(key)
                    if source is None:
                        if key == "lm_head.weight" and config.tie_word_embeddings:
                            continue  # a tied head saved anyway: it is the embedding
                        if _is_mtp_layer(key, config):
                            continue
                        raise ModelLoadError(f"{file}: unexpected parameter {key!r}, which a "
                                             f"{config.architecture} model with this config.json does not have")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != source.shape:
                        raise ModelLoadError(f"{file}: parameter {key!r} has shape {list(shape)}, expected "
                                             f"{list(source.shape)} from config.json")
                    _copy(f.get_tensor(key), source, params, filled, key, file)
    for name, p in params.items():
        experts = range(p.shape[0]) if name.rsplit(".", 1)[-1] in EXPERT_PARAMS else (None,)
        for e in experts:
            if (name, e) not in filled and (name, None) not in filled:
                raise ModelLoadError(f"parameter {_canonical_name(name, e, config.architecture)!r} is missing "
                                     f"from the weights in {path} ({', '.join(f.name for f in files)})")
    return model.eval().requires_grad_(False)


def _is_mtp_layer(key: str, config: ExecModelConfig) -> bool:
    """DeepSeek-V3's multi-token-prediction modules sit after the last decoder layer; generation ignores them."""
    parts = key.split(".")
    return (config.architecture == "deepseek_v3" and len(parts) > 2 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= config.num_layers)


def _copy(tensor: torch.Tensor, source: _Source, params: dict, filled: dict, key: str, file: Path) -> None:
    for piece in source.pieces:
        dest = params[piece.param]
        if piece.expert is not None:
            dest = dest[piece.expert]
        src = tensor if piece.split is None else tensor.narrow(-2, piece.split, dest.shape[-2])
        unit = (piece.param, piece.expert)
        whole = (piece.param, None)
        if unit in filled or whole in filled or (piece.expert is None and (piece.param, -1) in filled):
            raise ModelLoadError(f"{file}: parameter {key!r} fills {piece.param} a second time "
                                 f"(first from {filled.get(unit) or filled.get(whole) or filled[(piece.param, -1)]}): "
                                 "duplicate tensors or mixed expert layouts")
        dest.copy_(src)
        filled[unit] = filled[(piece.param, -1)] = str(file)  # -1: "some part of it", for the check above


def _empty_model(config: ExecModelConfig, dtype: torch.dtype, device: str | torch.device) -> MoEDecoder:
    """Allocated, not initialised: building on 'meta' skips nn.Linear's random init of every weight."""
    return MoEDecoder(config, device="meta", dtype=dtype).to_empty(device=device)


def init_random(config: ExecModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", std: float = 0.02) -> MoEDecoder:
    """Normal(0, std) weights, unit norms, zero biases, drawn on the CPU in fp32 from `seed` in parameter
    order, so the same seed gives the same model on any device and in any dtype (up to rounding)."""
    model = _empty_model(config, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from the directory's tokenizer.json."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(f"no tokenizer.json in {path}: the fast-tokenizer file is needed "
                             "(save it with a transformers tokenizer's save_pretrained)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type on malformed files
        raise ModelLoadError(f"{file}: cannot be read as a tokenizer ({e})") from e
