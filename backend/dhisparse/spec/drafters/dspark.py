"""DSpark-style drafter: a parallel draft backbone, a low-rank Markov head and a confidence head.

Proposal rule.
* Backbone (parallel): the target feature of the latest context position plus the embedding of the last
  accepted token give one vector ``z``; ``gamma`` slots ``z + slot_embedding[i]`` pass through a small causal
  transformer at once, giving ``h_i`` and base logits ``W h_i`` for every block offset ``i``.
* Markov head (rank r): the logits of block token ``i`` get ``B (A[t_{i-1}] * G h_i)``, where ``t_{i-1}`` is the
  previous token of the block (``last_token`` for ``i = 0``), ``A`` is a [V, r] table, ``G`` [r, hidden] and ``B``
  [V, r]: a rank-r bigram term, modulated by the slot state, that links consecutive draft tokens. Tokens are
  chosen left to right through this head only (gamma tiny [B, r] steps, vectorised over the batch).
* Confidence head: ``sigmoid(MLP([h_i, max_prob_i, entropy_i]))`` estimates the chance that draft token ``i``
  matches the target given that the tokens before it did; :func:`confident_prefix_length` turns it into a
  shorter verification block for a load-aware scheduler.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Proposal, check_features, check_gamma, choose_tokens
from .config import DSparkConfig
from .layers import DraftBlock, rope_tables


class DSparkDrafter(nn.Module):
    drafter_type = "dspark"

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        d, r = config.hidden_size, config.markov_rank
        self.feature_norm = nn.RMSNorm(config.feature_size, eps=config.rms_norm_eps)
        self.feature_proj = nn.Linear(config.feature_size, d, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.slot_embedding = nn.Parameter(torch.randn(config.max_block, d) * 0.02)
        self.layers = nn.ModuleList(
            DraftBlock(d, config.num_heads, config.intermediate_size, config.rms_norm_eps)
            for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.markov_in = nn.Embedding(config.vocab_size, r)
        self.markov_gate = nn.Linear(d, r, bias=False)
        self.markov_out = nn.Linear(r, config.vocab_size, bias=False)
        self.confidence_head = nn.Sequential(
            nn.Linear(d + 2, config.confidence_hidden), nn.SiLU(), nn.Linear(config.confidence_hidden, 1)
        )

    @property
    def window(self) -> int:
        return 1

    def backbone(
        self, last_features: torch.Tensor, last_tokens: torch.Tensor, gamma: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """last_features: [B, F]; last_tokens: [B] -> (slot states h [B, gamma, hidden], base logits [B, gamma, V])."""
        check_gamma(gamma, self.config.max_block)
        z = self.feature_proj(self.feature_norm(last_features)) + self.embed_tokens(last_tokens)
        x = z[:, None] + self.slot_embedding[:gamma].to(z.dtype)
        rope = rope_tables(torch.arange(gamma, device=x.device)[None], self.config.head_dim, self.config.rope_theta)
        causal = torch.ones(gamma, gamma, dtype=torch.bool, device=x.device).tril()[None]
        for layer in self.layers:
            x = layer(x, rope, causal)
        h = self.norm(x)
        return h, self.lm_head(h).float()

    def markov_logits(self, h: torch.Tensor, previous_tokens: torch.Tensor) -> torch.Tensor:
        """h: [B, N, hidden]; previous_tokens: [B, N] (token before each slot) -> [B, N, V] float32 Markov term."""
        return self.markov_out(self.markov_in(previous_tokens) * self.markov_gate(h)).float()

    def confidence(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """h: [B, N, hidden]; logits: [B, N, V] (temperature 1) -> [B, N] float32 acceptance estimate."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        stats = torch.stack([logp.max(-1).values.exp(), -(logp.exp() * logp).sum(-1)], dim=-1)
        features = torch.cat([h, stats.to(h.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head(features).float().squeeze(-1))

    def teacher_forced_logits(
        self, context_features: torch.Tensor, last_tokens: torch.Tensor, block_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits when block tokens are given (training, tests): block_tokens [B, gamma] ->
        (logits [B, gamma, V] float32, slot states h [B, gamma, hidden])."""
        check_features(context_features, last_tokens, self.config.feature_size)
        h, base = self.backbone(context_features[:, -1], last_tokens, block_tokens.shape[1])
        previous = torch.cat([last_tokens[:, None], block_tokens[:, :-1]], dim=1)
        return base + self.markov_logits(h, previous), h

    def propose(
        self,
        context_features: torch.Tensor,
        last_tokens: torch.Tensor,
        gamma: int,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> Proposal:
        """Draft gamma tokens per request.

        context_features: [B, L, F] target features, the last row being the position just before
            ``last_tokens``; only that last row is read (``window`` is 1). last_tokens: [B] int64.
        context_mask is accepted for API symmetry and ignored (the last row always exists).
        Returns a :class:`Proposal` with confidence [B, gamma].
        """
        check_features(context_features, last_tokens, self.config.feature_size)
        with torch.no_grad():
            h, base = self.backbone(context_features[:, -1], last_tokens, gamma)
            previous = last_tokens
            tokens, probs, logits = [], [], []
            for i in range(gamma):  # sequential only through the rank-r head; batched over B
                step_logits = base[:, i] + self.markov_logits(h[:, i : i + 1], previous[:, None])[:, 0]
                previous, step_probs = choose_tokens(step_logits, temperature, generator)
                tokens.append(previous)
                probs.append(step_probs)
                logits.append(step_logits)
            confidence = self.confidence(h, torch.stack(logits, dim=1))
        return Proposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1), confidence)


def confident_prefix_length(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Verification length per request for a load-aware scheduler.

    confidence: [B, gamma] per-position acceptance estimates (conditional on the earlier positions).
    Returns [B] int64: the number of leading draft tokens whose cumulative acceptance estimate
    ``prod_{j<=i} confidence[:, j]`` is at least ``threshold`` (0 means: verify no draft, decode plainly).
    A busy scheduler raises ``threshold``; ``threshold = 0`` keeps every draft token.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return (torch.cumprod(confidence, dim=1) >= threshold).long().cumprod(dim=1).sum(dim=1)
