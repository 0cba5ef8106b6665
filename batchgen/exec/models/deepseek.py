"""DeepSeek-V3's MoE FFN: group-limited sigmoid routing with a score-correction bias, plus shared experts.

The routed experts are `SparseMoE`'s (stacked weights, grouped GEMMs over tokens sorted by expert); only the
router differs, and the shared experts (one SwiGLU of moe_intermediate_size * n_shared_experts) run on every
token. `forward(x) = experts(x, *route(x)) + shared(x)`: a runner that calls `route` / `experts` itself (to
count or ship tokens between them) must add `shared(x)`, which `SparseMoE.shared` returns as None for the
families without shared experts.

Routing, as transformers' `DeepseekV3TopkRouter` (5.24), in fp32: scores = sigmoid(x W^T); the experts are
chosen on scores + e_score_correction_bias, first keeping the topk_group best of n_group groups (a group's
score: the sum of its two best biased scores), then the top_k experts of those groups; the weights are the
unbiased scores of the chosen experts, renormalised (norm_topk_prob, + 1e-20) and multiplied by
routed_scaling_factor. The router weight and the bias are created in fp32 whatever the model dtype, as
transformers keeps them (`_keep_in_fp32_modules_strict`): in bf16 the bias would round away.

The scores' sigmoid is taken so that a row's bits do not depend on the rows beside it (`row_stable_sigmoid`):
expert parallelism routes each rank's rows alone, and the single-process layer all of them at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.models.config import ExecModelConfig
from batchgen.exec.models.layers import SwiGLUMLP
from batchgen.exec.models.moe import SparseMoE

# A multiple of every CPU's unrolled vector loop (two vector registers: 32 fp32 with AVX-512, up to 128 with SVE).
_CPU_LANES = 128


def row_stable_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x), each element computed by the same kernel path wherever its row sits in the batch.

    PyTorch's CPU elementwise loop runs whole vector blocks with its vectorised (Sleef) sigmoid and the last
    partial block with the scalar one, which differ in the last bit: on AVX-512, a [15, 8] tensor's rows 12-14
    come out differently from the same rows inside a [30, 8] one. Padding the buffer to a multiple of the
    widest block puts every element on the vector path (one torch thread, or a tensor below the elementwise
    grain of 32K elements, as router scores are; threads split larger ones at other offsets). CUDA has no
    scalar tail.
    """
    if x.device.type != "cpu":
        return x.sigmoid()
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _CPU_LANES
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.sigmoid()[:x.numel()].view_as(x)


class DeepseekRouter(nn.Module):
    """Named like transformers' `mlp.gate`: `weight` [E, H] and `e_score_correction_bias` [E], both fp32."""

    def __init__(self, hidden: int, num_experts: int, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=torch.float32))


class DeepseekMoE(SparseMoE):
    def __init__(self, config: ExecModelConfig, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.gate = DeepseekRouter(config.hidden_size, config.num_experts, device=device)
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.shared_experts = (SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                         device=device, dtype=dtype) if config.n_shared_experts else None)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32), transformers' order of operations."""
        E, G = self.num_experts, self.n_group
        logits = F.linear(hidden.float(), self.gate.weight.float())
        scores = row_stable_sigmoid(logits)
        choice = scores + self.gate.e_score_correction_bias.float()
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for every token (None without shared experts)."""
        return None if self.shared_experts is None else self.shared_experts(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(hidden)
        out = self.experts(hidden, ids, weights)
        shared = self.shared(hidden)
        return out if shared is None else out + shared
