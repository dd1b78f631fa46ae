"""Error types raised by the runtime. All derive from ``ValueError`` so callers can catch bad input uniformly."""

from __future__ import annotations


class DHiSparseError(ValueError):
    """Base class of every error the runtime raises on purpose."""


class ConfigError(DHiSparseError):
    """A model, engine or runtime configuration that cannot work; the message says what to change."""


class CheckpointError(DHiSparseError):
    """A checkpoint or engine directory that is missing, incomplete or inconsistent."""


class InvalidRequestError(DHiSparseError):
    """A request the engine refuses (empty prompt, bad sampling parameters, unknown token ids, …)."""


class RequestFailedError(RuntimeError):
    """The engine work a request was part of failed (an exception in its prefill, decode, verification, drafter
    proposal or a KV copy). Only the requests of that work end with this error; the engine goes on serving."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs  # LLM.generate: every request's output, the failed ones included


class EngineDeadError(RuntimeError):
    """The engine stopped: it could not restore its invariants after a fault, or its loop was closed. It admits
    nothing more; every open request ended with this error."""
