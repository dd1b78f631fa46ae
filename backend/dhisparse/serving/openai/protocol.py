"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) as validated pydantic models.

Field names, types and ranges are OpenAI's; a value outside them is a 400 naming the field. Fields OpenAI defines
that this server does not do are refused when they ask for something (``suffix``, ``best_of`` != ``n``, tools,
``response_format`` other than text, ``echo`` with ``logprobs``) rather than ignored; unknown fields are ignored,
as OpenAI-compatible servers do. The server's per-request limits (``n``, prompts, ``stop``, ``logit_bias``, prompt
sizes) are checked by `edge_limits`, with the values ``dhisparse-serve --limit`` sets for every model. Extensions
shared with vLLM: ``top_k`` (0 or -1 = off), ``min_tokens``, ``repetition_penalty``, and for chat
``add_generation_prompt``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dhisparse.serving.openai.errors import bad_request

MAX_LOGPROBS = 20  # completions' logprobs / chat's top_logprobs
SEED_MAX = (1 << 64) - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CommonParams(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)  # at most the limit max_num_return_sequences (edge_limits)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    user: str | None = None
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)

    def stop_strings(self) -> tuple[str, ...]:
        """The non-empty stop strings (their number and sizes are bounded by the server's limits: `edge_limits`)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` with integer token ids, checked against the vocabulary and OpenAI's [-100, 100]."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias: {key!r} is not a token id", "logit_bias") from None
            if not 0 <= token < vocab_size:
                raise bad_request(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                                  "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias: {value} for token {token} is outside [-100, 100]", "logit_bias")
            bias[token] = float(value)
        return bias

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")


class CompletionRequest(CommonParams):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either (one prompt each;
    the response has ``n`` choices per prompt, in prompt order)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        self._check_stream_options()
        if self.suffix:
            raise bad_request("suffix is not supported (no insertion mode)", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (no server-side selection among samples)", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt log-probabilities)", "echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt is empty", "prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(CommonParams):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the older ``max_tokens``) bounds the answer;
    unset, it may run to the engine's context length. ``logprobs`` / ``top_logprobs`` as OpenAI."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        self._check_stream_options()
        if self.tools or self.functions:
            raise bad_request("tool calling is not supported", "tools" if self.tools else "functions")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool calling is not supported", "tool_choice")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise bad_request(f"response_format {self.response_format.get('type')!r} is not supported (text only)",
                              "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree: send one of them", "max_tokens")
        return self

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=False) for m in self.messages]
