"""What a published drafter's proposal reads from the draft ring."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class ProposalContext(NamedTuple):
    """The ring's rows of a batch, oldest first: ``rows [B, W, row_values]``, their absolute ``positions [B, W]``,
    ``valid [B, W]`` (False for slots the request has not filled), and ``start [B]``: the position of the last
    token, where the proposal's block begins (every ring row is at a position below it)."""

    rows: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor


class DraftOutput(NamedTuple):
    """One proposal: ``tokens [B, γ]``, ``q [B, γ, V]`` float64 (the law each token was drawn from; a point mass
    for greedy rows), ``confidence`` logits ``[B, γ]`` float32 or ``None``, and ``scores [B, γ, V]``: the scores
    each choice was made from, along the chosen path (logits; the selector's row for DFlash2, ``-inf`` outside
    its candidates)."""

    tokens: torch.Tensor
    q: torch.Tensor
    confidence: torch.Tensor | None
    scores: torch.Tensor


class PublishedDrafter(Protocol):
    """A loaded published drafter as the speculator drives it."""

    fmt: str
    target_layer_ids: tuple[int, ...]
    max_gamma: int
    context_window: int | None  # ring rows it can read; None = the whole history
    row_values: int
    has_confidence: bool

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``features [B, N, F]`` at ``positions [B, N]`` -> ring rows ``[B, N, row_values]``."""

    def propose(self, ctx: ProposalContext, last_tokens: torch.Tensor, gamma: int, temperature: torch.Tensor,
                u: torch.Tensor) -> DraftOutput:
        """Draft ``γ`` tokens after ``last_tokens [B]``; ``temperature [B]`` (0: greedy), uniforms ``u [B, γ]``."""
