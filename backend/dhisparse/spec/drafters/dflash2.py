"""DFlash2-style block drafter: one forward pass proposes a whole block of gamma tokens.

Proposal rule. The target's hidden states at the latest ``window`` context positions (outputs of the layers in
``config.target_layer_ids``, concatenated) are fused into one vector per position and injected, as keys and
values, into every drafter layer. The block is ``[embed(last_token), mask, mask, ...]`` (gamma entries, the last
accepted token followed by gamma - 1 mask placeholders); each block entry attends to the context and,
causally, to the block entries before it. Output ``i`` of the block is the draft for the token after
``last_token`` at offset ``i``. Causal attention inside the block makes a gamma-block exactly the prefix of a
larger block, so one trained model serves every gamma in ``1..max_block``.

Draft KV. Per context position the drafter keeps, for each of its layers, un-rotated K and V
(``[num_layers, 2, hidden_size]``, :attr:`DFlash2Config.ring_row_values` values); RoPE is applied at proposal
time from relative positions, so a ring buffer of the latest ``window`` rows is all the engine needs to keep.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Proposal, check_features, check_gamma, choose_tokens
from .config import DFlash2Config
from .layers import DraftBlock, rope_tables


class DFlash2Drafter(nn.Module):
    drafter_type = "dflash2"

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.feature_norm = nn.RMSNorm(config.feature_size, eps=config.rms_norm_eps)
        self.feature_proj = nn.Linear(config.feature_size, d, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.02)
        self.layers = nn.ModuleList(
            DraftBlock(d, config.num_heads, config.intermediate_size, config.rms_norm_eps)
            for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)

    @property
    def window(self) -> int:
        return self.config.window

    def context_kv(self, context_features: torch.Tensor) -> torch.Tensor:
        """Draft KV of context positions: [B, L, F] target features -> [B, L, num_layers, 2, hidden_size].

        Row ``j`` depends only on feature row ``j``, so rows can be computed once per position and kept in a ring.
        """
        fused = self.feature_proj(self.feature_norm(context_features))
        return torch.stack([layer.context_kv(fused) for layer in self.layers], dim=2)

    def block_logits(
        self,
        context_kv: torch.Tensor,
        last_tokens: torch.Tensor,
        gamma: int,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of a gamma-block: [B, gamma, V] float32.

        context_kv:   [B, L, num_layers, 2, hidden_size], L <= window, oldest first; row L-1 belongs to the
                      position just before ``last_tokens``.
        last_tokens:  [B] int64, the last accepted token of each request.
        context_mask: [B, L] bool, False for rows a request does not have (left padding), or None (all valid).
        """
        batch, length = context_kv.shape[0], context_kv.shape[1]
        if length > self.config.window:
            raise ValueError(f"context of {length} positions exceeds the drafter window {self.config.window}")
        check_gamma(gamma, self.config.max_block)
        first = self.embed_tokens(last_tokens)[:, None]
        x = torch.cat([first, self.mask_embedding.to(first.dtype).expand(batch, gamma - 1, -1)], dim=1)
        positions = torch.arange(-length, gamma, device=x.device)[None]
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        causal = torch.ones(gamma, gamma, dtype=torch.bool, device=x.device).tril()
        visible = (
            torch.ones(batch, length, dtype=torch.bool, device=x.device)
            if context_mask is None
            else context_mask.to(torch.bool)
        )
        mask = torch.cat([visible[:, None, :].expand(batch, gamma, length), causal.expand(batch, -1, -1)], dim=2)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, mask, context_kv[:, :, index])
        return self.lm_head(self.norm(x)).float()

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
        """Draft gamma tokens per request in one forward pass.

        context_features: [B, L, F] target features (F = ``config.feature_size``) of the latest context
            positions, oldest first, the last row being the position just before ``last_tokens``. Only the
            last ``window`` rows are read; earlier rows have no effect.
        last_tokens: [B] int64. gamma: 1..max_block. context_mask: [B, L] bool or None.
        Returns a :class:`Proposal` with ``confidence=None``.
        """
        check_features(context_features, last_tokens, self.config.feature_size)
        context_features = context_features[:, -self.config.window :]
        if context_mask is not None:
            context_mask = context_mask[:, -self.config.window :]
        with torch.no_grad():
            logits = self.block_logits(self.context_kv(context_features), last_tokens, gamma, context_mask)
        tokens, probs = choose_tokens(logits, temperature, generator)
        return Proposal(tokens, probs, None)
