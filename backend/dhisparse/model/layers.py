"""Building blocks with the numerics of transformers 5.24: RMSNorm and the router in float32, the gated MLP, the MoE,
and rotary position embeddings.

RoPE: frequencies (default, linear, yarn, llama3 scaling) and the two layouts.

Numerics follow transformers 5.24 exactly: inverse frequencies and angles are computed in float32, cos/sin are
scaled by the attention factor in float32 and then cast to the model dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dhisparse.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, then scaled (as ``DeepseekV3RMSNorm``: for float64 inputs too).

    torch's fused ``F.rms_norm`` on the float32 copy gives the same bits as transformers' explicit
    ``x * rsqrt(mean(x²) + eps)`` (``tests/model/test_layers.py``); the decode path writes this expression in place."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``. Weights in ``nn.Linear`` layout ``[out, in]``."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class MoE:
    """Shared + routed experts with the DeepSeek-V3 sigmoid router (grouped top-k, bias-corrected choice).

    Weights: ``gate_weight [E, H]`` and ``correction_bias [E]`` in float32; ``experts_gate/up [E, I, H]``,
    ``experts_down [E, H, I]``; shared expert MLP weights (or ``None`` when ``n_shared_experts == 0``).
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        prefix: str,
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        has_shared: bool,
    ) -> None:
        self.gate_weight = weights[prefix + "gate.weight"]
        self.correction_bias = weights[prefix + "gate.e_score_correction_bias"]
        self.experts_gate = weights[prefix + "experts.gate_proj"]
        self.experts_up = weights[prefix + "experts.up_proj"]
        self.experts_down = weights[prefix + "experts.down_proj"]
        self.shared = (
            (weights[prefix + "shared_experts.gate_proj.weight"], weights[prefix + "shared_experts.up_proj.weight"],
             weights[prefix + "shared_experts.down_proj.weight"])
            if has_shared
            else None
        )
        self.num_experts = self.experts_gate.shape[0]
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def route(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(weights [N, k] float32, expert ids [N, k])`` for tokens ``x2d [N, H]``."""
        scores = F.linear(x2d.to(torch.float32), self.gate_weight.to(torch.float32)).sigmoid()
        choice = scores + self.correction_bias
        if self.n_group > 1:
            n = x2d.shape[0]
            grouped = choice.view(n, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, self.num_experts)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        weights, ids = self.route(x2d)
        if _grouped_mm_works(x2d, self.experts_gate.shape[1]):
            out = self._grouped(x2d, weights, ids)
        else:
            out = self._masked(x2d, weights, ids)
        out = out.view(shape)
        if self.shared is not None:
            out = out + gated_mlp(x, *self.shared)
        return out

    def _grouped(self, x2d: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sync-free dispatch: the ``N·k`` (token, expert) assignments sorted by expert, one grouped matmul per
        projection over fixed-shape ``[N·k, …]`` operands with device-side group offsets (no host read of which
        experts were chosen). Each token then sums its ``k`` contributions in ascending expert order, as
        transformers' eager experts accumulate."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignment indices, grouped by expert
        # Group ends: assignments to experts <= e, searched in the sorted ids (bincount would read its size on
        # the host).
        experts = torch.arange(self.num_experts, device=flat.device, dtype=flat.dtype)
        offs = torch.searchsorted(flat.index_select(0, order), experts, right=True).to(torch.int32)
        xs = x2d.index_select(0, order // k)
        gate = torch._grouped_mm(xs, self.experts_gate.transpose(1, 2), offs=offs)
        up = torch._grouped_mm(xs, self.experts_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(gate) * up, self.experts_down.transpose(1, 2), offs=offs)
        y = (y * weights.reshape(-1).index_select(0, order).unsqueeze(-1)).to(x2d.dtype)
        per_slot = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)  # back to (token, slot) order
        by_expert = per_slot.gather(1, ids.argsort(dim=1).unsqueeze(-1).expand_as(per_slot))
        out = torch.zeros_like(x2d)
        for j in range(k):
            out = out + by_expert[:, j]
        return out

    def _masked(self, x2d: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Fallback where grouped matmuls are unavailable (float64, dimensions not 16-byte aligned): every expert
        over every token with the router weight (0 when not chosen), in ascending expert order — sync-free, exact
        (adding ``0·y`` leaves a sum unchanged), at ``E / k`` times the expert compute (test models only)."""
        out = torch.zeros_like(x2d)
        for expert in range(self.num_experts):
            coef = (weights * (ids == expert)).sum(dim=-1, keepdim=True)  # the weight, or 0 if not chosen
            y = gated_mlp(x2d, self.experts_gate[expert], self.experts_up[expert], self.experts_down[expert])
            out = out + (y * coef).to(out.dtype)
        return out


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(x: torch.Tensor, intermediate: int) -> bool:
    """Whether ``torch._grouped_mm`` serves this device and dtype (probed once: it exists for float32 / bfloat16 /
    float16 on CPU and recent GPUs) and the rows are 16-byte aligned as it requires."""
    if not hasattr(torch, "_grouped_mm") or (x.shape[-1] * x.element_size()) % 16 or (
            intermediate * x.element_size()) % 16:
        return False
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_OK:
        a = torch.ones(4, 8, dtype=x.dtype, device=x.device)
        b = torch.ones(2, 8, 8, dtype=x.dtype, device=x.device)
        try:
            got = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=x.device))
            _GROUPED_OK[key] = bool((got == 8).all())  # a one-off probe at first use, not per step
        except (RuntimeError, NotImplementedError):
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]


# --------------------------------------------------------------------------------------- rotary embeddings
def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [rope_dim // 2] float32, attention_factor)`` for the config's RoPE variant."""
    params = cfg.rope_parameters
    base = float(params.get("rope_theta", 10000.0))
    dim = cfg.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = cfg.rope_type
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    attention_factor = params.get("attention_factor")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    original_max = params.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, float(attention_factor)


def attention_softmax_scale(cfg: ModelConfig) -> float:
    """MLA softmax scale: ``qk_head_dim ** -0.5``, times ``mscale**2`` for scaled RoPE with ``mscale_all_dim``."""
    scale = cfg.qk_head_dim ** (-0.5)
    if cfg.rope_type != "default":
        mscale_all_dim = cfg.rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = _yarn_get_mscale(float(cfg.rope_parameters["factor"]), mscale_all_dim)
            scale = scale * m * m
    return scale


class RotaryEmbedding:
    """Computes ``(cos, sin)`` of shape ``[*positions.shape, rope_dim]`` in the model dtype."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        inv_freq, self.attention_scaling = inverse_frequencies(cfg)
        self.inv_freq = inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
