"""OpenAI's error object and HTTP statuses, and how an error from the Triton deployment maps onto them.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; the official
client raises ``BadRequestError`` for 400, ``NotFoundError`` for 404, ``InternalServerError`` for 5xx):

- 400 ``invalid_request_error``: a parameter the server refuses (``param`` names it), or a request the engine
  refuses (its `InvalidRequestError` text: prompt too long, token ids outside the vocabulary, …).
- 413 ``invalid_request_error`` (``code`` ``limit_exceeded``): a body over the ``max_request_bytes`` limit
  (`edge_limits`); a request over another per-request limit is a 400 with that code.
- 404 ``not_found_error`` (``code`` ``model_not_found``): a model name this server does not serve.
- 500 ``internal_server_error``: the engine work the request was part of failed (``engine step failed: …``).
- 503 ``service_unavailable``: the engine stopped after a fault it could not recover from, its Triton model is not
  loaded or not ready, or Triton cannot be reached.

Over a Triton gRPC stream an error arrives as text only (no status code), so `from_triton` classifies it by the
messages this project's models and Triton itself produce; anything it does not recognise as an engine or deployment
failure is the request's fault (400), since the front end sends only well-formed tensors.
"""

from __future__ import annotations

import re
from typing import Any

# Texts of EngineDeadError (engine/loop.py, engine/llm_engine.py) and of a Triton model that is gone or not ready.
_UNAVAILABLE = re.compile(
    r"the engine (?:is stopped|stopped after a fault|loop is shut down|loop was shut down|thread is not running)"
    r"|unknown model|is not ready|no available versions|not found|failed to connect|connection refused"
    r"|unavailable|Socket closed",
    re.IGNORECASE,
)
# A failed engine step (RequestFailedError) or a request that failed inside the serving layer.
_FAILED = re.compile(r"engine step failed|^request failed|engine loop stopped before", re.IGNORECASE)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """An error answered as OpenAI's error object with HTTP `status`.

    Args:
        status: HTTP status (400, 404, 413, 500, 503).
        message: what went wrong, for the client.
        param: the request parameter at fault, when one is.
        code: OpenAI's machine-readable code (e.g. ``model_not_found``), when one applies.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist: this server serves `{served}`", "model",
                       "model_not_found")


def from_triton(message: str) -> OpenAIError:
    """The OpenAI error for an error text received from the Triton deployment (see the module docstring)."""
    if _UNAVAILABLE.search(message):
        return OpenAIError(503, f"the engine is unavailable: {message}")
    if _FAILED.search(message):
        return OpenAIError(500, message)
    return OpenAIError(400, message)
