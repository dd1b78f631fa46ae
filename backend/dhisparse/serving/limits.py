"""Per-request limits, checked at the edge of every model before any heavy work (tokenising, copying, threads).

A request that exceeds a limit is refused at once with an error naming the limit, its value and the flag that
sets it (``dhisparse-serve --limit NAME=VALUE``); nothing is tokenised, queued or started for it. The limits reach
the Triton models as ``limit.<name>`` model parameters (``RepositorySpec.limits``); a model without them uses the
defaults below. Limits given as 0 are derived from the engine at fill time (:meth:`RequestLimits.resolved`). The
OpenAI front end checks the same resolved limits on its requests (`dhisparse.serving.openai.edge_limits`: there
``max_request_bytes`` bounds the HTTP body, ``max_batch`` the prompts, ``n`` is ``num_return_sequences``, stop strings
are words).

What each limit bounds (per Triton request unless said otherwise):

- ``max_request_bytes``: all input tensors together (a 32 MB prompt is refused before it is decoded).
- ``max_batch``: prompts in one request (at most the models' Triton ``max_batch_size``, which Triton enforces too).
- ``max_prompt_tokens``: tokens of one prompt (0: the engine's ``max_model_len`` - 1).
- ``max_prompt_bytes``: UTF-8 bytes of one text prompt, checked before tokenising (0: 32 per allowed token).
- ``max_num_return_sequences``: ``num_return_sequences`` of one prompt.
- ``max_sequences``: prompts × ``num_return_sequences`` (each sequence is an engine request and a thread).
- ``max_words``: stop words, and separately bad words, of one prompt.
- ``max_word_bytes`` / ``max_word_tokens``: one stop or bad word, as text (before tokenising) / as tokens.
- ``max_bias_words``: ``embedding_bias_words`` of one prompt; a token-id ``embedding_bias`` may hold at most
  ``vocab_size`` values (0: not checked here; the engine checks token ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from dhisparse.errors import InvalidRequestError

BYTES_PER_TOKEN = 32  # max_prompt_bytes = this × max_prompt_tokens when not given


class LimitExceededError(InvalidRequestError):
    """A request exceeds one of the server's per-request limits; the message names the limit."""


