"""Greedy acceptance of a drafter, replayed against a target's greedy continuation.

At temperature 0 speculative decoding emits exactly the target's greedy continuation, and every verification
step sees the target hidden states of that same token sequence. So, given a prompt, the target's greedy
continuation and the target features of the whole sequence (one target forward), the verification steps can be
replayed exactly without an engine: at each step the drafter sees the features of positions ``< pos`` and
the token at ``pos`` (the last accepted one), proposes gamma tokens, the leading matches with the continuation
are accepted, and the target adds one bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dspark import confident_prefix_length
from .io import Drafter


@dataclass(frozen=True)
class AcceptanceResult:
    gamma: int
    steps: int  # verification steps replayed
    emitted: int  # tokens emitted by those steps (accepted drafts + one bonus token each)
    verified: int  # draft positions sent to verification (gamma per step unless a confidence threshold cut it)

    @property
    def tokens_per_step(self) -> float:
        """Mean accepted tokens per verification step, counting the bonus token (1.0 = no gain)."""
        return self.emitted / max(self.steps, 1)

    @property
    def verified_per_step(self) -> float:
        """Mean draft positions verified per step (the target forward covers this + 1 positions)."""
        return self.verified / max(self.steps, 1)


def replay_greedy(
    drafter: Drafter,
    tokens: torch.Tensor,
    features: torch.Tensor,
    prompt_length: int,
    gamma: int,
    confidence_threshold: float | None = None,
) -> AcceptanceResult:
    """tokens: [B, T] int64 prompt + greedy continuation (the token at ``prompt_length`` is the prefill's output);
    features: [B, T, F] target features of those tokens. Rows advance independently; a row stops when fewer
    than ``gamma + 1`` continuation tokens remain, so only complete verification steps are counted.

    With ``confidence_threshold`` (drafters with a confidence head), each step verifies only
    :func:`confident_prefix_length` drafts, as a load-aware scheduler would."""
    batch, total = tokens.shape
    window = drafter.window
    if prompt_length < window:
        raise ValueError(f"prompt_length {prompt_length} is shorter than the drafter window {window}")
    pos = torch.full((batch,), prompt_length, dtype=torch.long)  # position of the last accepted token
    rows = torch.arange(batch)
    steps = emitted = verified = 0
    while True:
        active = pos + gamma < total
        if not bool(active.any()):
            break
        p = torch.where(active, pos, torch.full_like(pos, prompt_length))
        context = features[rows[:, None], p[:, None] + torch.arange(-window, 0)]  # [B, window, F]
        proposal = drafter.propose(context, tokens[rows, p], gamma)
        truth = tokens[rows[:, None], p[:, None] + 1 + torch.arange(gamma)]
        accepted = (proposal.tokens == truth).long().cumprod(dim=1).sum(dim=1)
        length = torch.full_like(accepted, gamma)
        if confidence_threshold is not None:
            if proposal.confidence is None:
                raise ValueError("confidence_threshold needs a drafter with a confidence head")
            length = confident_prefix_length(proposal.confidence, confidence_threshold)
        accepted = torch.minimum(accepted, length)
        advance = torch.where(active, accepted + 1, torch.zeros_like(accepted))
        steps += int(active.sum())
        emitted += int(advance.sum())
        verified += int(length[active].sum())
        pos = pos + advance
    return AcceptanceResult(gamma=gamma, steps=steps, emitted=emitted, verified=verified)
