"""OpenAI response objects: completions and chat completions, whole or as stream chunks, usage, log-probs.

Shapes follow OpenAI's API reference: ``text_completion`` (``choices[].text``, ``logprobs`` with ``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), ``chat.completion`` / ``chat.completion.chunk``
(``message`` / ``delta``, ``logprobs.content[]`` with ``token``, ``logprob``, ``bytes``, ``top_logprobs``), and
``usage`` with ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache) and
``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens`` (draft tokens the
speculative decoder proposed that verification accepted / rejected), present when the deployment reports them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dhisparse.serving.openai.choices import TokenEntry
from dhisparse.serving.tokenization import TokenBytes


@dataclass
class Usage:
    """Token counts of one response (all its prompts and choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    draft_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.accepted_draft_tokens is not None and self.draft_tokens is not None:
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted_draft_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens,
            }
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _text(token_bytes: TokenBytes, token_id: int) -> str:
    return token_bytes.decode([token_id]).decode("utf-8", "replace")


def completion_logprobs(entries: Sequence[TokenEntry], token_bytes: TokenBytes, offset: int,
                        top: bool) -> dict[str, Any]:
    """Completions' ``logprobs`` object for `entries`; `offset` = characters before the first entry's text.
    ``top_logprobs`` maps token text to log-prob, so tokens with the same text (e.g. partial characters, all
    U+FFFD) share one key: it keeps the most likely one's."""
    def alternatives(entry: TokenEntry) -> dict[str, float]:
        out: dict[str, float] = {}
        for token, log_prob in entry.top:  # most likely first
            out.setdefault(_text(token_bytes, token), log_prob)
        return out

    return {
        "tokens": [e.raw.decode("utf-8", "replace") for e in entries],
        "token_logprobs": [e.log_prob for e in entries],
        "top_logprobs": [alternatives(e) for e in entries] if top else None,
        "text_offset": [offset + e.start for e in entries],
    }


def chat_logprobs(entries: Sequence[TokenEntry], token_bytes: TokenBytes) -> dict[str, Any]:
    """Chat's ``logprobs`` object for `entries`."""
    def alternative(token_id: int, log_prob: float) -> dict[str, Any]:
        raw = token_bytes.decode([token_id])
        return {"token": raw.decode("utf-8", "replace"), "logprob": log_prob, "bytes": list(raw)}

    return {"content": [{"token": e.raw.decode("utf-8", "replace"), "logprob": e.log_prob, "bytes": list(e.raw),
                         "top_logprobs": [alternative(t, lp) for t, lp in e.top]} for e in entries]}


def completion(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage: Usage | None) -> dict[str, Any]:
    """A ``text_completion`` (whole, or one stream chunk: then ``usage`` is null except in the usage chunk)."""
    out = {"id": response_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
           "system_fingerprint": None}
    out["usage"] = usage.body() if usage is not None else None
    return out


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
         usage: Usage | None, chunk: bool = False) -> dict[str, Any]:
    """A ``chat.completion``, or one ``chat.completion.chunk``."""
    return {"id": response_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created, "model": model, "choices": choices, "system_fingerprint": None,
            "usage": usage.body() if usage is not None else None}


def chat_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