@dataclass(frozen=True)
class RequestLimits:
    """The per-request limits (see the module docstring); every value is an integer >= 0 (0: derived)."""

    max_request_bytes: int = 16 << 20
    max_batch: int = 8
    max_prompt_tokens: int = 0
    max_prompt_bytes: int = 0
    max_num_return_sequences: int = 16
    max_sequences: int = 64
    max_words: int = 256
    max_word_bytes: int = 256
    max_word_tokens: int = 64
    max_bias_words: int = 256
    vocab_size: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"limit {f.name} must be an integer >= 0, got {value!r}")
        for name in ("max_request_bytes", "max_batch", "max_num_return_sequences", "max_sequences", "max_words",
                     "max_word_bytes", "max_word_tokens", "max_bias_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"limit {name} must be >= 1, got {getattr(self, name)}")

    def resolved(self, max_model_len: int, vocab_size: int, triton_max_batch_size: int) -> RequestLimits:
        """The limits with derived values filled in from the engine (0 = derived) and ``max_batch`` capped."""
        tokens = self.max_prompt_tokens or max(1, max_model_len - 1)
        return replace(self, max_prompt_tokens=tokens,
                       max_prompt_bytes=self.max_prompt_bytes or BYTES_PER_TOKEN * tokens,
                       max_batch=min(self.max_batch, triton_max_batch_size), vocab_size=self.vocab_size or vocab_size)

    def parameters(self) -> dict[str, str]:
        """``limit.<name>`` model parameters."""
        return {f"limit.{name}": str(value) for name, value in asdict(self).items()}

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> RequestLimits:
        """The limits among a model's parameters (absent ones keep their defaults)."""
        known = {f.name for f in fields(cls)}
        values = {key.removeprefix("limit."): int(value) for key, value in parameters.items()
                  if key.startswith("limit.") and key.removeprefix("limit.") in known}
        return cls(**values)

    @classmethod
    def parse_overrides(cls, items: list[str]) -> dict[str, int]:
        """``NAME=VALUE`` strings (``--limit``) -> overrides; ValueError naming a bad entry."""
        known = {f.name for f in fields(cls)}
        out = {}
        for item in items:
            name, sep, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in known:
                raise ValueError(f"--limit expects NAME=VALUE with NAME one of {', '.join(sorted(known))}, got "
                                 f"{item!r}")
            try:
                out[name] = int(value)
            except ValueError as error:
                raise ValueError(f"--limit {name}: {value!r} is not an integer") from error
        return out

    # ----------------------------------------------------------------------------------------------- checks
    def refuse(self, what: str, limit: str) -> LimitExceededError:
        return LimitExceededError(f"request refused: {what}, more than the limit {limit} = {getattr(self, limit)} "
                                  f"(dhisparse-serve --limit {limit}=N)")

    def check_request_bytes(self, inputs: Mapping[str, np.ndarray]) -> None:
        """All input tensors together within ``max_request_bytes`` (BYTES tensors: 4 + the bytes of each element, as
        on the wire). The element counts are checked first, so a huge list is refused without walking it."""
        arrays = [np.asarray(a) for a in inputs.values()]
        total = sum(4 * a.size if a.dtype == object else int(a.nbytes) for a in arrays)
        if total <= self.max_request_bytes:
            total += sum(_element_bytes(a) for a in arrays if a.dtype == object)
        if total > self.max_request_bytes:
            raise self.refuse(f"its inputs hold {total} bytes", "max_request_bytes")

    def check_batch(self, batch: int, num_return_sequences: int = 1) -> None:
        if batch > self.max_batch:
            raise self.refuse(f"it holds {batch} prompts", "max_batch")
        if num_return_sequences > self.max_num_return_sequences:
            raise self.refuse(f"num_return_sequences is {num_return_sequences}", "max_num_return_sequences")
        if batch * num_return_sequences > self.max_sequences:
            raise self.refuse(f"{batch} prompts × {num_return_sequences} sequences make "
                              f"{batch * num_return_sequences} sequences", "max_sequences")

    def check_prompt_tokens(self, count: int, name: str = "the prompt") -> None:
        if self.max_prompt_tokens and count > self.max_prompt_tokens:
            raise self.refuse(f"{name} has {count} tokens", "max_prompt_tokens")

    def check_prompt_bytes(self, count: int, name: str = "text_input") -> None:
        if self.max_prompt_bytes and count > self.max_prompt_bytes:
            raise self.refuse(f"{name} has {count} bytes", "max_prompt_bytes")

    def check_text_words(self, name: str, words: list[bytes]) -> None:
        """A stop / bad / bias word list as text, before tokenising."""
        limit = "max_bias_words" if name == "embedding_bias_words" else "max_words"
        if len(words) > getattr(self, limit):
            raise self.refuse(f"{name} holds {len(words)} words", limit)
        longest = max((len(w) for w in words), default=0)
        if longest > self.max_word_bytes:
            raise self.refuse(f"a word of {name} has {longest} bytes", "max_word_bytes")

    def check_word_tokens(self, name: str, words: list[list[int]] | list[tuple[int, ...]]) -> None:
        """A stop / bad word list as token ids."""
        if len(words) > self.max_words:
            raise self.refuse(f"{name} holds {len(words)} words", "max_words")
        longest = max((len(w) for w in words), default=0)
        if longest > self.max_word_tokens:
            raise self.refuse(f"a word of {name} has {longest} tokens", "max_word_tokens")

    def check_word_list_width(self, name: str, width: int) -> None:
        """A tensorrtllm ``[2, W]`` word list before it is split: W ids can hold at most max_words × max_word_tokens."""
        if width > self.max_words * self.max_word_tokens:
            raise self.refuse(f"{name} holds {width} token ids (max_words × max_word_tokens = "
                              f"{self.max_words * self.max_word_tokens})", "max_words")

    def check_bias_size(self, size: int, name: str = "embedding_bias") -> None:
        if self.vocab_size and size > self.vocab_size:
            raise LimitExceededError(f"request refused: {name} holds {size} values but the vocabulary has "
                                     f"{self.vocab_size} tokens (limit vocab_size)")


def _element_bytes(array: np.ndarray) -> int:
    return sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in array.reshape(-1).tolist())
