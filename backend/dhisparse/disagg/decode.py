"""The generation (decode) role: an ``LLMEngine`` whose requests arrive with imported history.

:class:`DecodeEngine` composes the co-located engine with :class:`~dhisparse.disagg.imports.NixlImports`, the
engine's :class:`~dhisparse.engine.prompts.PromptSource` for histories computed elsewhere (``disagg/imports.py``:
admission, the READ into the host pages the admission reserved, the import). ``add_imported_request`` queues a
request together with the :class:`ContextPhaseParams` of its context phase; decoding (with or without speculation)
is the unchanged engine step. A generation engine of several ranks (``tensor_parallel_size`` or
``data_parallel_size`` above 1) is :class:`~dhisparse.disagg.ranks.ParallelDecodeEngine`, with the same surface:
:func:`load_decode_engine` picks it.

Why READ (pull) rather than WRITE (push): the decode side knows when it has memory (admission) and where
the rows must land (host pages chosen at admission), so it pulls exactly then; the prefill side only
publishes and holds its region until the READ's completion notification arrives (or a hold deadline
passes), the scheme vLLM's NIXL connector uses. A push would need the decode side to reserve and
advertise memory before it could admit, i.e. to admit early.

A transfer that fails or times out ends that request with an error (finish reason ``"error"``, the message
in :attr:`DecodeEngine.errors`) and frees what the admission reserved; cancelling a request that waits for
admission tells the prefill side to release its region.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dhisparse.disagg.imports import NixlImports
from dhisparse.disagg.nixl_transfer import NixlImporter, PendingRead
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.disagg.ranks import GenerationFront, ParallelDecodeEngine
from dhisparse.disagg.trust import LayoutTemplate, layout_template
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.executor import Model
from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.loading import load_engine_config, load_engine_parts
from dhisparse.engine.request import Request, RequestUpdate
from dhisparse.kv.store import HostRowsTarget, KVStore
from dhisparse.sampling import SamplingParams
from dhisparse.spec.speculator import Speculator


class DecodeEngine(GenerationFront):
    """Decode engine for imported requests (see the module docstring): the co-located :class:`LLMEngine` with
    :class:`NixlImports` as its prompt source."""

    def __init__(self, model: Model, cfg: EngineConfig, speculator: Speculator | None,
                 importer: NixlImporter) -> None:
        self.importer = importer
        self.engine = LLMEngine(model, cfg, speculator,
                                prompts=lambda executor: NixlImports(executor, importer))
        imports = self.engine.prompts
        assert isinstance(imports, NixlImports)
        self.imports = imports

    # The engine's public surface, unchanged.
    @property
    def kv(self) -> KVStore:
        return self.engine.kv

    @property
    def errors(self) -> dict[str, str]:
        return self.imports.errors

    @property
    def transferring(self) -> dict[str, tuple[Request, PendingRead, int, HostRowsTarget | None]]:
        return self.imports.transferring

    def step(self) -> list[RequestUpdate]:
        updates = self.engine.step()
        if not updates and not self.engine.scheduler.running and self.imports.transferring:
            time.sleep(0.0002)  # only READs in flight: do not spin the step loop at full speed
        return updates

    # ------------------------------------------------------------------------------------------- requests
    def add_imported_request(self, prompt_token_ids: list[int], params: SamplingParams, context: ContextPhaseParams,
                             request_id: str | None = None) -> str:
        """Queue a request whose context phase ran elsewhere (its params checked first: ``trust.check_context``);
        returns its id."""
        return self.imports.queue(self.engine, prompt_token_ids, params, context, request_id)

    @property
    def layout_template(self) -> LayoutTemplate:
        """What this engine expects of a region (``trust.check_context``)."""
        return layout_template(self.engine)

    def close(self) -> None:
        self.importer.close()


def load_decode_engine(engine_dir: str | Path, importer: NixlImporter, **runtime_overrides: Any
                       ) -> DecodeEngine | ParallelDecodeEngine:
    """A generation engine for an engine directory (``runtime_overrides`` as for ``LLM``): a :class:`DecodeEngine`,
    or, when the parallel shape has several ranks, a :class:`ParallelDecodeEngine` whose ranks READ with agents
    named after ``importer`` (``<name>-rank<r>``, its timeout)."""
    if load_engine_config(engine_dir, **runtime_overrides).world_size > 1:
        return ParallelDecodeEngine(engine_dir, importer, **runtime_overrides)
    config, model, speculator = load_engine_parts(engine_dir, **runtime_overrides)
    return DecodeEngine(model, config, speculator, importer)
