"""Pure-torch references of the three CUDA kernels: what the self-check and ``scripts/gpu_check.py`` compare
the kernels with. The resolver's reference is :func:`dhisparse.kernels.resolver.resolve` itself.
"""

from __future__ import annotations

import torch

from dhisparse.kernels.resolver import Resolution

FP8_RANK, FP8_ROPE, FP8_ROW_BYTES = 512, 64, 656


def padded_resolution(res: Resolution, num_requests: int, n_select: int) -> dict[str, torch.Tensor]:
    """The resolver kernel's output form of ``res``: copy lists ``[R, N]`` (each row's copies first, ascending,
    then ``-1``) and ``summary [R, 6]`` int32 (status 0, union size, copies, direct, hot, host)."""
    device = res.locations.device
    counts = torch.bincount(res.copy_request, minlength=num_requests)
    first = torch.cumsum(counts, 0) - counts
    col = torch.arange(res.copy_request.numel(), device=device) - first[res.copy_request]
    out = {"locations": res.locations, "steps": res.steps, "hot_pos": res.hot_pos, "hot_stamp": res.hot_stamp}
    for name in ("copy_position", "copy_slot", "copy_location"):
        padded = torch.full((num_requests, n_select), -1, dtype=torch.int64, device=device)
        padded[res.copy_request, col] = getattr(res, name)
        out[name] = padded
    summary = torch.zeros(num_requests, 6, dtype=torch.int32, device=device)
    summary[:, 1] = res.counts.sum(1).to(torch.int32)
    summary[:, 2] = counts.to(torch.int32)
    summary[:, 3:6] = res.counts.to(torch.int32)
    out["summary"] = summary
    return out


def row_copy_reference(host_rows: torch.Tensor, device_rows: torch.Tensor, src_rows: torch.Tensor,
                       dst_rows: torch.Tensor) -> torch.Tensor:
    """``device_rows`` after ``device_rows[dst] = host_rows[src]`` for every pair with ``src >= 0`` (a new
    tensor; ``src_rows`` / ``dst_rows`` ``[R, M]``)."""
    out = device_rows.clone()
    keep = src_rows >= 0
    src = src_rows[keep].to(host_rows.device, torch.int64)
    out[dst_rows[keep].to(out.device, torch.int64)] = host_rows[src].to(out.device)
    return out


def sparse_mla_reference(
    q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor, scale: float
) -> torch.Tensor:
    """Absorbed sparse MLA decode in float32.

    Args:
        q_lat: ``[B, Q, H, rank]``; q_pe: ``[B, Q, H, rope]``.
        kv: ``[rows, rank + rope]`` values (already decoded to float).
        locations: ``[B, Q, K]`` int, ``-1`` = masked.
        scale: softmax scale.

    Returns:
        ``[B, Q, H, rank]`` float32; zeros for a query whose locations are all ``-1``.
    """
    rank = q_lat.shape[-1]
    rows = kv.float()[locations.clamp(min=0).long()]  # [B, Q, K, rank + rope]
    q = torch.cat([q_lat.float(), q_pe.float()], dim=-1)  # [B, Q, H, rank + rope]
    scores = torch.einsum("bqhd,bqkd->bqhk", q, rows) * scale
    scores = scores.masked_fill((locations < 0)[:, :, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bqhk,bqkd->bqhd", probs, rows[..., :rank])


def decode_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[n, 656]`` uint8 DeepSeek-V3.2 rows -> ``[n, 576]`` float32 (latent * per-128 scale, then rope)."""
    latent = rows[:, :FP8_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[:, FP8_RANK : FP8_RANK + 16].contiguous().view(torch.float32)
    rope = rows[:, FP8_RANK + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent * scales.repeat_interleave(128, dim=1), rope], dim=1)


def encode_fp8_rows(values: torch.Tensor) -> torch.Tensor:
    """``[n, 576]`` float -> ``[n, 656]`` uint8 rows (scale = amax / 448 per 128 latent values)."""
    latent = values[:, :FP8_RANK].float().view(-1, 4, 128)
    scales = (latent.abs().amax(dim=2) / 448.0).clamp(min=1e-12)
    quant = (latent / scales[..., None]).to(torch.float8_e4m3fn).view(-1, FP8_RANK)
    rope = values[:, FP8_RANK:].to(torch.bfloat16)
    return torch.cat(
        [quant.view(torch.uint8), scales.contiguous().view(torch.uint8), rope.contiguous().view(torch.uint8)],
        dim=1,
    )
