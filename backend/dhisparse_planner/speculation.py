"""Speculation as the planner models it: accepted length per verification step, and the load-aware
shortening rule of a DSpark-style drafter.

Acceptance is taken from published measurements, as *mean accepted tokens per verification step* (accepted drafts
plus the bonus token, what serving engines report as "acceptance length"), at two contexts:
``accept_len_short`` at ``short_context_tokens`` and ``accept_len_long`` at ``long_context_tokens``, measured with
``source_gamma`` drafts per step (see :data:`ACCEPTANCE` for the figures and their sources). Between the two
contexts the accepted length is linear in ``log(context)``; outside them it stays at the nearer figure.

Each of a step's draft tokens is accepted with probability ``alpha(L)`` given the previous ones were (``L`` =
context in real tokens): the step emits the accepted prefix plus one bonus token, ``a = 1 + min(G, q - 1)`` with
``G`` geometric, whose mean with ``gamma`` drafts is ``(1 - alpha^(gamma + 1)) / (1 - alpha)``. ``alpha(L)`` is
the value that gives the sourced accepted length with ``source_gamma`` drafts; a run with another ``gamma`` uses
the same per-draft ``alpha`` (so a longer block gains what the sources' per-draft acceptance allows, no more).

Shortening (DSpark, ``dhisparse.spec.drafters.dspark.confident_prefix_length``): when the batch holds at least
``busy_batch`` requests, only the leading draft tokens whose cumulative confidence ``prod_{j<=i} c_j`` is at
least ``min_confidence`` are verified. The planner takes the confidence head as calibrated (``c_j = alpha``),
so the verified draft length is ``floor(log(min_confidence) / log(alpha))`` capped at ``gamma``.

``unsourced_alpha`` (a :class:`DecayingAlpha`) replaces the sourced figures by the rule the planner used before
issue 28 (``alpha = 0.75 - 0.03`` per doubling of context beyond 4K, floor 0.3, no source), for the ablation only
(``scripts/planner_ablation.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dhisparse import defaults
from dhisparse_planner.specs import DRAFTERS


@dataclass(frozen=True)
class AcceptanceFigures:
    """A drafter's published acceptance (see :data:`ACCEPTANCE`): mean accepted tokens per step (drafts + bonus)
    ``short`` at ``short_context_tokens`` and ``long`` at ``long_context_tokens``, measured with ``gamma`` drafts per
    step; ``source``: where the figures come from."""

    gamma: int
    short_context_tokens: int
    short: float
    long_context_tokens: int
    long: float
    source: str


# Published acceptance per drafter (the ranges the planner reports over are in constants.py).
ACCEPTANCE = {
    "dflash2": AcceptanceFigures(
        gamma=7, short_context_tokens=8192, short=6.0, long_context_tokens=172032, long=2.65,
        source=("GLM-5.3(-Flash) DFlash2 drafters, block 8 (7 drafts + the bonus token): 6.00 of 8 accepted at 512 to "
                "8,192 tokens of context (Blaizzy/mlx-vlm PR #2074, greedy, batch 1); 2.1-3.2 at 172K (the figures "
                "issue 28 cites; the midpoint 2.65 is the nominal); MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks "
                "issue #73: per-draft acceptance 70% -> 16% at 100K+ with k = 7 (2.1 per step)")),
    "dspark": AcceptanceFigures(
        gamma=5, short_context_tokens=8192, short=3.4, long_context_tokens=8192, long=3.4,
        source=("DeepSeek-V4-Flash DSpark, block 5: 3.2-3.6 accept length (sgl-project/sglang issue #29488 / PR "
                "#29538, 8xB200, greedy, GSM8K and MMLU; nominal 3.4 the midpoint); 2.74 on prose with k = 5 and a "
                "collapse to 1.31 with k = 7 (vllm-project/vllm PR #41834); 2.82 on GSM8K (vllm issue #56797). No "
                "long-context figure: the same at every context (ASSUMED)")),
}


@dataclass(frozen=True)
class DecayingAlpha:
    """The pre-issue-28 acceptance rule (no source): ``alpha(L) = max(floor, at_ref - per_doubling *
    log2(max(1, L / ref_context_tokens)))`` per draft token, whatever ``gamma``."""

    at_ref: float = 0.75
    per_doubling: float = 0.03
    ref_context_tokens: int = 4096
    floor: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= self.at_ref < 1.0 or self.per_doubling < 0 or self.ref_context_tokens < 1:
            raise ValueError(f"DecayingAlpha: need 0 <= floor <= at_ref < 1, per_doubling >= 0 and "
                             f"ref_context_tokens >= 1, got {self}")

    def at(self, context_tokens: torch.Tensor) -> torch.Tensor:
        """``alpha(L)`` for real contexts ``[B]`` (float64)."""
        ratio = torch.clamp(context_tokens.to(torch.float64) / self.ref_context_tokens, min=1.0)
        return torch.clamp(self.at_ref - self.per_doubling * torch.log2(ratio), min=self.floor)


def geometric_mean_accepted(alpha: torch.Tensor, gamma: int) -> torch.Tensor:
    """Mean accepted tokens per step ``1 + alpha + ... + alpha^gamma`` (float64)."""
    powers = alpha.unsqueeze(-1) ** torch.arange(gamma + 1, dtype=torch.float64)
    return powers.sum(dim=-1)


def alpha_for(accept_len: torch.Tensor, gamma: int) -> torch.Tensor:
    """Per-draft acceptance ``alpha`` in [0, 1) whose mean accepted length with ``gamma`` drafts is ``accept_len``
    (clamped to ``[1, gamma + 1)``; bisection, float64)."""
    target = torch.clamp(accept_len.to(torch.float64), min=1.0, max=gamma + 1 - 1e-9)
    lo, hi = torch.zeros_like(target), torch.ones_like(target)
    for _ in range(60):
        mid = (lo + hi) / 2
        below = geometric_mean_accepted(mid, gamma) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SpeculationModel:
    """Attributes:
        drafter: a key of :data:`dhisparse_planner.specs.DRAFTERS` (``dflash2``, ``dspark``).
        gamma: draft tokens per block (verification length ``gamma + 1``; default: the engine's).
        accept_len_short / accept_len_long: mean accepted tokens per step (drafts + bonus) at
            ``short_context_tokens`` / ``long_context_tokens``, measured with ``source_gamma`` drafts per step
            (defaults: DFlash2's published figures, :data:`ACCEPTANCE`; :meth:`for_drafter` takes a drafter's own).
        busy_batch: batch size from which a DSpark scheduler shortens verification (0: never; default: the
            engine's ``dspark_busy_batch``).
        min_confidence: cumulative-confidence threshold used when busy (0..1; the engine's
            ``dspark_busy_confidence``).
        unsourced_alpha: None (the sourced figures), or the pre-issue-28 rule (module docstring; ablation only).
    """

    drafter: str = "dflash2"
    gamma: int = defaults.NUM_DRAFT_TOKENS
    accept_len_short: float = ACCEPTANCE["dflash2"].short
    accept_len_long: float = ACCEPTANCE["dflash2"].long
    short_context_tokens: int = ACCEPTANCE["dflash2"].short_context_tokens
    long_context_tokens: int = ACCEPTANCE["dflash2"].long_context_tokens
    source_gamma: int = ACCEPTANCE["dflash2"].gamma
    busy_batch: int = defaults.DSPARK_BUSY_BATCH
    min_confidence: float = defaults.DSPARK_BUSY_CONFIDENCE
    unsourced_alpha: DecayingAlpha | None = None

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpeculationModel.drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.gamma < 1 or self.source_gamma < 1:
            raise ValueError(f"SpeculationModel.gamma and source_gamma must be >= 1, got {self.gamma}, "
                             f"{self.source_gamma}")
        for name in ("accept_len_short", "accept_len_long"):
            if not 1.0 <= getattr(self, name) <= self.source_gamma + 1:
                raise ValueError(f"SpeculationModel.{name} must be in [1, source_gamma + 1 = "
                                 f"{self.source_gamma + 1}], got {getattr(self, name)}")
        if not 1 <= self.short_context_tokens <= self.long_context_tokens:
            raise ValueError("SpeculationModel: need 1 <= short_context_tokens <= long_context_tokens, got "
                             f"{self.short_context_tokens}, {self.long_context_tokens}")
        if not 0.0 <= self.min_confidence <= 1.0 or self.busy_batch < 0:
            raise ValueError(f"SpeculationModel: min_confidence must be in [0, 1] and busy_batch >= 0, got "
                             f"{self.min_confidence}, {self.busy_batch}")

    @classmethod
    def for_drafter(cls, drafter: str, **changes: object) -> SpeculationModel:
        """The model with ``drafter``'s published acceptance (:data:`ACCEPTANCE`), then ``changes``."""
        return cls(drafter=drafter).with_drafter(drafter, force=True).replace(**changes)

    def with_drafter(self, drafter: str, force: bool = False) -> SpeculationModel:
        """The same model for ``drafter``: a different drafter (or ``force``) brings its own published acceptance;
        the same drafter keeps this model's (possibly varied) figures."""
        if drafter == self.drafter and not force:
            return self
        if drafter not in ACCEPTANCE:
            raise ValueError(f"no published acceptance for drafter {drafter!r}; known: {', '.join(ACCEPTANCE)}")
        f = ACCEPTANCE[drafter]
        return dataclasses.replace(self, drafter=drafter, accept_len_short=f.short, accept_len_long=f.long,
                                   short_context_tokens=f.short_context_tokens,
                                   long_context_tokens=f.long_context_tokens, source_gamma=f.gamma)

    def replace(self, **changes: object) -> SpeculationModel:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def max_query_len(self) -> int:
        return self.gamma + 1

    def accept_len_at(self, context_tokens: torch.Tensor) -> torch.Tensor:
        """Sourced mean accepted tokens per step (with ``source_gamma`` drafts) at real contexts ``[B]`` (float64)."""
        ctx = torch.clamp(context_tokens.to(torch.float64), min=self.short_context_tokens,
                          max=self.long_context_tokens)
        span = math.log(self.long_context_tokens / self.short_context_tokens)
        frac = torch.log(ctx / self.short_context_tokens) / span if span > 0 else torch.zeros_like(ctx)
        return self.accept_len_short + frac * (self.accept_len_long - self.accept_len_short)

    def accept_prob_at(self, context_tokens: torch.Tensor) -> torch.Tensor:
        """``alpha(L)`` for real context lengths ``[B]`` (float64)."""
        if self.unsourced_alpha is not None:
            return self.unsourced_alpha.at(context_tokens)
        return alpha_for(self.accept_len_at(context_tokens), self.source_gamma)

    def mean_accepted(self, context_tokens: torch.Tensor) -> torch.Tensor:
        """Mean accepted tokens per step with this model's ``gamma`` at real contexts ``[B]`` (float64)."""
        return geometric_mean_accepted(self.accept_prob_at(context_tokens), self.gamma)

    def verify_lengths(self, context_tokens: torch.Tensor, batch: int) -> torch.Tensor:
        """Verification length ``q`` per request ``[B]`` int64 (1 + verified draft tokens), after shortening."""
        full = torch.full_like(context_tokens, self.max_query_len, dtype=torch.int64)
        if not DRAFTERS[self.drafter].confidence_head or self.busy_batch == 0 or batch < self.busy_batch:
            return full
        alpha = self.accept_prob_at(context_tokens)
        if self.min_confidence <= 0.0:
            return full
        # cumulative confidence alpha^i >= threshold  <=>  i <= log(threshold) / log(alpha)
        log_alpha = torch.log(alpha.clamp(min=1e-12, max=1 - 1e-12))
        drafts = torch.floor(math.log(self.min_confidence) / log_alpha) if self.min_confidence < 1.0 \
            else torch.zeros_like(alpha)
        drafts = torch.where(alpha > 0, drafts, torch.zeros_like(alpha))
        return 1 + drafts.clamp(min=0, max=self.gamma).to(torch.int64)

    def sample_accepted(self, query_lens: torch.Tensor, context_tokens: torch.Tensor,
                        generator: torch.Generator) -> torch.Tensor:
        """Accepted length per request ``[B]`` int64 in ``1 .. q``: leading accepted drafts + the bonus token."""
        alpha = self.accept_prob_at(context_tokens)
        draws = torch.rand(len(query_lens), self.gamma, generator=generator, dtype=torch.float64)
        ok = (draws < alpha.unsqueeze(1)).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return 1 + torch.minimum(ok, query_lens - 1)


def confident_prefix_length(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """The shortening rule on explicit confidences ``[B, gamma]`` (same rule as the DSpark drafter's)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return (torch.cumprod(confidence, dim=1) >= threshold).long().cumprod(dim=1).sum(dim=1)
