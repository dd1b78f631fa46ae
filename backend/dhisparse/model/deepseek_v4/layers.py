"""DeepSeek-V4 building blocks with transformers 5.24's numerics: norms, interleaved trailing RoPE, the mHC
hyper-connections (Sinkhorn-projected residual mixing), the grouped low-rank output projection and the MoE
(sqrtsoftplus top-k router, hash router, clamped SwiGLU experts plus one shared expert).

Dtype rules copied from the reference: RMSNorm computes in float32 and multiplies by a float32 weight before
casting back; the hyper-connection weights are computed in float32; RoPE rotates in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.model.deepseek_v4.config import DeepseekV4Config, RopeView
from dhisparse.model.layers import inverse_frequencies


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``DeepseekV4RMSNorm``: normalise in float32, scale by the (float32) weight, cast back once."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``DeepseekV4UnweightedRMSNorm``."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rotary:
    """One of V4's RoPE parameter sets: ``cos/sin [..., rope_dim // 2]`` for integer positions."""

    def __init__(self, view: RopeView, device: torch.device) -> None:
        inv_freq, self.scaling = inverse_frequencies(view)  # type: ignore[arg-type]
        self.inv_freq = inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def _rotate_half_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x``; ``cos/sin`` broadcast against
    ``x[..., :1]`` after a head axis is added by the caller where needed."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = (rope.float() * cos + _rotate_half_interleaved(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class HyperConnection:
    """mHC weights for one block: ``(post [B,S,N], comb [B,S,N,N], collapsed [B,S,D])`` from ``N`` streams."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: DeepseekV4Config) -> None:
        self.fn, self.base, self.scale = fn, base, scale
        self.hc, self.iters, self.eps, self.norm_eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s = streams.shape[:2]
        hc = self.hc
        flat = unweighted_rms_norm(streams.reshape(b, s, -1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp towards a doubly-stochastic matrix
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def hyper_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                ) -> torch.Tensor:
    """``post ⊗ block_out + combᵀ · streams`` (the decoder layer's residual update), in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 streams)


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               cfg: DeepseekV4Config) -> torch.Tensor:
    """``DeepseekV4HyperHead``: the final collapse of the ``N`` streams into one hidden state."""
    flat = unweighted_rms_norm(streams.flatten(2).float(), cfg.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def grouped_output(x: torch.Tensor, o_a: torch.Tensor, o_b: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped low-rank output projection: ``x [B, S, H*hd]`` split into ``groups`` blocks, each projected by its
    own slice of ``o_a [groups*rank, H*hd/groups]``, then mixed by ``o_b [hidden, groups*rank]``."""
    lead = x.shape[:-1]
    per_group = x.shape[-1] // groups
    w = o_a.view(groups, -1, per_group).transpose(1, 2)  # [G, in, rank]
    y = torch.bmm(x.reshape(-1, groups, per_group).transpose(0, 1), w).transpose(0, 1)
    return F.linear(y.reshape(*lead, -1), o_b)


class V4MoE:
    """Routed experts (top-k router or hash router) plus the shared expert; SwiGLU pre-activations clamped."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg: DeepseekV4Config, hashed: bool) -> None:
        self.gate_weight = w[prefix + "gate.weight"]
        self.tid2eid = w[prefix + "gate.tid2eid"] if hashed else None
        self.bias = None if hashed else w[prefix + "gate.e_score_correction_bias"]
        self.gate_up = w[prefix + "experts.gate_up_proj"]
        self.down = w[prefix + "experts.down_proj"]
        self.shared = tuple(w[f"{prefix}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.limit, self.scale = cfg.swiglu_limit, cfg.routed_scaling_factor
        self.sqrt_softplus = cfg.scoring_func == "sqrtsoftplus"

    def route(self, x2d: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, k], expert ids [N, k])``; hash layers take the experts from ``tid2eid[token]``."""
        logits = F.linear(x2d, self.gate_weight)
        scores = F.softplus(logits).sqrt() if self.sqrt_softplus else torch.sigmoid(logits)
        if self.tid2eid is not None:
            ids = self.tid2eid[token_ids.reshape(-1)]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        weights, ids = self.route(x2d, token_ids)
        out = torch.zeros_like(x2d)
        # One batched matmul per expert any token chose (a loop over experts, never over tokens), in the
        # reference's order: ascending experts, then (slot, token) pairs as torch.where lists them.
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, N]
        for expert in torch.unique(ids).tolist():
            slot, token = torch.where(mask[expert])
            gate, up = F.linear(x2d[token], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(self._swiglu(gate, up), self.down[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        gate_w, up_w, down_w = self.shared
        shared = F.linear(self._swiglu(F.linear(x, gate_w), F.linear(x, up_w)), down_w)
        return out.view(shape) + shared
