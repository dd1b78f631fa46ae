"""FP8 KV rows in FlashMLA's sparse-decode layout, stored as bytes and dequantized at gather.

One row of an MLA source (``latent`` values of ``kv_lora_rank`` then ``rope`` values of ``qk_rope_head_dim``) is
stored as ``uint8`` bytes::

    [ latent as float8 e4m3 (latent bytes) | one float32 scale per 128 latent values (4 × groups bytes) |
      rope as bfloat16 (2 × rope bytes) ]

For GLM-5 / DeepSeek-V3.2 (512 + 64) that is 512 + 16 + 128 = 656 bytes, the row FlashMLA's FP8 sparse decode
reads. Each group of 128 latent values (fewer when the latent is smaller, as in the tiny test models) is scaled by
``amax / 448`` (448: the largest e4m3 value) before the cast; an all-zero group keeps scale 1. Dequantization
multiplies back in float32 and casts to the model dtype; RoPE values only lose their bits below bfloat16.
The arena, the host store and every copy between them hold these bytes; only ``gather`` sees values.

Indexer keys have an FP8 format too (``index_key_format="fp8"``), DeepSeek-V3.2's: the ``d`` key values as
float8 e4m3 scaled by one float32 ``amax / 448`` per key, then that scale — ``d + 4`` bytes (132 for 128 values).
Keys are quantized when stored and dequantized when scored.
"""

from __future__ import annotations

import torch

FP8_GROUP = 128
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _groups(latent_dim: int) -> tuple[int, int]:
    group = min(FP8_GROUP, latent_dim)
    if latent_dim % group:
        raise ValueError(f"fp8 rows need kv_lora_rank ({latent_dim}) to be a multiple of {group}")
    return latent_dim // group, group


def fp8_row_bytes(latent_dim: int, rope_dim: int) -> int:
    """Bytes of one FP8 row (656 for a 512-value latent and 64 RoPE values)."""
    groups, _ = _groups(latent_dim)
    return latent_dim + 4 * groups + 2 * rope_dim


def quantize_rows(rows: torch.Tensor, latent_dim: int) -> torch.Tensor:
    """``rows [..., latent_dim + rope_dim]`` (any float dtype) → ``uint8 [..., fp8_row_bytes]``."""
    lead = rows.shape[:-1]
    groups, group = _groups(latent_dim)
    latent = rows[..., :latent_dim].float().reshape(*lead, groups, group)
    rope = rows[..., latent_dim:]
    scale = latent.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (latent / scale).to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, latent_dim)
    scales = scale.reshape(*lead, groups).contiguous().view(torch.uint8)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([values, scales, rope_bytes], dim=-1)


def dequantize_rows(packed: torch.Tensor, latent_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [..., fp8_row_bytes]`` → rows ``[..., latent_dim + rope_dim]`` of ``dtype``."""
    lead = packed.shape[:-1]
    groups, group = _groups(latent_dim)
    values = packed[..., :latent_dim].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[..., latent_dim:latent_dim + 4 * groups].contiguous().view(torch.float32)
    rope = packed[..., latent_dim + 4 * groups:].contiguous().view(torch.bfloat16)
    latent = (values.reshape(*lead, groups, group) * scales.unsqueeze(-1)).reshape(*lead, latent_dim)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


def fp8_key_bytes(key_dim: int) -> int:
    """Bytes of one FP8 indexer key (132 for 128 values): e4m3 values then one float32 scale."""
    return key_dim + 4


def quantize_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys [..., d]`` (any float dtype) → ``uint8 [..., d + 4]``."""
    k = keys.float()
    scale = k.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (k / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([values, scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_keys(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [..., d + 4]`` → keys ``[..., d]`` of ``dtype`` (all-zero bytes give zero keys)."""
    d = packed.shape[-1] - 4
    values = packed[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[..., d:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)
