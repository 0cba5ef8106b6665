"""The sparse MoE FFN: a top-k softmax router and SwiGLU experts run as grouped GEMMs over tokens sorted by expert.

Routing and expert execution are separate calls so that a runner can count tokens per expert (the expert
batch size that module-based batching exists to grow), and later send tokens to other ranks between the two.

Grouped GEMMs: each projection of all experts is one `torch._grouped_mm` call over the expert-sorted tokens
(one kernel, group offsets on the device, so no host sync for the counts), where this torch build has it for
the device and dtype (probed once per pair); elsewhere a loop over experts, one GEMM per non-empty expert.
Measured on the 2-core CPU machine (torch 2.13, one thread, E=8, hidden 512, expert width 1024): equal speed
within noise (fp32 40 assignments 10.5 vs 10.7 ms, 640: 39.7 vs 38.5 ms, 2048: 111 vs 120 ms; bf16 2048:
739 vs 768 ms), outputs bit-identical at those sizes (equal to rounding in general). `torch._grouped_mm` is
private API: the probe falls back to the loop if a build lacks it or refuses the arguments.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.models import invariant
from batchgen.exec.models.config import ExecModelConfig

_GROUPED: dict[tuple[str, torch.dtype], bool] = {}
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # stacked [E, ...]: what expert parallelism shards


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here (2-D tokens x 3-D transposed expert weights, int32 offsets,
    empty groups included) and agrees with a plain matmul; probed once per (device type, dtype)."""
    key = (device.type, dtype)
    if key not in _GROUPED:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(24, 16, generator=gen).to(device, dtype)
                w = torch.randn(3, 32, 16, generator=gen).to(device, dtype)  # [E, out, in], as stored
                offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
                got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
                want = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T])
                ok = bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _GROUPED[key] = ok
    return _GROUPED[key]


class SparseMoE(nn.Module):
    """Experts stored stacked, [E, ...], so that one expert's weights are one contiguous slice (one GEMM, one
    copy when streamed) and all experts of a layer are three tensors."""

    def __init__(self, config: ExecModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = E, config.top_k, config.norm_topk_prob
        kw = dict(device=device, dtype=dtype)
        self.gate = invariant.Linear(H, E, bias=False, **kw)  # the router
        self.w_gate = nn.Parameter(torch.empty(E, I, H, **kw))
        self.w_up = nn.Parameter(torch.empty(E, I, H, **kw))
        self.w_down = nn.Parameter(torch.empty(E, H, I, **kw))
        self._last_counts: torch.Tensor | None = None

    @property
    def last_tokens_per_expert(self) -> list[int]:
        """Tokens each expert got in the last `experts` call (the expert batch sizes); reading them syncs."""
        return [] if self._last_counts is None else self._last_counts.tolist()

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

        The T*k (token, expert) assignments are sorted by expert (stable, so ties keep token order), the experts
        run as grouped GEMMs on their contiguous slices (see the module docstring), and the weighted rows are
        scatter-added back per token. Nothing loops over tokens.
        """
        if self.w_gate.shape[0] != self.num_experts:
            raise RuntimeError(f"this module holds {self.w_gate.shape[0]} of {self.num_experts} experts (a shard): "
                               "run it through batchgen.dist.ExpertParallelMoE")
        T, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k
        counts = self._last_counts = torch.bincount(flat_ids, minlength=self.num_experts)
        out = self.sorted_expert_rows(hidden[token_of], counts)
        weighted = (out * topk_weights.reshape(-1)[order, None]).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, token_of, weighted)

    def sorted_expert_rows(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The held experts' SwiGLU on rows sorted by expert, unweighted: x [N, H], counts [held experts] (the
        first counts[0] rows go to the first stored expert, ...) -> [N, H]. `experts` calls it with every
        expert; expert parallelism (batchgen.dist) calls it on a shard (`expert_shard`) with the rows that
        arrived from all ranks, so both run the same kernels on the same rows."""
        out = None
        if grouped_mm_available(x.device, x.dtype) and not invariant.enabled():
            try:
                out = self._grouped(x, torch.cumsum(counts, 0, dtype=torch.int32))
            except RuntimeError:  # a shape the kernel refuses (alignment): the loop from now on
                _GROUPED[(x.device.type, x.dtype)] = False
        return self._looped(x, counts.tolist()) if out is None else out

    def _grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Three grouped GEMMs over all experts; offs [E] int32: end row of each expert's slice."""
        def mm(inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(inp, w.transpose(1, 2), offs=offs)
        return mm(F.silu(mm(x, self.w_gate)) * mm(x, self.w_up), self.w_down)

    def _looped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One GEMM per non-empty expert (needs the counts on the host)."""
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n and invariant.enabled():
                out[start:start + n] = invariant.swiglu(x[start:start + n], self.w_gate[e], self.w_up[e],
                                                        self.w_down[e])
                start += n
            elif n:
                xs = x[start:start + n]
                h = F.silu(F.linear(xs, self.w_gate[e])) * F.linear(xs, self.w_up[e])
                out[start:start + n] = F.linear(h, self.w_down[e])
                start += n
        return out

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The layer's always-on part, added to `experts`'s output: DeepSeek's shared experts; None here."""
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(hidden)
        return self.experts(hidden, ids, weights)

    def expert_shard(self, experts: Sequence[int]) -> "SparseMoE":
        """A module of the same class holding only these experts' weights, stacked in the given order, and
        sharing everything else with this one (the router, routing constants, shared experts): one rank's part
        under expert parallelism. `route` and `shared` are unchanged (global expert ids); run the held experts
        with `sorted_expert_rows`; `experts` refuses, since it needs every expert."""
        idx = torch.as_tensor(list(experts), dtype=torch.int64, device=self.w_gate.device)
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < self.num_experts):
            raise ValueError(f"expert ids {list(experts)} outside 0..{self.num_experts - 1}")
        return self.over_experts({name: getattr(self, name).detach().index_select(0, idx) for name in EXPERT_WEIGHTS})

    def over_experts(self, stacks: dict[str, torch.Tensor]) -> "SparseMoE":
        """A module of the same class over these expert weight stacks (`EXPERT_WEIGHTS` -> [n, ...] tensors, used
        as they are, not copied), sharing everything else with this one: an expert shard, or every expert in a
        data-parallel prefill's ring slot (batchgen.dist.dp_prefill)."""
        view = copy.copy(self)  # same class and attributes; fresh registries so the copy's weights are its own
        view._parameters = {k: v for k, v in self._parameters.items() if k not in EXPERT_WEIGHTS}
        view._modules, view._buffers = dict(self._modules), dict(self._buffers)
        view._last_counts = None
        for name in EXPERT_WEIGHTS:
            setattr(view, name, nn.Parameter(stacks[name], requires_grad=getattr(self, name).requires_grad))
        return view


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many (token, expert) assignments each expert gets: the expert batch sizes."""
    return torch.bincount(topk_ids.reshape(-1), minlength=num_experts)
