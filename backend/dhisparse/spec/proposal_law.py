"""How a draft token is chosen from a drafter's scores, and the proposal law ``q`` verification needs.

Greedy rows (``temperature == 0``) take the argmax (the first maximum) and ``q`` is its point mass. Sampled rows
draw from ``softmax(scores / T)`` by inverse CDF with the engine's counter-based uniform ``u``; ``q`` is that
softmax. ``q`` goes to ``rejection_accept``, which keeps the target's law whatever ``q`` is.
"""

from __future__ import annotations

import torch

from dhisparse.sampling.sampler import sample_from


def choose(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [..., V]``, ``temperature [...]`` (broadcast), ``u [...]`` -> ``(tokens [...], q [..., V] float64)``."""
    logits = logits.to(torch.float64)
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float64)
    soft = torch.softmax(logits / safe_t.unsqueeze(-1), dim=-1)
    best = logits.argmax(dim=-1)
    point = torch.zeros_like(soft).scatter_(-1, best.unsqueeze(-1), 1.0)
    q = torch.where(greedy.unsqueeze(-1), point, soft)
    flat_q = q.reshape(-1, q.shape[-1])
    drawn = sample_from(flat_q, u.reshape(-1)).view(best.shape)
    return torch.where(greedy, best, drawn), q


def confident_length(confidence_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """DSpark's published cut (DeepSpec ``_confident_prefix_length``): the drafts before the first position whose
    ``sigmoid(confidence)`` is below ``threshold`` (all of them when none is, or ``threshold <= 0``).
    ``confidence_logits [B, g]`` -> ``[B]`` int64."""
    g = confidence_logits.shape[1]
    if threshold <= 0.0:
        return torch.full(confidence_logits.shape[:1], g, dtype=torch.int64, device=confidence_logits.device)
    below = torch.sigmoid(confidence_logits.float()) < threshold
    return (~below).long().cumprod(dim=1).sum(dim=1)
