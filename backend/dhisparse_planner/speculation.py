"""Speculation as the planner models it: accepted length per verification step, and the load-aware
shortening rule of a DSpark-style drafter.

Acceptance: each of the ``gamma`` draft tokens of a block is accepted with probability ``alpha(L)`` given the
previous ones were (``L`` = context length in real tokens); the step emits the accepted prefix plus one bonus
token, so the accepted length ``a`` is ``1 + min(G, q - 1)`` with ``G`` geometric. ``alpha`` may decay with
context: ``alpha(L) = max(min_accept_prob, accept_prob - decay_per_doubling * log2(max(1, L / ref_context)))``.

Shortening (DSpark, ``dhisparse.spec.drafters.dspark.confident_prefix_length``): when the batch holds at least
``busy_batch`` requests, only the leading draft tokens whose cumulative confidence ``prod_{j<=i} c_j`` is at
least ``min_confidence`` are verified. The planner takes the confidence head as calibrated (``c_j = alpha``),
so the verified draft length is ``floor(log(min_confidence) / log(alpha))`` capped at ``gamma``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dhisparse import defaults
from dhisparse_planner.specs import DRAFTERS


@dataclass(frozen=True)
class SpeculationModel:
    """Attributes:
        drafter: ``dflash2`` or ``dspark`` (see :class:`dhisparse_planner.specs.DrafterSpec`).
        gamma: draft tokens per block (verification length ``gamma + 1``).
        accept_prob: per-token acceptance at ``ref_context_tokens`` (0..1).
        decay_per_doubling: acceptance lost per doubling of context beyond ``ref_context_tokens``.
        ref_context_tokens: context length (real tokens) where ``accept_prob`` holds.
        min_accept_prob: floor of the decayed acceptance.
        busy_batch: batch size from which a DSpark scheduler shortens verification (0: never; default: the
            engine's ``dspark_busy_batch``).
        min_confidence: cumulative-confidence threshold used when busy (0..1; the engine's
            ``dspark_busy_confidence``).
    """

    drafter: str = "dflash2"
    gamma: int = defaults.NUM_DRAFT_TOKENS
    accept_prob: float = 0.75
    decay_per_doubling: float = 0.03
    ref_context_tokens: int = 4096
    min_accept_prob: float = 0.3
    busy_batch: int = defaults.DSPARK_BUSY_BATCH
    min_confidence: float = 0.3

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpeculationModel.drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        for name in ("accept_prob", "min_accept_prob", "min_confidence"):
            if not 0.0 <= getattr(self, name) < 1.0 + (name == "min_confidence"):
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.decay_per_doubling < 0 or self.ref_context_tokens < 1 or self.busy_batch < 0:
            raise ValueError("decay_per_doubling >= 0, ref_context_tokens >= 1 and busy_batch >= 0 required")

    @property
    def max_query_len(self) -> int:
        return self.gamma + 1

    def accept_prob_at(self, context_tokens: torch.Tensor) -> torch.Tensor:
        """``alpha(L)`` for real context lengths ``[B]`` (float64)."""
        ratio = torch.clamp(context_tokens.to(torch.float64) / self.ref_context_tokens, min=1.0)
        return torch.clamp(self.accept_prob - self.decay_per_doubling * torch.log2(ratio), min=self.min_accept_prob)

    def verify_lengths(self, context_tokens: torch.Tensor, batch: int) -> torch.Tensor:
        """Verification length ``q`` per request ``[B]`` int64 (1 + verified draft tokens), after shortening."""
        full = torch.full_like(context_tokens, self.max_query_len, dtype=torch.int64)
        if not DRAFTERS[self.drafter].confidence_head or self.busy_batch == 0 or batch < self.busy_batch:
            return full
        alpha = self.accept_prob_at(context_tokens)
        if self.min_confidence <= 0.0:
            return full
        # cumulative confidence alpha^i >= threshold  <=>  i <= log(threshold) / log(alpha)
        log_alpha = torch.log(alpha.clamp(max=1 - 1e-12))
        drafts = torch.where(alpha > 0, torch.floor(math.log(self.min_confidence) / log_alpha), torch.zeros_like(alpha))
        return 1 + drafts.clamp(min=0, max=self.gamma).to(torch.int64)

    def sample_accepted(self, query_lens: torch.Tensor, context_tokens: torch.Tensor,
                        generator: torch.Generator) -> torch.Tensor:
        """Accepted length per request ``[B]`` int64 in ``1 .. q``: leading accepted drafts + the bonus token."""
        alpha = self.accept_prob_at(context_tokens)
        draws = torch.rand(len(query_lens), self.gamma, generator=generator, dtype=torch.float64)
        ok = (draws < alpha.unsqueeze(1)).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return 1 + torch.minimum(ok, query_lens - 1)


def confident_prefix_length(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """The shortening rule on explicit confidences ``[B, gamma]`` (same rule as the DSpark drafter's)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return (torch.cumprod(confidence, dim=1) >= threshold).long().cumprod(dim=1).sum(dim=1)
