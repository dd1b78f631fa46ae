"""How an admitted request's prompt reaches the KV store: a :class:`PromptSource` the engine is built with.

- :class:`LocalPrefill` (co-located serving): the executor prefills the prompt at admission and samples the first
  token at once.
- ``dhisparse.disagg.decode.NixlImports`` (disaggregated decode): the prompt's history was computed by a context
  engine; admission starts its transfer and the request joins the batch when the transfer completes
  (:meth:`PromptSource.poll`), with the first token the context engine sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dhisparse.engine.executor import Executor, Sampled
from dhisparse.engine.request import Request


@dataclass
class Arrival:
    """A prompt that finished arriving: ``first`` is the request's first token (``error`` None), ``features`` the
    drafter's context features ``[W, F]`` when speculating; or the transfer failed (``error``), or the request was
    cancelled while it was in flight (``cancelled``: ``"abort"`` / ``"stop"``)."""

    request: Request
    first: Sampled | None = None
    features: torch.Tensor | None = None
    error: str | None = None
    cancelled: str | None = None


class PromptSource(Protocol):
    """The engine's source of imported histories (see the module docstring)."""

    def start(self, req: Request) -> Sampled | None:
        """The request was admitted: compute its prompt now (returns its first token, the request runs) or start
        bringing it (``None``: it arrives through :meth:`poll`). An exception fails this request only."""
        ...

    def poll(self) -> list[Arrival]:
        """Prompts whose arrival ended since the last call."""
        ...

    def cancel(self, req: Request, reason: str) -> bool:
        """``req`` is cancelled: ``True`` when it is in flight (it is freed when its transfer ends, reported by
        :meth:`poll`); ``False``: the engine frees it now (waiting requests are told to the source as well)."""
        ...

    def in_flight(self) -> int:
        """Prompts still arriving."""
        ...

    def close(self) -> set[str]:
        """The engine stops: give up every transfer in flight; returns the ids of the requests cancelled while in
        flight (the engine ends them without an error update; it ends every other request with one)."""
        ...

    def stats(self) -> dict[str, float]:
        ...


class LocalPrefill:
    """Co-located serving: the prompt is prefilled by this engine's executor at admission."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def start(self, req: Request) -> Sampled:
        return self.executor.prefill(req)

    def poll(self) -> list[Arrival]:
        return []

    def cancel(self, req: Request, reason: str) -> bool:
        return False

    def in_flight(self) -> int:
        return 0

    def close(self) -> set[str]:
        return set()

    def stats(self) -> dict[str, float]:
        return {}
