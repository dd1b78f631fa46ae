"""What a request asks of the sampler: ``SamplingParams`` (validated at construction)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from dhisparse.errors import InvalidRequestError

MASK64 = (1 << 64) - 1


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters.

    ``seed`` fixes the random stream of one request (``None``: derived from the request id). Generation stops
    after ``max_tokens`` tokens, at the model's EOS token (unless ``ignore_eos``), or at any ``stop_token_ids``.

    Logit processing (TensorRT-LLM's sampling-config meaning; applied in this order before temperature, top-k
    and top-p, see ``dhisparse.sampling.processing``):

    * ``logit_bias``: ``(token id, bias)`` pairs added to the logits (tensorrtllm's ``embedding_bias``).
    * ``repetition_penalty`` (> 0, 1 = off): logits of tokens present in prompt + output are divided by it
      when positive, multiplied when negative.
    * ``presence_penalty`` / ``frequency_penalty`` (0 = off): subtract ``presence * [count > 0] +
      frequency * count``, counting each token over prompt + output (as TensorRT-LLM does).
    * ``bad_words``: token sequences that may never be generated: the last token of a word is banned whenever
      the sequence so far (prompt + output) ends with the word's other tokens.
    * ``min_tokens``: EOS and ``stop_token_ids`` are banned until this many tokens have been generated.

    Outputs asked for: ``logprobs`` (the log-probability of each generated token under the processed
    distribution at the request's temperature, see ``sampler.token_log_probs``), ``generation_logits`` (the
    processed logits of every generated token's position), ``context_logits`` (the prompt positions' raw
    logits) and ``perf_metrics`` (request statistics on every update, not only the last).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    generation_logits: bool = False
    context_logits: bool = False
    perf_metrics: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MASK64):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if _finite("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        _finite("presence_penalty", self.presence_penalty)
        _finite("frequency_penalty", self.frequency_penalty)
        _count("min_tokens", self.min_tokens, 0)
        words = tuple(tuple(int(t) for t in word) for word in self.bad_words)
        if any(len(word) == 0 for word in words):
            raise InvalidRequestError("bad_words: every bad word needs at least one token")
        object.__setattr__(self, "bad_words", words)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple((int(t), _finite(f"logit_bias[{t}]", b)) for t, b in pairs)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing (penalties, bias, bad words, min_tokens) is asked for."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.bad_words) or bool(self.logit_bias))

    @property
    def counts_tokens(self) -> bool:
        """Whether the penalties need the per-request token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name (the engine checks them against the vocabulary)."""
        return [*self.stop_token_ids, *(t for w in self.bad_words for t in w), *(t for t, _ in self.logit_bias)]

    def for_sequence(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of several independent samples of one prompt
        (``num_return_sequences``): sequence 0 is these parameters; sequence ``i`` uses seed ``seed + i``
        (mod 2**64) when a seed is set, otherwise its own request id's stream."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) & MASK64)
