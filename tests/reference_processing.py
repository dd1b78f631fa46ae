"""The reference for logit processing: transformers' own logits processors (bias, repetition penalty, bad words,
min new tokens) plus presence / frequency penalties written out by hand (transformers has none)."""

from __future__ import annotations

import torch

from dhisparse.sampling import SamplingParams


def reference_process(logits: torch.Tensor, sequence: list[int], prompt_len: int, params: SamplingParams,
                      eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Processed ``logits [V]`` for the token after ``sequence`` (prompt + generated, prompt of ``prompt_len``)."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    ids = torch.tensor([sequence])
    scores = logits.clone().unsqueeze(0)
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias])(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    counts = torch.bincount(ids[0], minlength=logits.shape[-1]).to(scores.dtype)
    scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(scores.dtype)
    if params.bad_words:
        scores = NoBadWordsLogitsProcessor([list(w) for w in params.bad_words])(ids, scores)
    if params.min_tokens:
        stops = sorted({*eos_token_ids, *params.stop_token_ids})
        scores = MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, stops)(ids, scores)
    return scores[0]
