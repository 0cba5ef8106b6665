"""Model architecture as plain data: the numbers the latency model, the memory planner and the executor need.

Parameter counts follow the Hugging Face checkpoints (SwiGLU FFNs, untied LM head unless `tie_embeddings`);
norm weights and biases (< 0.01% of any model here) are left out. DeepSeek's multi-token-prediction layer is
not part of the model: it is only used for speculative decoding, which batchgen does not do.
"""

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Mapping

# ---- validation helpers, shared with hardware.py --------------------------------------------------------
# Specs arrive from YAML and Hydra overrides, where a typo turns a number into a string; these turn such
# mistakes into one-line errors naming the field, the bad value and the fix, not a TypeError in the simulator.


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_field_types(obj: Any, prefix: str) -> None:
    """Check every field against its annotation: int, float (ints accepted), str, bool, or `int | None`."""
    for f in fields(obj):
        value, kind = getattr(obj, f.name), f.type if isinstance(f.type, str) else str(f.type)
        kind = {str(int): "int", str(float): "float", str(str): "str", str(bool): "bool"}.get(kind, kind)
        ok = {
            "int": _is_int(value),
            "float": _is_int(value) or isinstance(value, float),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
            "int | None": value is None or _is_int(value),
        }.get(kind, True)
        if not ok:
            wanted = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                      "int | None": "an integer or null"}[kind]
            hint = ": write the number without quotes" if isinstance(value, str) and kind != "str" else ""
            raise ValueError(f"{prefix}.{f.name} must be {wanted}, got {value!r} ({type(value).__name__}){hint}")


def require(ok: bool, prefix: str, name: str, value: Any, rule: str, fix: str = "") -> None:
    """Raise `ValueError("<prefix>.<name> must <rule>, got <value>: <fix>")` unless `ok`."""
    if not ok:
        raise ValueError(f"{prefix}.{name} must {rule}, got {value!r}" + (f": {fix}" if fix else ""))


