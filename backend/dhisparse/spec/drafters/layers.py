"""Small building blocks shared by the drafters: RoPE, a SwiGLU MLP and a pre-norm attention block whose
queries may attend to externally supplied keys/values (the context) as well as to each other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for half-split RoPE.

    positions: [..., N] integer (may be negative: only differences matter). Returns two [..., N, head_dim]
    float32 tensors.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, N, head_dim]; cos/sin: [B or 1, N, head_dim]. Half-split rotation, dtype of x kept."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftBlock(nn.Module):
    """Pre-norm transformer block over ``N`` query positions that may also attend to ``L`` context positions.

    The context keys/values are passed in already projected (``context_kv``), un-rotated; this is what a
    drafter stores per context position. Attention is multi-head with ``hidden_size // num_heads`` per head.
    """

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.attn_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.context_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def context_kv(self, context: torch.Tensor) -> torch.Tensor:
        """context: [B, L, hidden] fused target features -> [B, L, 2, hidden] un-rotated (K, V) of this layer."""
        normed = self.context_norm(context)
        return torch.stack([self.k_proj(normed), self.v_proj(normed)], dim=2)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        context_kv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, N, hidden]; rope: cos/sin [B or 1, L + N, head_dim] for (context, queries) in that order;
        mask: bool [B or 1, N, L + N], True = may attend; context_kv: [B, L, 2, hidden] or None (L = 0)."""
        normed = self.attn_norm(x)
        q, k, v = (
            self._heads(self.q_proj(normed)),
            self._heads(self.k_proj(normed)),
            self._heads(self.v_proj(normed)),
        )
        if context_kv is not None:
            k = torch.cat([self._heads(context_kv[:, :, 0]), k], dim=2)
            v = torch.cat([self._heads(context_kv[:, :, 1]), v], dim=2)
        cos, sin = rope
        n = x.shape[1]
        q = apply_rope(q, cos[:, -n:], sin[:, -n:])
        k = apply_rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.o_proj(attn.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.mlp_norm(x))
