"""Rotary position embeddings: frequencies (default, linear, yarn, llama3 scaling) and the two layouts.

Numerics follow transformers 5.24 exactly: inverse frequencies and angles are computed in float32, cos/sin are
scaled by the attention factor in float32 and then cast to the model dtype.
"""

from __future__ import annotations

import math

import torch

from dhisparse.model.config import ModelConfig


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


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x0, x1), (x2, x3) …``; output is de-interleaved (evens then odds).

    ``x [..., rope_dim]``; ``cos``/``sin`` broadcastable to ``x`` without their last dim halved.
    """
    cos = cos[..., : cos.shape[-1] // 2]
    sin = sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Standard rotate-half RoPE (first half / second half pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
