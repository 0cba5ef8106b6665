"""The executor's model configuration: exactly the numbers the PyTorch modules need, from a Hugging Face
`config.json` or from a batchgen `ModelSpec`.

The executor reads `config.json` itself (no transformers at run time), so the few key spellings that differ
between families and between transformers versions (`rope_theta` vs `rope_parameters`, `num_experts` vs
`num_local_experts`, a null `head_dim`) are resolved here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

MOE_MODEL_TYPES = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3"}
# Dense Llama-style decoders run as architecture "dense": the same modules with a SwiGLU MLP in every layer.
# SmolLM2 is a Llama; upcycling it into an MoE is how real weights are tested.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = tuple(MOE_MODEL_TYPES) + DENSE_MODEL_TYPES
ARCHITECTURES = ("mixtral", "qwen3_moe", "dense", "deepseek_v3")
# DeepSeek-V3's routing constants, for specs (which do not carry them): 8 groups, 4 kept, weights x 2.5.
DEEPSEEK_V3_ROUTING = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5)


class KVCacheGeometry(NamedTuple):
    """What one token's KV is, per layer: `num_kv_heads` heads of `head_dim` in the K pool and of `v_head_dim`
    in the V pool (0: no V pool). Field names are `PagedKVCache`'s, so a runner builds the cache of any
    architecture as `PagedKVCache.from_budget(**geometry._asdict(), page_size=..., budget_bytes=...)`.

    GQA: (layers, kv_heads, head_dim, head_dim). MLA: one latent "head" [c_kv | k_pe] of kv_lora_rank +
    qk_rope_head_dim and no V pool: the values are re-derived from c_kv by kv_b_proj."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def bytes_per_token(self, element_size: int) -> int:
        """All layers, K and V pools together."""
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * element_size


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
    # ---- DeepSeek-V3 (architecture "deepseek_v3"): MLA attention and group-limited sigmoid routing. There
    # `head_dim` is qk_rope_head_dim (the rotary width, as in transformers), the first_k_dense_replace dense
    # layers are `mlp_only_layers`, and num_kv_heads == num_heads (unused: the KV cache holds one latent).
    q_lora_rank: int = 0                # 0: a plain q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 0               # width of the compressed latent c_kv
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0           # one SwiGLU of moe_intermediate_size * n_shared_experts on every token
    n_group: int = 1                    # experts in n_group groups; a token's experts come from its
    topk_group: int = 1                 # topk_group best groups (group score: sum of its 2 best scores)
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = False       # DeepSeek: rotary dims in interleaved pairs (de-interleaved by RoPE)
    # yarn RoPE parameters as sorted (key, value) pairs (hashable); () for plain RoPE. DeepSeek-V3 only.
    rope_scaling: tuple[tuple[str, Any], ...] = ()

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
        if self.is_mla:
            self._check_deepseek()

    def _check_deepseek(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive for MLA attention, got {getattr(self, name)}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"deepseek_v3: head_dim ({self.head_dim}) must equal qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}), the rotary width")
        if self.num_experts:
            E, G = self.num_experts, self.n_group
            if G < 1 or E % G or E // G < 2:
                raise ValueError(f"n_group ({G}) must divide num_experts ({E}) into groups of at least 2 experts "
                                 "(a group's score is the sum of its two best experts)")
            if not 1 <= self.topk_group <= G or self.topk_group * (E // G) < self.top_k:
                raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({G}) and its groups must "
                                 f"hold at least top_k ({self.top_k}) experts")
        if self.rope_scaling and dict(self.rope_scaling).get("rope_type") != "yarn":
            raise UnsupportedModelError(f"rope scaling {dict(self.rope_scaling)} is not supported; only yarn")

    # ---- structure ----

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3): the KV cache holds a compressed latent per token."""
        return self.architecture == "deepseek_v3"

    def kv_cache_geometry(self) -> KVCacheGeometry:
        """The paged KV cache this model needs; see `KVCacheGeometry`."""
        if self.is_mla:
            return KVCacheGeometry(self.num_layers, 1, self.kv_lora_rank + self.qk_rope_head_dim, 0)
        return KVCacheGeometry(self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim)

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
        if model_type == "deepseek_v3":
            return cls._from_deepseek_v3(d)
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
    def _from_deepseek_v3(cls, d: Mapping[str, Any]) -> "ExecModelConfig":
        """transformers' DeepseekV3Config keys (5.x: `rope_parameters`; older: `rope_theta` + `rope_scaling`)."""
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d.get('hidden_act')!r} is not supported (SwiGLU with silu only)")
        if d.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=true (deepseek_v3) is not supported")
        if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedModelError(f"deepseek_v3 routing topk_method={d.get('topk_method')!r} "
                                        f"scoring_func={d.get('scoring_func')!r} is not supported "
                                        "(noaux_tc with sigmoid scores only)")
        heads, rope_dim = int(d["num_attention_heads"]), int(d["qk_rope_head_dim"])
        theta, scaling = _deepseek_rope(d)
        eos = d.get("eos_token_id")
        return cls(
            architecture="deepseek_v3", vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads, head_dim=rope_dim,
            intermediate_size=int(d["intermediate_size"]), num_experts=int(d["n_routed_experts"]),
            top_k=int(d["num_experts_per_tok"]), moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            mlp_only_layers=tuple(range(int(d.get("first_k_dense_replace") or 0))),
            rope_theta=theta, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=rope_dim,
            v_head_dim=int(d["v_head_dim"]), n_shared_experts=int(d.get("n_shared_experts") or 0),
            n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            rope_interleave=bool(d.get("rope_interleave", True)), rope_scaling=scaling)

    @classmethod
    def from_spec(cls, spec: Any, rope_theta: float | None = None,
                  rms_norm_eps: float | None = None) -> "ExecModelConfig":
        """A Mixtral-style model (GQA spec) or a DeepSeek-V3-style one (MLA spec) from a batchgen `ModelSpec`
        (random weights: tests, benchmarks).

        The spec holds no RoPE/norm constants; the defaults are those of transformers' MixtralConfig (theta
        1e6, eps 1e-5) or DeepseekV3Config (theta 1e4, eps 1e-6), so a spec turned into that config gives the
        same model. `first_dense_layers` become dense layers. An MLA spec gets DeepSeek-V3's routing
        (`DEEPSEEK_V3_ROUTING`: 8 groups, 4 kept, x2.5) when its experts split into 8 groups of at least 2,
        else one group (plain top-k over sigmoid scores); yarn RoPE is not set (specs do not carry it).
        """
        if spec.attention == "mla":
            return cls._from_mla_spec(spec, 1e4 if rope_theta is None else rope_theta,
                                      1e-6 if rms_norm_eps is None else rms_norm_eps)
        rope_theta = 1e6 if rope_theta is None else rope_theta
        rms_norm_eps = 1e-5 if rms_norm_eps is None else rms_norm_eps
        if spec.attention != "gqa":
            raise UnsupportedModelError(f"model {spec.name!r}: attention {spec.attention!r} is not supported "
                                        "(GQA or MLA)")
        if spec.num_shared_experts:
            raise UnsupportedModelError(f"model {spec.name!r}: shared experts with GQA attention are not "
                                        "supported (only DeepSeek-V3-style MLA models have them here)")
        moe = spec.num_experts > 0
        return cls(architecture="mixtral" if moe else "dense", vocab_size=spec.vocab_size,
                   hidden_size=spec.hidden_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   intermediate_size=spec.intermediate_size, num_experts=spec.num_experts, top_k=spec.top_k,
                   moe_intermediate_size=spec.moe_intermediate_size,
                   mlp_only_layers=tuple(range(spec.first_dense_layers)) if moe else (),
                   rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, max_position_embeddings=spec.max_context,
                   tie_word_embeddings=spec.tie_embeddings)

    def to_spec(self, name: str, element_bytes: float) -> Any:
        """The batchgen `ModelSpec` of this model, for the planner, the memory checks and the results' labels.
        Qwen3-MoE's dense layers may sit anywhere; the spec counts them as the first ones (the same sizes)."""
        from batchgen.specs import ModelSpec

        mla = self.is_mla
        return ModelSpec(
            name=name, num_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
            max_context=self.max_position_embeddings, attention="mla" if mla else "gqa", num_heads=self.num_heads,
            num_kv_heads=self.num_heads if mla else self.num_kv_heads, head_dim=0 if mla else self.head_dim,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            intermediate_size=self.intermediate_size, num_experts=self.num_experts,
            num_shared_experts=self.n_shared_experts, top_k=self.top_k,
            moe_intermediate_size=self.moe_intermediate_size,
            first_dense_layers=self.num_dense_layers if self.num_experts else 0,
            tie_embeddings=self.tie_word_embeddings, weight_bytes=float(element_bytes),
            kv_bytes=float(element_bytes), act_bytes=float(element_bytes))

    @classmethod
    def _from_mla_spec(cls, spec: Any, rope_theta: float, rms_norm_eps: float) -> "ExecModelConfig":
        moe = spec.num_experts > 0
        routing = _mla_routing(spec.num_experts, spec.top_k) if moe else {}
        return cls(architecture="deepseek_v3", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                   num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_heads,
                   head_dim=spec.qk_rope_head_dim, intermediate_size=spec.intermediate_size,
                   num_experts=spec.num_experts, top_k=spec.top_k, moe_intermediate_size=spec.moe_intermediate_size,
                   norm_topk_prob=True, mlp_only_layers=tuple(range(spec.first_dense_layers)) if moe else (),
                   rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, max_position_embeddings=spec.max_context,
                   tie_word_embeddings=spec.tie_embeddings, q_lora_rank=spec.q_lora_rank,
                   kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
                   qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
                   n_shared_experts=spec.num_shared_experts, rope_interleave=True, **routing)


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


def _mla_routing(num_experts: int, top_k: int) -> dict[str, Any]:
    g, kept = DEEPSEEK_V3_ROUTING["n_group"], DEEPSEEK_V3_ROUTING["topk_group"]
    if num_experts % g == 0 and num_experts // g >= 2 and kept * (num_experts // g) >= top_k:
        return dict(DEEPSEEK_V3_ROUTING)
    return dict(n_group=1, topk_group=1, routed_scaling_factor=DEEPSEEK_V3_ROUTING["routed_scaling_factor"])


def _deepseek_rope(d: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(theta, yarn parameters) of a DeepSeek-V3 config.json; plain RoPE gives ()."""
    params = dict(d.get("rope_parameters") or {})
    params.update(d.get("rope_scaling") or {})  # older configs: rope_theta + rope_scaling {"type": "yarn", ...}
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return theta, ()
    if rope_type != "yarn":
        raise UnsupportedModelError(f"rope type {rope_type!r} (deepseek_v3) is not supported; default or yarn")
    params.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings")
                      or d.get("max_position_embeddings", 4096))
    params["rope_type"] = "yarn"
    return theta, tuple(sorted(params.items()))
