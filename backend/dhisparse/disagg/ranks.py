"""A generation engine of several ranks: each rank READs the histories it needs over NIXL into its own host store.

:class:`ParallelDecodeEngine` is the multi-rank engine (``engine/parallel/driver.py``: rank processes over
``torch.distributed``, the driver owning the requests as callers see them) whose ranks import their prompts instead
of prefilling them: the driver passes :class:`NixlRankImports` to every rank, and each rank builds its engine with
:class:`~dhisparse.disagg.imports.NixlImports` over its own NIXL agent (``<agent name>-rank<r>``). The context engine
may have any shape (one process here): the region layout does not depend on how either side is split, because
MLA's latent rows and the indexer keys are whole on every rank.

- **Data-parallel attention**: the driver places each imported request on the group with the least KV demand, as
  it places prefilled ones; only that group's rank READs its rows and indexer keys, into its own host store.
- **Tensor parallelism**: every rank holds every request and the same KV rows, so every rank READs the same
  region. The ranks agree on when a READ ended (``NixlImports`` with an agreement over the ranks' collectives): a
  request joins the batch in the same step on every rank, or fails on every rank with the same message. Each
  rank's READ notifies the context side with its place among the readers, and the context side frees the region
  when every reader's notification arrived (``nixl_transfer.reader_mark``).

Trust: the params are the context role's signed output (checked where they enter: the Triton model's
``ContextPhaseParams.from_bytes`` with the deployment's key). The driver checks them against rank 0's
:class:`~dhisparse.disagg.trust.LayoutTemplate` and the prompt before placing the request, and every rank that
holds it checks them again against its own engine (``trust.check_context`` in ``NixlImports.queue``), so no rank
READs a region that does not fit its host pages or was made for another prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dhisparse.disagg.imports import NixlImports
from dhisparse.disagg.nixl_transfer import NixlImporter
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.disagg.trust import LayoutTemplate, check_context, layout_template
from dhisparse.engine.executor import Executor
from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.loading import load_engine_config
from dhisparse.engine.parallel.driver import ParallelEngine
from dhisparse.engine.parallel.group import RankCollectives
from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.engine.prompts import PromptSource
from dhisparse.engine.request import Request, RequestUpdate
from dhisparse.errors import InvalidRequestError
from dhisparse.sampling import SamplingParams


@dataclass(frozen=True)
class NixlRankImports:
    """The ranks' imports (``engine.parallel.imports.RankImports``): each rank READs with its own agent
    ``<agent_name>-rank<r>``; tensor-parallel ranks agree on when READs end and count as the region's readers."""

    agent_name: str
    timeout_s: float
    shape: ParallelShape

    def prompts(self, rank: int, comm: RankCollectives) -> Callable[[Executor], PromptSource]:
        readers = self.shape.tensor_parallel_size
        importer = NixlImporter(f"{self.agent_name}-rank{rank}", self.timeout_s, reader=rank % readers,
                                readers=readers)

        def agree(codes: list[int]) -> list[list[int]]:
            return comm.gather_codes(codes, "disagg")

        return lambda executor: NixlImports(executor, importer, agree if readers > 1 else None)

    def describe(self, engine: LLMEngine) -> LayoutTemplate:
        return layout_template(engine)

    def queue(self, engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
              imported: Any) -> None:
        if not isinstance(imported, ContextPhaseParams):
            raise InvalidRequestError("a generation rank imports context_phase_params only")
        imports = engine.prompts
        assert isinstance(imports, NixlImports)
        imports.queue(engine, prompt, params, imported, request_id)


class GenerationFront:
    """What both generation engines (this module's and :class:`~dhisparse.disagg.decode.DecodeEngine`) forward
    unchanged to the engine they wrap (``engine``): requests, the dead flag, validation, progress, statistics and
    aborts; a request without imported history is refused."""

    engine: Any  # LLMEngine or ParallelEngine

    @property
    def requests(self) -> dict[str, Request]:
        return self.engine.requests

    @property
    def dead(self) -> str | None:
        return self.engine.dead

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def poll_idle(self) -> None:
        self.engine.poll_idle()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        return self.engine.abort_request(request_id, reason)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
                    ) -> str:
        raise InvalidRequestError("the generation engine serves only imported requests (generation_only with "
                                  "context_phase_params); use add_imported_request")


class ParallelDecodeEngine(GenerationFront):
    """The generation engine over ranks (module docstring), with :class:`~dhisparse.disagg.decode.DecodeEngine`'s
    surface. ``importer``: its name and timeout name the ranks' agents and bound their READs; it is closed with the
    engine (the ranks READ with their own agents)."""

    def __init__(self, engine_dir: str | Path, importer: NixlImporter, **runtime_overrides: Any) -> None:
        config = load_engine_config(engine_dir, **runtime_overrides)
        self.importer = importer
        imports = NixlRankImports(importer.name, importer.timeout_s, ParallelShape.of(config))
        self.engine = ParallelEngine(engine_dir, config, dict(runtime_overrides), imports=imports)
        template = self.engine.imports_description
        assert isinstance(template, LayoutTemplate), template
        self.layout_template: LayoutTemplate = template
        self.errors: dict[str, str] = {}  # the ranks' messages travel in the updates (RequestUpdate.error)


    def step(self) -> list[RequestUpdate]:
        updates = self.engine.step()
        if not updates:
            time.sleep(0.0002)  # nothing decoded: only READs in flight, do not spin the step loop at full speed
        return updates

    def add_imported_request(self, prompt_token_ids: list[int], params: SamplingParams, context: ContextPhaseParams,
                             request_id: str | None = None) -> str:
        """Queue a request whose context phase ran elsewhere on the ranks that own it (checked here against rank
        0's layout and the prompt, and again on each of those ranks); returns its id."""
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.validate(prompt, params)
        check_context(context, self.layout_template, prompt)
        return self.engine.add_request(prompt, params, request_id, seed=context.seed, imported=context)

    def close(self) -> None:
        self.engine.close()
        self.importer.close()
