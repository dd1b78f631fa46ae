"""The server's per-request limits (`dhisparse.serving.limits.RequestLimits`, ``--limit NAME=VALUE``) at the OpenAI
edge, checked before any heavy work: the same limits, with the same values, as the Triton models check.

In the order a request meets them:

- ``max_request_bytes``: the HTTP body, before it is parsed (`BodySizeLimit`): a declared ``Content-Length`` over
  the limit is refused at once, a chunked body as soon as what arrived passes it. Answered with HTTP 413.
- ``max_batch`` / ``max_num_return_sequences`` / ``max_sequences``: prompts of one completions request, ``n``, and
  prompts × ``n`` (each choice is a gRPC stream and an engine request).
- ``max_words`` / ``max_word_bytes``: ``stop`` strings (how many; UTF-8 bytes of each).
- ``vocab_size``: entries of ``logit_bias`` (counted before any is parsed).
- ``max_prompt_bytes``: UTF-8 bytes of one text prompt, before it is tokenised; for chat, the messages' text
  (each message counted as at least one byte) before the template is rendered, then the rendered prompt.
- ``max_prompt_tokens``: tokens of one prompt (token-id prompts before anything else, text after tokenising).

The sizes of the body's lists (prompts, token ids, messages, stop strings, ``logit_bias`` entries) are checked on
the decoded JSON before it is validated (`EdgeLimits.check_sizes`): validating a list builds an object per entry.
Every refusal but the first is HTTP 400, OpenAI's error object with ``code`` ``limit_exceeded``, ``param`` the
request field, and the message naming the limit and the flag that sets it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dhisparse.serving.limits import LimitExceededError, RequestLimits
from dhisparse.serving.openai.errors import OpenAIError

LIMIT_EXCEEDED = "limit_exceeded"


@contextmanager
def refused_as(param: str | None, status: int = 400) -> Iterator[None]:
    """Turns a `LimitExceededError` raised inside into the OpenAI error for `param`."""
    try:
        yield
    except LimitExceededError as error:
        raise OpenAIError(status, str(error), param, LIMIT_EXCEEDED) from None


class EdgeLimits:
    """`RequestLimits` (resolved: no value left at 0 but ``vocab_size`` when unknown) as OpenAI request checks."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits

    def check_sizes(self, raw: Mapping[str, Any]) -> None:
        """The lengths of the decoded body's lists, before pydantic validates them (wrong types are left to it)."""
        limits = self.limits
        prompt, messages, stop, bias = (raw.get(name) for name in ("prompt", "messages", "stop", "logit_bias"))
        with refused_as("prompt"):
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                limits.check_prompt_tokens(len(prompt), "the prompt")
            elif isinstance(prompt, list):
                limits.check_batch(len(prompt))
        if isinstance(messages, list) and len(messages) > limits.max_prompt_bytes:
            with refused_as("messages"):
                raise limits.refuse(f"the messages' text has at least {len(messages)} bytes (one per message)",
                                    "max_prompt_bytes")
        if isinstance(stop, list) and len(stop) > limits.max_words:
            with refused_as("stop"):
                raise limits.refuse(f"stop holds {len(stop)} strings", "max_words")
        if isinstance(bias, dict):
            self.check_logit_bias(bias)

    def check_choices(self, prompts: int, n: int) -> None:
        """`prompts` prompts with `n` choices each."""
        with refused_as("n" if n > self.limits.max_num_return_sequences else "prompt"):
            self.limits.check_batch(prompts, n)

    def check_stops(self, stops: tuple[str, ...]) -> None:
        with refused_as("stop"):
            if len(stops) > self.limits.max_words:  # before encoding any of them
                raise self.limits.refuse(f"stop holds {len(stops)} strings", "max_words")
            self.limits.check_text_words("stop", [s.encode("utf-8", "surrogatepass") for s in stops])

    def check_logit_bias(self, logit_bias: Mapping[str, float] | None) -> None:
        with refused_as("logit_bias"):
            self.limits.check_bias_size(len(logit_bias or {}), "logit_bias")

    def check_text(self, text: str, param: str, what: str = "the prompt") -> None:
        """One text prompt, before tokenising. Characters are counted first (never more than its bytes), so a
        huge string is refused without encoding it."""
        with refused_as(param):
            if len(text) > self.limits.max_prompt_bytes:
                raise self.limits.refuse(f"{what} has at least {len(text)} bytes", "max_prompt_bytes")
            self.limits.check_prompt_bytes(len(text.encode("utf-8", "surrogatepass")), what)

    def check_messages(self, messages: list[dict[str, Any]]) -> None:
        """Chat messages before the template renders them: their text, each message at least one byte."""
        total = 0
        for message in messages:
            total += max(1, _content_chars(message.get("content")))
            if total > self.limits.max_prompt_bytes:
                with refused_as("messages"):
                    raise self.limits.refuse(f"the messages' text has at least {total} bytes", "max_prompt_bytes")

    def check_tokens(self, count: int, param: str) -> None:
        with refused_as(param):
            self.limits.check_prompt_tokens(count, "the prompt")


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return sum(len(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"),
                                                                                                    str))
    return 0


class BodySizeLimit:
    """ASGI middleware: an HTTP body of more than ``limits.max_request_bytes`` is answered with 413 (OpenAI's error
    object) before the application reads it; a body within the limit is read whole and handed on unchanged, and
    later messages (``http.disconnect``) pass through.

    A refused body still on its way is read and dropped, up to `drain_bytes` more, so the client, which sends its
    body before reading the answer, gets the 413 rather than a reset connection; beyond that the connection is closed.
    """

    def __init__(self, app: ASGIApp, limits: Callable[[], RequestLimits], drain_bytes: int = 64 << 20) -> None:
        self.app, self.limits, self.drain_bytes = app, limits, drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits().max_request_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, declared, limit, more_body=True)
            return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before its body arrived: nobody to answer
                return
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                await self._refuse(scope, receive, send, total, limit, more_body=message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int, limit: int,
                      more_body: bool) -> None:
        error = OpenAIError(413, f"request refused: its body holds {'at least ' if more_body else ''}{size} bytes, "
                                 f"more than the limit max_request_bytes = {limit} "
                                 "(dhisparse-serve --limit max_request_bytes=N)", None, LIMIT_EXCEEDED)
        drained = 0
        while more_body and drained <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            more_body = message.get("more_body", False)
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
