"""DFlash and DFlash2 proposals (the target's embedding and LM head, one forward of a bidirectional block).

Rule (z-lab ``dflash_generate`` / vLLM's DFlash speculators): the block ``[last token, mask × γ]`` at positions
``p .. p + γ`` (``p`` the last token's position) runs once through the backbone over the ring's context rows;
the ``γ`` mask slots' hidden states give the drafts.

* DFlash: ``logits = lm_head_target(h)``; draft ``i`` is their argmax (or a draw at the request's temperature),
  each slot independently.
* DFlash2 (vLLM PR #52816): the target head's top-``K`` candidates per slot (values scaled by
  ``output_multiplier``, soft-capped when ``final_logit_softcapping`` is set), edge scores
  ``S[s, a, c] = unary[s, c] + <A[pred(a)] ⊙ P h_s, B[cand(c)]>`` (the predecessor of slot 0 is the last token,
  of slot ``s`` slot ``s-1``'s candidates), and a walk from candidate 0: slot ``s`` takes the best (first maximum)
  of row ``S[s, prev]`` — at ``T > 0`` a draw from ``softmax(S[s, prev] / T)``, which is also ``q`` over the
  vocabulary (zero outside the candidates).

The block holds ``1 + γ`` queries, as vLLM runs it for ``num_speculative_tokens = γ`` (and z-lab's reference for
``block_size = 1 + γ``); ``γ <= block_size - 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.spec.proposal_law import choose

from .qwen_block import QwenBlockBackbone
from .qwen_config import QwenDrafterConfig
from .runtime_types import DraftOutput, ProposalContext


class DFlashDrafter:
    """A loaded DFlash / DFlash2 drafter bound to the target's ``embed [V, H]`` and ``lm_head [V, H]``."""

    has_confidence = False

    def __init__(self, cfg: QwenDrafterConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.cfg, self.w = cfg, weights
        self.backbone = QwenBlockBackbone(cfg, weights)
        self.embed, self.lm_head = embed, lm_head
        self.fmt = cfg.fmt
        self.target_layer_ids = cfg.target_layer_ids
        self.max_gamma = cfg.max_gamma
        self.context_window = cfg.context_window
        self.row_values = self.backbone.row_values

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone.context_rows(features, positions)

    def hidden(self, ctx: ProposalContext, last_tokens: torch.Tensor, gamma: int) -> torch.Tensor:
        """The γ mask slots' final hidden states ``[B, γ, H]``."""
        b = last_tokens.shape[0]
        ids = torch.cat((last_tokens.unsqueeze(1), last_tokens.new_full((b, gamma), self.cfg.mask_token_id)), dim=1)
        x = F.embedding(ids, self.embed).to(self.backbone.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        positions = ctx.start.unsqueeze(1) + torch.arange(gamma + 1, device=ids.device)
        h = self.backbone.block_hidden(x, positions, ctx.rows, ctx.positions, ctx.valid)
        return h[:, 1:]

    def propose(self, ctx: ProposalContext, last_tokens: torch.Tensor, gamma: int, temperature: torch.Tensor,
                u: torch.Tensor) -> DraftOutput:
        """Draft ``γ`` tokens; ``temperature [B]``, ``u [B, γ]`` (``DraftOutput.confidence`` is ``None``)."""
        h = self.hidden(ctx, last_tokens, gamma)
        logits = F.linear(h, self.lm_head.to(h.dtype))
        if self.fmt == "dflash":
            draft, q = choose(logits, temperature.unsqueeze(1).expand(-1, gamma), u)
            return DraftOutput(draft, q, None, logits.to(torch.float64))
        ids, scores = self.edge_scores(h, logits, last_tokens)
        return self.walk(ids, scores, temperature, u)

    # ------------------------------------------------------------------------------------------- DFlash2
    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``K`` candidate ids ``[B, γ, K]`` and unary scores (float32, scaled, soft-capped)."""
        cfg = self.cfg
        values, ids = torch.topk(logits, cfg.selector_top_k, dim=-1)
        values = values.float() * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            values = torch.tanh(values / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return ids, values

    def edge_scores(self, h: torch.Tensor, logits: torch.Tensor, last_tokens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ``(candidate ids [B, γ, K], scores [B, γ, K_prev, K])``."""
        ids, unary = self.candidates(logits)
        k = self.cfg.selector_top_k
        hidden = F.linear(h, self.w["candidate_selector.hidden_projection.weight"])  # [B, γ, r]
        successors = self.w["candidate_selector.successor_codebook"][ids]  # [B, γ, K, r]
        pred_ids = torch.cat((last_tokens[:, None, None].expand(-1, 1, k), ids[:, :-1]), dim=1)
        predecessors = self.w["candidate_selector.predecessor_codebook"][pred_ids]
        pair = torch.einsum("blpr,blcr->blpc", predecessors * hidden.unsqueeze(2), successors)
        return ids, unary.unsqueeze(2) + pair

    def walk(self, ids: torch.Tensor, scores: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
             ) -> DraftOutput:
        """The selector's path (sequential over γ, batched over B)."""
        b, gamma, k = ids.shape
        rows = torch.arange(b, device=ids.device)
        greedy = temperature <= 0
        previous = torch.zeros(b, dtype=torch.int64, device=ids.device)
        tokens, laws, rows_out = [], [], []
        for s in range(gamma):
            row = scores[rows, s, previous]  # [B, K]
            full = row.new_full((b, self.embed.shape[0]), float("-inf")).scatter(1, ids[:, s], row)
            drawn, q = choose(full, temperature, u[:, s])
            best = row.argmax(dim=-1)
            index = torch.where(greedy, best, (ids[:, s] == drawn.unsqueeze(1)).long().argmax(dim=-1))
            token = ids[rows, s, index]
            point = torch.zeros_like(q).scatter_(1, token.unsqueeze(1), 1.0)
            laws.append(torch.where(greedy.unsqueeze(1), point, q))
            tokens.append(token)
            rows_out.append(full)
            previous = index
        return DraftOutput(torch.stack(tokens, dim=1), torch.stack(laws, dim=1), None,
                           torch.stack(rows_out, dim=1).to(torch.float64))
