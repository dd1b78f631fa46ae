"""Exact acceptance rules of speculative decoding (pure functions, vectorised over the batch).

Notation for one request: the verification forward scores the last accepted token followed by draft tokens
``d_1 … d_g``; ``p_i`` is the target's sampling distribution after position ``i`` (``i = 0 … g``), ``q_i`` the
distribution ``d_i`` was drawn from.

* Greedy (temperature 0): accept the longest prefix with ``d_{i+1} == argmax p_i``; the next token is
  ``argmax p_n`` at the first mismatch ``n`` (or the bonus ``argmax p_g``). The output equals plain greedy decoding.
* Sampling: accept ``d_{i+1}`` with probability ``min(1, p_i(d) / q_i(d))``; at the first rejection ``n`` draw from
  the residual ``norm(max(p_n − q_n, 0))``; if all ``g`` are accepted draw the bonus from ``p_g``. Each emitted
  token is then distributed exactly as the target's sampling distribution (Leviathan et al., 2023; Chen et al.,
  2023) — the output distribution does not change.
"""

from __future__ import annotations

import torch

from dhisparse.sampling.sampler import sample_from


def greedy_accept(target_logits: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_logits [B, Q, V]``, ``draft [B, Q-1]``, ``lengths [B]`` (drafts each request verifies, ≤ Q-1)
    → ``(accepted [B] int64, next_token [B])``."""
    best = target_logits.argmax(dim=-1)  # [B, Q]
    q = draft.shape[1]
    match = (draft == best[:, :q]) & (torch.arange(q, device=draft.device).unsqueeze(0) < lengths.unsqueeze(1))
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, best.gather(1, accepted.unsqueeze(1)).squeeze(1)


def rejection_accept(
    target_probs: torch.Tensor,
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_next: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling.

    ``target_probs [B, Q, V]`` (p_0 … p_{Q-1}), ``draft [B, Q-1]``, ``draft_probs [B, Q-1, V]`` (q_1 …),
    ``lengths [B]``, uniforms ``u_accept [B, Q-1]`` and ``u_next [B]`` in [0, 1) → ``(accepted [B], next_token [B])``.
    """
    g = draft.shape[1]
    p_d = target_probs[:, :g].gather(2, draft.unsqueeze(-1)).squeeze(-1)
    q_d = draft_probs.gather(2, draft.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(q_d > 0, p_d / q_d.clamp(min=1e-300), torch.zeros_like(p_d))
    ok = (u_accept < ratio.clamp(max=1.0)) & (torch.arange(g, device=draft.device).unsqueeze(0) < lengths.unsqueeze(1))
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(draft.shape[0], device=draft.device)
    p_n = target_probs[rows, accepted]  # [B, V]
    rejected = accepted < lengths
    q_n = draft_probs[rows, accepted.clamp(max=g - 1)] if g > 0 else torch.zeros_like(p_n)
    residual = (p_n - q_n).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; then rejection had probability 0, and p itself is the right law.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), p_n)
    dist = torch.where(rejected.unsqueeze(-1), residual, p_n)
    return accepted, sample_from(dist, u_next)
