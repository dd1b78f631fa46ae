"""What every drafter returns, and the one sampling rule both use."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Proposal(NamedTuple):
    """A block of draft tokens for a batch of B requests (unpacks as ``tokens, probs, confidence``).

    tokens:     [B, gamma] int64, the drafted token ids.
    probs:      [B, gamma, V] float32, the distribution each token was drawn from (rows sum to 1); at
                temperature 0 the softmax of the logits at temperature 1, with ``tokens`` its argmax. These are the
                ``q`` of lossless rejection sampling (accept with ``min(1, p/q)``, resample from ``max(p - q, 0)``).
    confidence: [B, gamma] float32 in (0, 1) -- the drafter's estimate that draft token ``i`` equals the target's
                (greedy) token given that tokens ``< i`` were accepted -- or None when the drafter has no
                confidence head.
    """

    tokens: torch.Tensor
    probs: torch.Tensor
    confidence: torch.Tensor | None


def choose_tokens(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [..., V] -> (tokens [...] int64, probs [..., V] float32).

    temperature 0: greedy (argmax; ``probs`` is softmax at temperature 1). temperature > 0: one multinomial
    draw per row from ``softmax(logits / temperature)``, which is also the returned ``probs``.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        probs = torch.softmax(logits, dim=-1)
        return logits.argmax(dim=-1), probs
    probs = torch.softmax(logits / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return tokens, probs


def check_gamma(gamma: int, max_block: int) -> None:
    if not 1 <= gamma <= max_block:
        raise ValueError(f"gamma must be in 1..{max_block} for this drafter, got {gamma}")


def check_features(context_features: torch.Tensor, last_tokens: torch.Tensor, feature_size: int) -> None:
    if context_features.dim() != 3 or context_features.shape[-1] != feature_size:
        raise ValueError(f"context_features must be [B, L, {feature_size}], got {tuple(context_features.shape)}")
    if context_features.shape[1] < 1:
        raise ValueError("context_features must hold at least one position")
    if last_tokens.shape != (context_features.shape[0],):
        raise ValueError(f"last_tokens must be [B={context_features.shape[0]}], got {tuple(last_tokens.shape)}")
