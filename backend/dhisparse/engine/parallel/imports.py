"""How the ranks of a generation engine get imported prompts: the :class:`RankImports` hook.

A disaggregated generation engine of several ranks (``dhisparse.disagg.ranks``) runs on every rank the same
``LLMEngine`` as a co-located one, with a prompt source that READs each request's history over NIXL instead of
prefilling it. The engine layer knows that source only through this protocol: a picklable object the driver puts in
the :class:`~dhisparse.engine.parallel.rank.RankLaunch`, from which every rank builds its engine's prompt source, and
which queues each imported request on the rank that owns it (``Add.imported``: the request's context-phase
parameters, opaque here). Rank 0's :meth:`RankImports.describe` reaches the driver in its
:class:`~dhisparse.engine.parallel.messages.Ready`, so that the driver can refuse a request before placing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dhisparse.engine.executor import Executor
from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.parallel.group import RankCollectives
from dhisparse.engine.prompts import PromptSource
from dhisparse.sampling import SamplingParams


class RankImports(Protocol):
    """A rank's source of imported prompts (module docstring). Picklable; every rank gets the same object."""

    def prompts(self, rank: int, comm: RankCollectives) -> Callable[[Executor], PromptSource]:
        """The prompt source of ``rank``'s engine (``comm``: the rank's collectives, e.g. for tensor-parallel ranks
        to agree on when a transfer ended)."""
        ...

    def describe(self, engine: LLMEngine) -> Any:
        """What the driver checks an imported request against (rank 0's answer, in ``Ready.imports``)."""
        ...

    def queue(self, engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
              imported: Any) -> None:
        """Queue an imported request on this rank's engine; raises ``InvalidRequestError`` to refuse it."""
        ...
