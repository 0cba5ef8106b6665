"""The sparse MoE FFN: a top-k softmax router and SwiGLU experts run as grouped GEMMs over tokens sorted by expert.

Routing and expert execution are separate calls so that a runner can count tokens per expert (the expert
batch size that module-based batching exists to grow), and later send tokens to other ranks between the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.models.config import ExecModelConfig


class SparseMoE(nn.Module):
    """Experts stored stacked, [E, ...], so that one expert's weights are one contiguous slice (one GEMM, one
    copy when streamed) and all experts of a layer are three tensors."""

    def __init__(self, config: ExecModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = E, config.top_k, config.norm_topk_prob
        kw = dict(device=device, dtype=dtype)
        self.gate = nn.Linear(H, E, bias=False, **kw)  # the router
        self.w_gate = nn.Parameter(torch.empty(E, I, H, **kw))
        self.w_up = nn.Parameter(torch.empty(E, I, H, **kw))
        self.w_down = nn.Parameter(torch.empty(E, H, I, **kw))
        # Tokens each expert got in the last `experts` call: the expert batch sizes, already on the host (the
        # grouped loop needs them there), kept so that a runner can report them without another sync.
        self.last_tokens_per_expert: list[int] = []

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32).

        Softmax over all experts in fp32, top-k, then renormalise the k weights (Mixtral always, Qwen3-MoE if
        norm_topk_prob). Weights stay fp32, as in HF's Mixtral; the weighted sum is cast back in `experts`.
        """
        probs = torch.softmax(self.gate(hidden).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def experts(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(hidden): [T, H].

        The T*k (token, expert) assignments are sorted by expert (stable, so ties keep token order), each
        expert runs one GEMM on its contiguous slice, and the weighted rows are scatter-added back per token.
        The loop is over experts, never tokens; the per-expert counts cost one host sync per call.
        """
        T, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k
        counts = self.last_tokens_per_expert = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        x = hidden[token_of]
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                xs = x[start:start + n]
                h = F.silu(F.linear(xs, self.w_gate[e])) * F.linear(xs, self.w_up[e])
                out[start:start + n] = F.linear(h, self.w_down[e])
                start += n
        weighted = (out * topk_weights.reshape(-1)[order, None]).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, token_of, weighted)

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The layer's always-on part, added to `experts`'s output: DeepSeek's shared experts; None here."""
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(hidden)
        return self.experts(hidden, ids, weights)


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many (token, expert) assignments each expert gets: the expert batch sizes."""
    return torch.bincount(topk_ids.reshape(-1), minlength=num_experts)