def plain_dict(d: Any, what: str) -> dict:
    """A dict or an OmegaConf DictConfig (interpolations resolved) as a plain dict."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(d, DictConfig):
            return OmegaConf.to_container(d, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    if not isinstance(d, Mapping):
        raise ValueError(f"a {what} config must be a mapping of field names to values, got {type(d).__name__}")
    return dict(d)


def check_keys(d: Mapping[str, Any], cls: type, what: str) -> None:
    """Unknown keys are typos more often than not, so they are errors, with the valid names listed."""
    valid = [f.name for f in fields(cls)]
    unknown = sorted(str(k) for k in set(d) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what} field(s) {', '.join(unknown)}; valid fields are: {', '.join(valid)}")
    missing = [f.name for f in fields(cls)
               if f.name not in d and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{what} config lacks required field(s) {', '.join(missing)}")


# ---- the model spec ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, dense or MoE, with GQA (MHA = GQA with num_kv_heads == num_heads) or MLA."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    attention: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate_size: int
    num_experts: int = 0
    num_shared_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0
    tie_embeddings: bool = False
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0

    def __post_init__(self) -> None:
        p = "model"
        check_field_types(self, p)
        for name in ("num_layers", "hidden_size", "vocab_size", "max_context", "num_heads", "num_kv_heads"):
            require(getattr(self, name) > 0, p, name, getattr(self, name), "be a positive integer",
                    "copy it from the model's config.json")
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "num_experts", "num_shared_experts", "top_k", "moe_intermediate_size",
                     "first_dense_layers", "head_dim", "intermediate_size"):
            require(getattr(self, name) >= 0, p, name, getattr(self, name), "be >= 0", "use 0 for 'not used'")
        for name in ("weight_bytes", "kv_bytes", "act_bytes"):
            require(getattr(self, name) > 0, p, name, getattr(self, name), "be positive",
                    "bytes per element: 4 for fp32, 2 for bf16/fp16, 1 for fp8, 0.5 for int4")
        require(self.attention in ("gqa", "mla"), p, "attention", self.attention, "be 'gqa' or 'mla'",
                "MHA is 'gqa' with num_kv_heads == num_heads")
        require(self.num_heads % self.num_kv_heads == 0, p, "num_kv_heads", self.num_kv_heads,
                f"divide num_heads ({self.num_heads})", "each KV head serves a whole group of query heads")
        if self.attention == "gqa":
            require(self.head_dim > 0, p, "head_dim", self.head_dim, "be positive for attention='gqa'",
                    "usually hidden_size // num_heads, or config.json's head_dim")
        else:
            for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                require(getattr(self, name) > 0, p, name, getattr(self, name), "be positive for attention='mla'",
                        "copy it from the model's config.json")
        require(self.first_dense_layers <= self.num_layers, p, "first_dense_layers", self.first_dense_layers,
                f"be <= num_layers ({self.num_layers})")
        if self.num_experts == 0:
            require(self.top_k == 0, p, "top_k", self.top_k, "be 0 for a dense model (num_experts == 0)",
                    "set num_experts for an MoE model, or top_k=0")
            require(self.num_shared_experts == 0, p, "num_shared_experts", self.num_shared_experts,
                    "be 0 for a dense model (num_experts == 0)")
        else:
            require(1 <= self.top_k <= self.num_experts, p, "top_k", self.top_k,
                    f"be between 1 and num_experts ({self.num_experts})",
                    "the number of experts each token is routed to (config.json's num_experts_per_tok)")
            require(self.moe_intermediate_size > 0, p, "moe_intermediate_size", self.moe_intermediate_size,
                    "be positive for an MoE model", "config.json's moe_intermediate_size (Mixtral: "
                    "intermediate_size)")
        if self.num_dense_layers > 0:
            require(self.intermediate_size > 0, p, "intermediate_size", self.intermediate_size,
                    f"be positive when the model has dense layers ({self.num_dense_layers})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        """Build from a YAML/Hydra mapping whose keys are exactly the field names."""
        d = plain_dict(d, "model")
        check_keys(d, cls, "model")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- structure ----

    @property
    def is_moe(self) -> bool:
        """num_experts > 0."""
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """num_layers - first_dense_layers for MoE models, else 0."""
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense FFN: first_dense_layers for MoE models, every layer otherwise."""
        return self.first_dense_layers if self.is_moe else self.num_layers

    # ---- parameters ----

    @property
    def attention_params_per_layer(self) -> int:
        """GQA: h*(H*d) + 2*h*(K*d) + (H*d)*h. MLA: q + kv_a h*(r_kv+rope) + kv_b r_kv*H*(nope+v) + o H*v*h."""
        h, heads = self.hidden_size, self.num_heads
        if self.attention == "gqa":
            q = heads * self.head_dim
            kv = self.num_kv_heads * self.head_dim
            return h * q + 2 * h * kv + q * h
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank > 0:
            q = h * self.q_lora_rank + self.q_lora_rank * heads * qk_head
        else:
            q = h * heads * qk_head
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = heads * self.v_head_dim * h
        return q + kv_a + kv_b + o

    @property
    def dense_ffn_params(self) -> int:
        """3 * hidden * intermediate (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """3 * hidden * moe_intermediate (one SwiGLU expert)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        """num_shared_experts * expert_params (all shared experts of one layer)."""
        return self.num_shared_experts * self.expert_params

    @property
    def router_params(self) -> int:
        """hidden * num_experts (the gate's linear layer)."""
        return self.hidden_size * self.num_experts

    @property
    def moe_ffn_params(self) -> int:
        """One MoE layer's FFN: num_experts * expert + shared + router."""
        return self.num_experts * self.expert_params + self.shared_expert_params + self.router_params

    @property
    def embedding_params(self) -> int:
        """vocab * hidden, twice (input embedding and LM head) unless tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def total_params(self) -> int:
        """embedding + layers * attention + dense layers * dense FFN + MoE layers * MoE FFN."""
        return (self.embedding_params + self.num_layers * self.attention_params_per_layer
                + self.num_dense_layers * self.dense_ffn_params + self.num_moe_layers * self.moe_ffn_params)

    @property
    def active_params_per_token(self) -> int:
        """As total_params, but each MoE layer counts router + (top_k + shared) experts, as published sizes do."""
        active_moe = (self.top_k + self.num_shared_experts) * self.expert_params + self.router_params
        return (self.embedding_params + self.num_layers * self.attention_params_per_layer
                + self.num_dense_layers * self.dense_ffn_params + self.num_moe_layers * active_moe)

    @property
    def weight_bytes_total(self) -> float:
        """total_params * weight_bytes."""
        return self.total_params * self.weight_bytes

    # ---- KV cache ----

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        """GQA: 2 * num_kv_heads * head_dim * kv_bytes (K and V). MLA: (kv_lora + rope) * kv_bytes (latent)."""
        if self.attention == "gqa":
            return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """kv_bytes_per_token_per_layer * num_layers."""
        return self.kv_bytes_per_token_per_layer * self.num_layers

    def partition_degrees(self, limit: int = 64) -> tuple[int, ...]:
        """Ranks one sequence's attention can be split over by heads, up to `limit`: the degree must divide
        the query heads and (GQA) the KV heads; MLA's latent is replicated, so only the query heads count."""
        heads = (self.num_heads, self.num_kv_heads) if self.attention == "gqa" else (self.num_heads,)
        return tuple(d for d in range(1, limit + 1) if all(h % d == 0 for h in heads))

    # ---- attention FLOPs ----

    @property
    def attention_score_flops_decode(self) -> int:
        """Per (query, context token) pair, one layer. GQA: 4*H*d (QK^T, PV). MLA absorbed: 2*H*(2*r_kv+rope)."""
        if self.attention == "gqa":
            return 4 * self.num_heads * self.head_dim
        return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def attention_score_flops_prefill(self) -> int:
        """Per pair, one layer, before causal halving. GQA: 4*H*d. MLA (not absorbed): 2*H*(nope+rope) + 2*H*v."""
        if self.attention == "gqa":
            return 4 * self.num_heads * self.head_dim
        heads = self.num_heads
        return 2 * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim) + 2 * heads * self.v_head_dim
