"""Qwen3 DSpark proposals (deepseek-ai/DeepSpec): a parallel block, a sequential Markov head, a confidence head.

Rule (DeepSpec ``forward_dspark_draft_block`` + ``build_dspark_proposal``): the block ``[last token, mask ×
(block - 1)]`` at positions ``p .. p + block - 1`` runs once through the backbone (the drafter's own embedding;
every layer full and bidirectional over context + block); every slot ``i`` drafts the token after slot ``i``'s
input, from ``base_i = lm_head(h_i)`` (the drafter's own head) plus the Markov head's bias for the previous token
(the last token for slot 0, else draft ``i - 1``), chosen left to right:

* ``vanilla``: ``bias = W2 W1[prev]``;
* ``gated``: ``bias = W2 (sigmoid(G [h_i, W1[prev]] + g) ⊙ W1[prev])``;
* ``rnn``: a GRU-like state ``s`` over the block, ``[gate, cand, out] = J [s, W1[prev], h_i] + j``,
  ``s <- σ(gate) s + (1 - σ(gate)) tanh(cand)``, ``bias = W2 tanh(out)``.

The confidence head gives one logit per slot, ``proj([h_i, W1[prev_i]])`` (or ``proj(h_i)``); the proposal is cut
before the first slot whose ``sigmoid`` is below the threshold (``proposal_law.confident_length``). The block always
has the checkpoint's size (as DeepSpec and vLLM run it); a smaller γ keeps the first γ drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.spec.proposal_law import choose

from .qwen_block import QwenBlockBackbone
from .qwen_config import QwenDrafterConfig
from .runtime_types import DraftOutput, ProposalContext


class QwenDSparkDrafter:
    """A loaded Qwen3 DSpark drafter (its own embedding and LM head, copies of the target's)."""

    def __init__(self, cfg: QwenDrafterConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg, self.w = cfg, weights
        self.backbone = QwenBlockBackbone(cfg, weights)
        self.fmt = cfg.fmt
        self.target_layer_ids = cfg.target_layer_ids
        self.max_gamma = cfg.max_gamma
        self.context_window = cfg.context_window
        self.row_values = self.backbone.row_values
        self.has_confidence = cfg.confidence_head

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone.context_rows(features, positions)

    def block(self, ctx: ProposalContext, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full block's hidden states ``[B, block, H]`` and base logits ``[B, block, V]``."""
        n = self.cfg.block_size
        ids = torch.cat((last_tokens.unsqueeze(1), last_tokens.new_full((last_tokens.shape[0], n - 1),
                                                                         self.cfg.mask_token_id)), dim=1)
        positions = ctx.start.unsqueeze(1) + torch.arange(n, device=ids.device)
        h = self.backbone.block_hidden(F.embedding(ids, self.w["embed_tokens.weight"]), positions, ctx.rows,
                                       ctx.positions, ctx.valid)
        return h, F.linear(h, self.w["lm_head.weight"])

    def markov_bias(self, previous: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias ``[B, V]`` for one slot from the previous tokens ``[B]`` and the slot's ``h [B, H]``."""
        w = self.w
        e = F.embedding(previous, w["markov_head.markov_w1.weight"])
        kind = self.cfg.markov_head_type
        if kind == "gated":
            gate = torch.sigmoid(F.linear(torch.cat((h, e), dim=-1), w["markov_head.gate_proj.weight"],
                                          w["markov_head.gate_proj.bias"]))
            e = gate.to(e.dtype) * e
        elif kind == "rnn":
            assert state is not None
            gate, candidate, out = F.linear(torch.cat((state, e, h), dim=-1), w["markov_head.joint_proj.weight"],
                                            w["markov_head.joint_proj.bias"]).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate)
            e = torch.tanh(out)
        return F.linear(e, w["markov_head.markov_w2.weight"]), state

    def propose(self, ctx: ProposalContext, last_tokens: torch.Tensor, gamma: int, temperature: torch.Tensor,
                u: torch.Tensor) -> DraftOutput:
        """Draft ``γ`` tokens left to right; ``temperature [B]``, ``u [B, γ]``."""
        h, base = self.block(ctx, last_tokens)
        rank = self.cfg.markov_rank
        state = h.new_zeros(h.shape[0], rank) if self.cfg.markov_head_type == "rnn" else None
        previous, tokens, laws, scores = last_tokens, [], [], []
        for i in range(gamma):  # sequential only through the rank-r head; batched over B
            logits = base[:, i]
            if rank:
                bias, state = self.markov_bias(previous, h[:, i], state)
                logits = logits + bias
            previous, q = choose(logits, temperature, u[:, i])
            tokens.append(previous)
            laws.append(q)
            scores.append(logits)
        draft = torch.stack(tokens, dim=1)
        return DraftOutput(draft, torch.stack(laws, dim=1), self.confidence(h[:, :gamma], last_tokens, draft),
                           torch.stack(scores, dim=1).to(torch.float64))

    def confidence(self, h: torch.Tensor, last_tokens: torch.Tensor, draft: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits ``[B, γ]`` (float32), or ``None`` without a confidence head."""
        if not self.cfg.confidence_head:
            return None
        features = h
        if self.cfg.confidence_with_markov:
            previous = torch.cat((last_tokens.unsqueeze(1), draft[:, :-1]), dim=1)
            features = torch.cat((h, F.embedding(previous, self.w["markov_head.markov_w1.weight"]).to(h.dtype)),
                                 dim=-1)
        return F.linear(features, self.w["confidence_head.proj.weight"],
                        self.w["confidence_head.proj.bias"]).squeeze(-1).float()
