"""Training the drafters on target hidden states (distillation), used by ``scripts/train_demo.py``.

The data are sequences run through the target once: for every position ``s`` the target features
(``config.target_layer_ids`` outputs, concatenated) and the target's next-token distribution ``p(x_{s+1} | x_<=s)``.
An *anchor* ``t`` plays the last accepted token: the drafter sees features of positions ``< t`` and token
``x_t``, and block offset ``i`` is trained towards the target's distribution at position ``t + i`` (soft
cross-entropy, plus a hard cross-entropy on its argmax because greedy acceptance is what is measured).
Sequences that end in the target's own greedy continuation make the labels of later offsets exactly what
greedy speculative decoding meets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dflash2 import DFlash2Drafter
from .dspark import DSparkDrafter


@dataclass(frozen=True)
class DistillationData:
    """tokens [N, S] int64; features [N, S, F] (bfloat16 to save memory); target_probs [N, S, V] (bfloat16),
    row ``s`` = the target's distribution of token ``s + 1``."""

    tokens: torch.Tensor
    features: torch.Tensor
    target_probs: torch.Tensor

    def __post_init__(self) -> None:
        n, s = self.tokens.shape
        if self.features.shape[:2] != (n, s) or self.target_probs.shape[:2] != (n, s):
            raise ValueError("tokens, features and target_probs must agree on [N, S]")


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    sequences_per_step: int = 8
    anchors_per_sequence: int = 32
    lr: float = 2e-3
    hard_weight: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.steps, self.sequences_per_step, self.anchors_per_sequence) < 1 or self.lr <= 0:
            raise ValueError(f"invalid TrainSettings {self}")


def _anchors(
    data: DistillationData, settings: TrainSettings, low: int, gamma: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence ids [n], anchor positions [n, per]) with ``low <= t`` and ``t + gamma < S``."""
    n, s = data.tokens.shape
    seqs = torch.randint(0, n, (settings.sequences_per_step,), generator=gen)
    anchors = torch.randint(low, s - gamma, (settings.sequences_per_step, settings.anchors_per_sequence), generator=gen)
    return seqs, anchors


def _distill_loss(logits: torch.Tensor, target_probs: torch.Tensor, hard_weight: float) -> torch.Tensor:
    """logits [B, G, V]; target_probs [B, G, V] -> soft CE + hard_weight * CE on the target argmax."""
    logp = torch.log_softmax(logits, dim=-1)
    soft = -(target_probs * logp).sum(-1).mean()
    hard = F.nll_loss(logp.flatten(0, 1), target_probs.argmax(-1).flatten())
    return soft + hard_weight * hard


def _schedule(step: int, steps: int, lr: float) -> float:
    return lr * min(1.0, (step + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / steps)))


def _block_labels(data: DistillationData, seqs: torch.Tensor, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
    offsets = anchors[..., None] + torch.arange(gamma)
    return data.target_probs[seqs[:, None, None], offsets].float().flatten(0, 1)  # [n * per, gamma, V]


def train_dflash2(
    drafter: DFlash2Drafter, data: DistillationData, settings: TrainSettings, log_every: int = 100
) -> list[tuple]:
    """Train on blocks of ``max_block`` tokens (causal inside the block covers every smaller gamma)."""
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    window, gamma = drafter.config.window, drafter.config.max_block
    log, start = [], time.time()
    drafter.train()
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = _schedule(step, settings.steps, settings.lr)
        seqs, anchors = _anchors(data, settings, window, gamma, gen)
        kv = drafter.context_kv(data.features[seqs].float())  # [n, S, layers, 2, d], once per position
        rows = anchors[..., None] + torch.arange(-window, 0)  # [n, per, window]
        context = kv[torch.arange(len(seqs))[:, None, None], rows].flatten(0, 1)
        last = data.tokens[seqs[:, None], anchors].flatten()
        logits = drafter.block_logits(context, last, gamma)
        loss = _distill_loss(logits, _block_labels(data, seqs, anchors, gamma), settings.hard_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            log.append((step + 1, round(loss.item(), 4), round(time.time() - start, 1)))
            print(
                f"dflash2 step {step + 1}/{settings.steps} loss {loss.item():.3f} {time.time() - start:.0f}s",
                flush=True,
            )
    drafter.eval()
    return log


def train_dspark(
    drafter: DSparkDrafter, data: DistillationData, settings: TrainSettings, log_every: int = 100
) -> list[tuple]:
    """Teacher-forced training: the Markov head sees the sequence's real previous tokens; the confidence head
    learns (binary cross-entropy, on detached inputs) whether the slot's argmax equals the target's argmax."""
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gamma = drafter.config.max_block
    log, start = [], time.time()
    drafter.train()
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = _schedule(step, settings.steps, settings.lr)
        seqs, anchors = _anchors(data, settings, 1, gamma + 1, gen)
        seq_rows = seqs[:, None]
        features = data.features[seq_rows, anchors - 1].float().flatten(0, 1)[:, None]  # [B, 1, F]
        last = data.tokens[seq_rows, anchors].flatten()
        block = data.tokens[seq_rows[..., None], anchors[..., None] + 1 + torch.arange(gamma)].flatten(0, 1)
        logits, h = drafter.teacher_forced_logits(features, last, block)
        labels = _block_labels(data, seqs, anchors, gamma)
        loss = _distill_loss(logits, labels, settings.hard_weight)
        hit = (logits.argmax(-1) == labels.argmax(-1)).float()
        confidence = drafter.confidence(h.detach(), logits.detach()).clamp(1e-6, 1 - 1e-6)
        confidence_loss = F.binary_cross_entropy(confidence, hit)
        (loss + 0.1 * confidence_loss).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            log.append(
                (
                    step + 1,
                    round(loss.item(), 4),
                    round(confidence_loss.item(), 4),
                    round(time.time() - start, 1),
                )
            )
            print(
                f"dspark step {step + 1}/{settings.steps} loss {loss.item():.3f} "
                f"confidence {confidence_loss.item():.3f} {time.time() - start:.0f}s",
                flush=True,
            )
    drafter.eval()
    return log
