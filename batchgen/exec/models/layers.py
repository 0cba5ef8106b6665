"""RMSNorm, rotary embedding and the SwiGLU MLP, written to match transformers' Llama-family code bit for bit
in fp32 (same casts, same operation order), because greedy decoding is tested token for token against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.exec.models import invariant
from batchgen.exec.models.invariant import Linear


class RMSNorm(nn.Module):
    """Statistics in fp32 whatever the model dtype, then back to the input dtype before the weight, as HF."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding:
    """cos/sin for arbitrary absolute positions (tokens of many sequences at different offsets in one flat
    batch), with HF's "rotate_half" layout: the two halves of head_dim, not interleaved pairs.

    Not an nn.Module: `inv_freq` must stay fp32 on the right device even after `model.to(bfloat16)`, and it
    is computed on the CPU once so that CPU and CUDA runs use the very same frequencies (HF does the same).
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, head_dim] in `dtype`; the angles themselves are fp32."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


class SwiGLUMLP(nn.Module):
    """The dense FFN: down(silu(gate(x)) * up(x)), HF's gate_proj/up_proj/down_proj names."""

    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = Linear(hidden, intermediate, **kw)
        self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.enabled():
            return invariant.swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
