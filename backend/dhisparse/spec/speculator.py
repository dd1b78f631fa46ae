"""Glue between the engine and a drafter: context rows in the draft ring, proposals, load-aware verification length.

Both drafters propose **greedily** (``d_i = argmax``). For sampled requests the proposal distribution is then the
point mass ``q_i = δ(d_i)``, and ``rejection_accept`` with that ``q`` is exact speculative sampling: accept ``d``
with probability ``p(d)``, otherwise draw from ``p`` restricted to the other tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dhisparse.errors import ConfigError
from dhisparse.model.config import ModelConfig
from dhisparse.spec.drafters import DFlash2Drafter, DSparkDrafter, confident_prefix_length, load_drafter
from dhisparse.spec.ring import DraftRing


class Speculator:
    def __init__(
        self,
        drafter_dir: Path,
        gamma: int,
        max_slots: int,
        target: ModelConfig,
        device: torch.device,
        *,
        min_confidence: float = 0.0,
        busy_confidence: float = 0.3,
        busy_batch: int = 8,
    ) -> None:
        if not drafter_dir.is_dir():
            raise ConfigError(f"speculative decoding needs a drafter at {drafter_dir}; pack one with "
                              f"`dhisparse-build … --drafter DIR`")
        self.drafter = load_drafter(drafter_dir, device=device)
        cfg = self.drafter.config
        self.kind = self.drafter.drafter_type
        if cfg.target_hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter {drafter_dir} was made for hidden size {cfg.target_hidden_size} / vocab "
                              f"{cfg.vocab_size}, the target has {target.hidden_size} / {target.vocab_size}")
        if max(cfg.target_layer_ids) >= target.num_hidden_layers:
            raise ConfigError(f"drafter reads target layer {max(cfg.target_layer_ids)}, the target has "
                              f"{target.num_hidden_layers} layers")
        if not 1 <= gamma <= cfg.max_block:
            raise ConfigError(f"num_draft_tokens must be in 1..{cfg.max_block} for this drafter, got {gamma}")
        self.gamma, self.device = gamma, device
        self.layers = tuple(cfg.target_layer_ids)
        self.min_confidence, self.busy_confidence, self.busy_batch = min_confidence, busy_confidence, busy_batch
        if isinstance(self.drafter, DFlash2Drafter):
            row_values = cfg.ring_row_values
        else:
            row_values = cfg.feature_size
        self.ring = DraftRing(max_slots, self.drafter.window, row_values, torch.float32, device)

    # ------------------------------------------------------------------------------------------ features
    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Concatenate captured target hidden states ``{layer: [..., H]}`` in the drafter's layer order."""
        return torch.cat([hidden[i].float() for i in self.layers], dim=-1)

    def _context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, N, F]`` → ring rows ``[B, N, row_values]`` (DFlash2: its per-position K/V; DSpark: the feature)."""
        if isinstance(self.drafter, DFlash2Drafter):
            with torch.no_grad():
                return self.drafter.context_kv(features).flatten(2)
        return features

    def start(self, prompt_features: torch.Tensor) -> int:
        """Allocate a ring for a new request and fill it with its prompt's last ``window`` positions."""
        slot = self.ring.allocate()
        tail = prompt_features[-self.ring.window:].unsqueeze(0)
        self.ring.append(torch.tensor([slot], device=self.device), self._context_rows(tail),
                         torch.tensor([tail.shape[1]], device=self.device))
        return slot

    def release(self, slot: int) -> None:
        self.ring.release(slot)

    def advance(self, slots: torch.Tensor, features: torch.Tensor, kept: torch.Tensor) -> None:
        """Append the first ``kept[b]`` verified positions' rows (``features [B, Q, F]``) to the rings."""
        self.ring.append(slots, self._context_rows(features), kept)

    # ------------------------------------------------------------------------------------------ propose
    def propose(self, slots: torch.Tensor, last_tokens: torch.Tensor, batch_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """→ ``(draft [B, gamma], lengths [B], confidence [B, gamma] | None)``. ``lengths`` is how many drafts each
        request verifies: ``gamma`` for DFlash2; for DSpark the confident prefix under a threshold that rises to
        ``busy_confidence`` when ``batch_size >= busy_batch`` (load-aware shortening)."""
        context, mask = self.ring.context(slots)
        b = slots.shape[0]
        with torch.no_grad():
            if isinstance(self.drafter, DFlash2Drafter):
                cfg = self.drafter.config
                kv = context.view(b, self.ring.window, cfg.num_layers, 2, cfg.hidden_size)
                logits = self.drafter.block_logits(kv, last_tokens, self.gamma, mask)
                draft = logits.argmax(dim=-1)
                return draft, torch.full((b,), self.gamma, dtype=torch.int64, device=self.device), None
            assert isinstance(self.drafter, DSparkDrafter)
            proposal = self.drafter.propose(context[:, -1:], last_tokens, self.gamma)
        busy = batch_size >= self.busy_batch
        threshold = max(self.min_confidence, self.busy_confidence if busy else 0.0)
        lengths = confident_prefix_length(proposal.confidence, threshold)
        return proposal.tokens, lengths, proposal.confidence

    @property
    def ring_bytes_per_request(self) -> int:
        return self.ring.bytes_per_request
