"""Glue between the engine and a drafter: context rows in the draft ring, proposals, load-aware verification length.

The drafter directory may hold this project's own DFlash2-style / DSpark-style drafter or a published one (z-lab
DFlash, DFlash2, DeepSpec's Qwen3 DSpark, DeepSeek-V4's DSpark; ``dhisparse.spec.published``); the engine sees
one interface either way. Published drafters that run on the target's embedding and LM head need
``target_model`` (any runtime model exposing ``embed``, ``lm_head`` and ``dtype``).

Greedy requests get the drafter's argmax tokens. Sampled requests draw each draft token from the drafter's own
distribution at the request's temperature, ``q_i = softmax(logits_i / T)`` (DSpark: token ``i`` feeds its Markov
head for token ``i + 1``), with the engine's counter-based uniforms, and that ``q`` goes to ``rejection_accept``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dhisparse.errors import ConfigError
from dhisparse.host_values import to_device
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.sampling.sampler import uniform
from dhisparse.spec.drafters import DFlash2Drafter, DSparkDrafter, confident_prefix_length, load_drafter
from dhisparse.spec.proposal_law import choose
from dhisparse.spec.published import PUBLISHED, PublishedSpeculation, family_of, load_published, read_drafter_config
from dhisparse.spec.ring import DraftRing


class Speculator:
    def __init__(
        self,
        drafter_dir: Path,
        gamma: int,
        max_slots: int,
        target: ModelConfig | DeepseekV4Config,
        device: torch.device,
        *,
        target_model: object | None = None,
        max_context: int = 0,
    ) -> None:
        """``max_context`` (0: the target's ``max_position_embeddings``) bounds the ring of a published drafter
        that attends to the whole history."""
        if not drafter_dir.is_dir():
            raise ConfigError(f"speculative decoding needs a drafter at {drafter_dir}; pack one with "
                              f"`dhisparse-build … --drafter DIR`")
        self.published: PublishedSpeculation | None = None
        _, fmt = read_drafter_config(drafter_dir)
        if fmt in PUBLISHED:
            self._init_published(drafter_dir, fmt, gamma, max_slots, target, device, target_model, max_context)
            return
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
        if isinstance(self.drafter, DFlash2Drafter):
            row_values = cfg.ring_row_values
        else:
            row_values = cfg.feature_size
        self.ring = DraftRing(max_slots, self.drafter.window, row_values, torch.float32, device)

    def _init_published(self, drafter_dir: Path, fmt: str, gamma: int, max_slots: int, target: ModelConfig,
                        device: torch.device, target_model: object | None, max_context: int) -> None:
        dtype = getattr(target_model, "dtype", torch.float32)
        drafter = load_published(drafter_dir, target, embed=getattr(target_model, "embed", None),
                                 lm_head=getattr(target_model, "lm_head", None), dtype=dtype, device=device)
        if not 1 <= gamma <= drafter.max_gamma:
            raise ConfigError(f"num_draft_tokens must be in 1..{drafter.max_gamma} for this {fmt} drafter, got {gamma}")
        self.drafter, self.kind, self.gamma, self.device = drafter, family_of(fmt), gamma, device
        self.layers = tuple(drafter.target_layer_ids)
        self.published = PublishedSpeculation(drafter, gamma, max_slots, max_context or target.max_position_embeddings,
                                              dtype, device)
        self.ring = self.published.ring

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
        if self.published is not None:
            return self.published.start(prompt_features)
        slot = self.ring.allocate()
        tail = prompt_features[-self.ring.window:].unsqueeze(0)
        self.ring.append(to_device([slot], torch.int64, self.device), self._context_rows(tail),
                         to_device([tail.shape[1]], torch.int64, self.device))
        return slot

    def release(self, slot: int) -> None:
        self.ring.release(slot)

    def advance(self, slots: torch.Tensor, features: torch.Tensor, kept: torch.Tensor) -> None:
        """Append the first ``kept[b]`` verified positions' rows (``features [B, Q, F]``) to the rings."""
        if self.published is not None:
            self.published.advance(slots, features, kept)
            return
        self.ring.append(slots, self._context_rows(features), kept)

    # ------------------------------------------------------------------------------------------ propose
    def propose(
        self,
        slots: torch.Tensor,
        last_tokens: torch.Tensor,
        threshold: float,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """→ ``(draft [B, gamma], q [B, gamma, V] float64, lengths [B], confidence [B, gamma] | None)``.

        ``temperature [B]`` (0 = greedy: ``q`` is the point mass of the argmax), ``seeds``/``counters [B]`` key the
        uniforms (stream 3). ``lengths`` is how many drafts each request verifies: ``gamma`` for DFlash2; for DSpark
        the prefix whose confidence stays at or above ``threshold`` (the scheduler's load-aware choice,
        ``Scheduler.verification_threshold``); a published DSpark drafter cuts at ``threshold`` by its own rule
        (``proposal_law.confident_length``)."""
        if self.published is not None:
            return self.published.propose(slots, last_tokens, threshold, temperature, seeds, counters)
        context, mask = self.ring.context(slots)
        b = slots.shape[0]
        steps = counters.unsqueeze(1) + torch.arange(self.gamma, device=self.device)
        u = uniform(seeds.unsqueeze(1).expand_as(steps), steps, stream=3)  # [B, gamma]
        confidence = None
        with torch.no_grad():
            if isinstance(self.drafter, DFlash2Drafter):
                cfg = self.drafter.config
                kv = context.view(b, self.ring.window, cfg.num_layers, 2, cfg.hidden_size)
                logits = self.drafter.block_logits(kv, last_tokens, self.gamma, mask)  # [B, gamma, V]
                draft, q = choose(logits, temperature.unsqueeze(1), u)
            else:
                assert isinstance(self.drafter, DSparkDrafter)
                h, base = self.drafter.backbone(context[:, -1], last_tokens, self.gamma)
                previous, tokens, dists, step_logits = last_tokens, [], [], []
                for i in range(self.gamma):  # sequential only through the rank-r Markov head; batched over B
                    logits_i = base[:, i] + self.drafter.markov_logits(h[:, i:i + 1], previous[:, None])[:, 0]
                    previous, q_i = choose(logits_i, temperature, u[:, i])
                    tokens.append(previous)
                    dists.append(q_i)
                    step_logits.append(logits_i)
                draft, q = torch.stack(tokens, dim=1), torch.stack(dists, dim=1)
                confidence = self.drafter.confidence(h, torch.stack(step_logits, dim=1))
        if confidence is None:
            lengths = torch.full((b,), self.gamma, dtype=torch.int64, device=self.device)
        else:
            lengths = confident_prefix_length(confidence, threshold)
        return draft, q, lengths, confidence

    @property
    def ring_bytes_per_request(self) -> int:
        return self.ring.bytes_per_request

