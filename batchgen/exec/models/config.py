"""The executor's model configuration: exactly the numbers the PyTorch modules need, from a Hugging Face
`config.json` or from a batchgen `ModelSpec`.

The executor reads `config.json` itself (no transformers at run time), so the few key spellings that differ
between families and between transformers versions (`rope_theta` vs `rope_parameters`, `num_experts` vs
`num_local_experts`, a null `head_dim`) are resolved here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

MOE_MODEL_TYPES = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}
# Dense Llama-style decoders run as architecture "dense": the same modules with a SwiGLU MLP in every layer.
# SmolLM2 is a Llama; upcycling it into an MoE is how real weights are tested.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = tuple(MOE_MODEL_TYPES) + DENSE_MODEL_TYPES
ARCHITECTURES = ("mixtral", "qwen3_moe", "dense")  # "deepseek_v3" (MLA, shared experts) comes later


class UnsupportedModelError(ValueError):
    """A config this executor cannot run faithfully: better refused than silently wrong."""


@dataclass(frozen=True)
class ExecModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0          # dense SwiGLU MLP (dense layers only)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True         # Mixtral always renormalises the top-k weights; Qwen3-MoE only if set
    decoder_sparse_step: int = 1        # Qwen3-MoE: layer l is MoE iff (l + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and l is not listed here
    qk_norm: bool = False               # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    qkv_bias: bool = False              # Qwen2: bias on q/k/v; Llama/Qwen3 `attention_bias`: on q/k/v/o
    o_bias: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    sliding_window: int | None = None   # Mistral-style: a query at p sees keys at positions > p - window
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {self.architecture!r} is not supported; "
                                        f"supported: {', '.join(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("moe_intermediate_size must be positive for an MoE model")
        if self.num_dense_layers and self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive: the model has {self.num_dense_layers} "
                             "dense layer(s)")

    # ---- structure ----

    def is_moe_layer(self, layer: int) -> bool:
        """The Qwen3-MoE rule, which also covers Mixtral (step 1, no dense layers) and dense models."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_dense_layers(self) -> int:
        return sum(not self.is_moe_layer(layer) for layer in range(self.num_layers))

    # ---- constructors ----

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "ExecModelConfig":
        """From a parsed Hugging Face config.json. Raises UnsupportedModelError for what it cannot run."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported model types: "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        common: dict[str, Any] = dict(
            vocab_size=int(d["vocab_size"]), hidden_size=hidden, num_layers=int(d["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads), rope_theta=_rope_theta(d),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            sliding_window=_sliding_window(d), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )
        if d.get("mlp_bias"):
            raise UnsupportedModelError(f"mlp_bias=true ({model_type}) is not supported")
        attention_bias = bool(d.get("attention_bias", False))
        common.update(qkv_bias=attention_bias or model_type == "qwen2", o_bias=attention_bias)
        if model_type == "mixtral":
            size = int(d["intermediate_size"])
            return cls(architecture="mixtral", intermediate_size=size, moe_intermediate_size=size,
                       num_experts=int(d["num_local_experts"]), top_k=int(d["num_experts_per_tok"]),
                       norm_topk_prob=True, **common)
        if model_type == "qwen3_moe":
            return cls(architecture="qwen3_moe", intermediate_size=int(d["intermediate_size"]),
                       moe_intermediate_size=int(d["moe_intermediate_size"]),
                       num_experts=int(d.get("num_experts") or d["num_local_experts"]),
                       top_k=int(d["num_experts_per_tok"]), norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                       decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                       mlp_only_layers=tuple(int(x) for x in d.get("mlp_only_layers") or ()), qk_norm=True,
                       **common)
        return cls(architecture="dense", intermediate_size=int(d["intermediate_size"]),
                   qk_norm=model_type == "qwen3", **common)

    @classmethod
    def from_spec(cls, spec: Any, rope_theta: float = 1e6, rms_norm_eps: float = 1e-5) -> "ExecModelConfig":
        """A Mixtral-style model from a batchgen `ModelSpec` (random weights: tests, benchmarks).

        The spec holds no RoPE/norm constants; the defaults are Mixtral's (transformers' MixtralConfig), so a
        spec turned into a MixtralConfig gives the same model. `first_dense_layers` become dense layers.
        """
        if spec.attention != "gqa":
            raise UnsupportedModelError(f"model {spec.name!r}: attention {spec.attention!r} is not supported yet "
                                        "(GQA only; MLA comes with the DeepSeek-V3 model)")
        if spec.num_shared_experts:
            raise UnsupportedModelError(f"model {spec.name!r}: shared experts are not supported yet")
        moe = spec.num_experts > 0
        return cls(architecture="mixtral" if moe else "dense", vocab_size=spec.vocab_size,
                   hidden_size=spec.hidden_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   intermediate_size=spec.intermediate_size, num_experts=spec.num_experts, top_k=spec.top_k,
                   moe_intermediate_size=spec.moe_intermediate_size,
                   mlp_only_layers=tuple(range(spec.first_dense_layers)) if moe else (),
                   rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, max_position_embeddings=spec.max_context,
                   tie_word_embeddings=spec.tie_embeddings)


def _rope_theta(d: Mapping[str, Any]) -> float:
    """transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`. Only plain RoPE
    is implemented: a scaled variant would give wrong logits, so it is refused."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"rope type {rope_type!r} ({d.get('model_type')}) is not supported; "
                                    "only default RoPE")
    return float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)


def _sliding_window(d: Mapping[str, Any]) -> int | None:
    if d.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen's window is off unless use_sliding_window, and then applies per layer: not implemented.
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(f"use_sliding_window=true ({d.get('model_type')}) is not supported")
        return None
    window = d.get("sliding_window")
    return int(window) if window else None
