"""Speculation with a published drafter: its context rows in the draft ring, proposals, the confidence cut.

The ring holds, per request, the drafter's rows of exactly the positions it can see: the last
``context_window`` positions (a sliding-window drafter), or the whole history up to ``max_context`` (a drafter with
a full-attention layer). Row ``j`` of a request belongs to absolute position ``p`` with ``p % window == j``, so the
ring's count is the request's length and every row is computed once, when its position is verified.
"""

from __future__ import annotations

import torch

from dhisparse.host_values import to_device
from dhisparse.sampling.sampler import uniform
from dhisparse.spec.proposal_law import confident_length
from dhisparse.spec.ring import DraftRing

from .runtime_types import ProposalContext, PublishedDrafter


class PublishedSpeculation:
    """Ring + proposals of one published drafter for up to ``max_slots`` requests (vectorised over a batch)."""

    def __init__(self, drafter: PublishedDrafter, gamma: int, max_slots: int, max_context: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.drafter, self.gamma, self.device = drafter, gamma, device
        window = drafter.context_window if drafter.context_window is not None else max_context
        self.window = max(1, min(window, max_context))
        self.ring = DraftRing(max_slots, self.window, drafter.row_values, dtype, device)

    def _rows(self, features: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        positions = first.unsqueeze(1) + torch.arange(features.shape[1], device=self.device)
        with torch.no_grad():
            return self.drafter.context_rows(features, positions)

    def start(self, prompt_features: torch.Tensor) -> int:
        """A ring for a new request, holding its prompt's last ``window`` positions (``prompt_features [P, F]``)."""
        slot = self.ring.allocate()
        length = prompt_features.shape[0]
        n = min(length, self.window)
        self.ring.count[slot] = length - n  # the ring's count is the absolute position of the next row
        slots, first, kept = to_device([[slot], [length - n], [n]], torch.int64, self.device).unbind(0)
        self.ring.append(slots, self._rows(prompt_features[-n:].unsqueeze(0), first), kept)
        return slot

    def advance(self, slots: torch.Tensor, features: torch.Tensor, kept: torch.Tensor) -> None:
        """Rows of the first ``kept[b]`` verified positions (``features [B, Q, F]``, from the last token on)."""
        self.ring.append(slots, self._rows(features, self.ring.count[slots]), kept)

    def context(self, slots: torch.Tensor) -> ProposalContext:
        rows, valid = self.ring.context(slots)
        start = self.ring.count[slots]
        positions = start.unsqueeze(1) - self.window + torch.arange(self.window, device=self.device)
        return ProposalContext(rows, positions, valid, start)

    def propose(self, slots: torch.Tensor, last_tokens: torch.Tensor, threshold: float, temperature: torch.Tensor,
                seeds: torch.Tensor, counters: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """As ``Speculator.propose``: ``(draft [B, γ], q [B, γ, V], lengths [B], confidence [B, γ] or None)``;
        ``confidence`` is ``sigmoid`` of the drafter's confidence logits, ``lengths`` its published cut at
        ``threshold`` (the scheduler's load-aware choice; 0: no cut)."""
        steps = counters.unsqueeze(1) + torch.arange(self.gamma, device=self.device)
        u = uniform(seeds.unsqueeze(1).expand_as(steps), steps, stream=3)
        with torch.no_grad():
            draft, q, logits, _ = self.drafter.propose(self.context(slots), last_tokens, self.gamma, temperature, u)
        if logits is None:
            return draft, q, torch.full((slots.shape[0],), self.gamma, dtype=torch.int64, device=self.device), None
        return draft, q, confident_length(logits, threshold), torch.sigmoid(logits)
