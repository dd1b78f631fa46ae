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

from .io import Drafter


@dataclass(frozen=True)
class AcceptanceResult:
    gamma: int
    steps: int  # verification steps replayed
    emitted: int  # tokens emitted by those steps (accepted drafts + one bonus token each)

    @property
    def tokens_per_step(self) -> float:
        """Mean accepted tokens per verification step, counting the bonus token (1.0 = no gain)."""
        return self.emitted / max(self.steps, 1)


def replay_greedy(
    drafter: Drafter, tokens: torch.Tensor, features: torch.Tensor, prompt_length: int, gamma: int
) -> AcceptanceResult:
    """tokens: [B, T] int64 prompt + greedy continuation (the token at ``prompt_length`` is the prefill's output);
    features: [B, T, F] target features of those tokens. Rows advance independently; a row stops when fewer
    than ``gamma + 1`` continuation tokens remain, so only complete verification steps are counted."""
    batch, total = tokens.shape
    window = drafter.window
    if prompt_length < window:
        raise ValueError(f"prompt_length {prompt_length} is shorter than the drafter window {window}")
    pos = torch.full((batch,), prompt_length, dtype=torch.long)  # position of the last accepted token
    rows = torch.arange(batch)
    steps = emitted = 0
    while True:
        active = pos + gamma < total
        if not bool(active.any()):
            break
        p = torch.where(active, pos, torch.full_like(pos, prompt_length))
        context = features[rows[:, None], p[:, None] + torch.arange(-window, 0)]  # [B, window, F]
        draft = drafter.propose(context, tokens[rows, p], gamma).tokens  # [B, gamma]
        truth = tokens[rows[:, None], p[:, None] + 1 + torch.arange(gamma)]
        accepted = (draft == truth).long().cumprod(dim=1).sum(dim=1)
        advance = torch.where(active, accepted + 1, torch.zeros_like(accepted))
        steps += int(active.sum())
        emitted += int(advance.sum())
        pos = pos + advance
    return AcceptanceResult(gamma=gamma, steps=steps, emitted=emitted)
