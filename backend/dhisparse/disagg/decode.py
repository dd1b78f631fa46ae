"""The generation (decode) role: an ``LLMEngine`` whose requests arrive with imported history.

:class:`DecodeEngine` composes the co-located engine with :class:`NixlImports`, the engine's
:class:`~dhisparse.engine.prompts.PromptSource` for histories computed elsewhere. ``add_imported_request`` queues a
request together with the :class:`ContextPhaseParams` of its context phase. Admission is the co-located one:
``kv.try_admit`` reserves the required memory (an admission that cannot be covered waits, reclaiming optional pages
of running requests first, exactly as today) and only then is the history pulled: one NIXL READ brings the prompt's
rows straight into the host-store pages the admission reserved (``KVStore.import_target``) and the indexer keys and
drafter features into a registered scratch buffer; ``KVStore.import_prompt(…, None, keys)`` then makes the host
pages valid and, resident-first, keeps complete pages on device as optional pages while the pool has room. Policies
without a host store (``resident``, ``dense``) READ everything into the scratch buffer and hand the rows to
``import_prompt``. The first token comes from the context phase; decoding (with or without speculation) is the
unchanged engine step.

Why READ (pull) rather than WRITE (push): the decode side knows when it has memory (admission) and where
the rows must land (host pages chosen at admission), so it pulls exactly then; the prefill side only
publishes and holds its region until the READ's completion notification arrives (or a hold deadline
passes), the scheme vLLM's NIXL connector uses. A push would need the decode side to reserve and
advertise memory before it could admit, i.e. to admit early.

A transfer that fails or times out ends that request with an error (finish reason ``"error"``, the message
in :attr:`DecodeEngine.errors`) and frees what the admission reserved; cancelling a request that waits for
admission tells the prefill side to release its region.

Transfers are asynchronous: admission posts the READ (the request then holds its admission and a batch slot,
in :attr:`DecodeEngine.transferring`) and every later step polls it, so the running requests keep decoding while
histories arrive; a completed READ is imported and its request joins the batch with its first token. The host
store's chunks never move, so the pages a READ writes stay where the admission put them. A request cancelled
while its READ is in flight keeps its memory until the READ ended (NIXL may still write into it), then is freed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dhisparse.disagg.nixl_transfer import NixlImporter, PendingRead, TransferError
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.disagg.trust import check_context  # [#29]
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.executor import Executor, Model, Sampled
from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.loading import load_engine_parts
from dhisparse.engine.prompts import Arrival
from dhisparse.engine.request import Request, RequestUpdate, Status
from dhisparse.errors import InvalidRequestError
from dhisparse.kv.store import HostRowsTarget, KVStore
from dhisparse.sampling import SamplingParams
from dhisparse.spec.speculator import Speculator


class NixlImports:
    """Imported histories over NIXL: the decode engine's prompt source (see the module docstring).

    ``contexts`` holds the context-phase parameters of queued requests; an admitted request's READ is in
    :attr:`transferring` until it ends."""

    def __init__(self, executor: Executor, importer: NixlImporter) -> None:
        self.kv: KVStore = executor.kv
        self.importer = importer
        self.contexts: dict[str, ContextPhaseParams] = {}
        self.errors: dict[str, str] = {}  # request id -> why its import failed (the generation model's message)
        # admitted requests whose READ is in flight: request id -> (request, READ, meta offset, host rows or None)
        self.transferring: dict[str, tuple[Request, PendingRead, int, HostRowsTarget | None]] = {}
        self._abandoned: dict[str, str] = {}  # request id -> abort reason, for transferring requests cancelled
        self.counters: dict[str, float] = dict.fromkeys(
            ("transfers", "transfer_seconds", "transfer_bytes", "transfers_failed", "context_queue_seconds",
             "context_prefill_seconds"), 0.0)

    def start(self, req: Request) -> Sampled | None:
        """Post the READ of the admitted request's history; it joins the batch when the READ completed."""
        context = self.contexts.pop(req.request_id)
        try:
            self._post(req, context)
        except Exception as error:  # [#29] any failure to start the import: release the region, fail this request
            self.importer.release_remote(context)  # never pulled: the context may free its region now
            self.counters["transfers_failed"] += 1
            self.errors[req.request_id] = str(error)
            raise
        return None

    def _post(self, req: Request, context: ContextPhaseParams) -> None:
        """Post the READ of the request's history: prompt rows straight into the host pages its admission
        reserved, indexer keys and drafter features (everything, without a host store) into a buffer."""
        layout = context.layout
        target = self.kv.import_target(req.request_id)
        meta_start = 0 if target is None else layout.meta_offset
        buffer = self.importer.buffer(layout.total_bytes - meta_start)
        local, remote, lengths = [], [], []
        if layout.total_bytes > meta_start:
            local.append(np.array([buffer.data_ptr()]))
            remote.append(np.array([meta_start]))
            lengths.append(np.array([layout.total_bytes - meta_start]))
        persistent: list[torch.Tensor] = []
        if target is not None:
            host = target.rows  # ChunkedRows: fixed chunks that never move; a page lies in one chunk
            if host.dtype.itemsize != layout.element_bytes or host.row_dim != layout.row_dim:
                raise TransferError(f"context_phase_params: rows of {layout.row_dim} × {layout.rows_dtype} do not "
                                    f"match this engine's host store ({host.row_dim} × {host.dtype})")
            page_rows = target.page_rows
            starts = torch.arange(0, layout.prompt_len, page_rows)
            run = (layout.prompt_len - starts).clamp(max=page_rows)
            sources = torch.arange(layout.num_sources).unsqueeze(1)
            first = target.row_index[:, starts]  # [S, pages] global host rows of each page's first prompt row
            chunk = first // host.chunk_rows
            bases = torch.tensor([c.data_ptr() for c in host.chunks], dtype=torch.int64)
            local.append((bases[chunk] + (first - chunk * host.chunk_rows) * layout.row_bytes).reshape(-1).numpy())
            remote.append(((sources * layout.prompt_len + starts) * layout.row_bytes).reshape(-1).numpy())
            lengths.append((run * layout.row_bytes).expand(layout.num_sources, -1).reshape(-1).numpy())
            persistent.extend(host.chunks)
        pending = self.importer.post(context, persistent, [buffer], np.concatenate(local), np.concatenate(remote),
                                     np.concatenate(lengths))
        self.transferring[req.request_id] = (req, pending, meta_start, target)

    def poll(self) -> list[Arrival]:
        """Import the histories whose READ completed (their requests join the batch); fail those whose READ failed
        or timed out; free the cancelled ones."""
        ended: list[Arrival] = []
        for request_id, (req, pending, meta_start, target) in list(self.transferring.items()):
            try:
                if not self.importer.check(pending):
                    continue
                error = None
            except TransferError as failure:
                error = str(failure)
            del self.transferring[request_id]
            self.importer.finish(pending)
            reason = self._abandoned.pop(request_id, None)
            if reason is not None:  # cancelled while the READ was in flight: nothing more to do than free it
                if error is not None:  # a failed READ sends no notification: the context may free its region now
                    self.importer.release_remote(pending.context)
                ended.append(Arrival(req, cancelled=reason))
                continue
            if error is not None:
                self.importer.release_remote(pending.context)
                ended.append(self._failed(req, error))
                continue
            try:
                features = self._complete(req, pending, meta_start, target)
            except Exception as failure:  # [#29] any import failure fails this request, never the engine (the READ
                # completed: NIXL notified the context)
                ended.append(self._failed(req, str(failure)))
                continue
            context = pending.context
            req.counters["disagg_queue_s"] = context.queue_s
            req.counters["disagg_prefill_s"] = context.prefill_s
            # TTFT split, summed over imported requests (/metrics: divide by `transfers` for means)
            self.counters["context_queue_seconds"] += context.queue_s
            self.counters["context_prefill_seconds"] += context.prefill_s
            ended.append(Arrival(req, Sampled([context.first_token]), features))
        return ended

    def _failed(self, req: Request, message: str) -> Arrival:
        self.errors[req.request_id] = message
        self.counters["transfers_failed"] += 1
        return Arrival(req, error=message)

    def _complete(self, req: Request, pending: PendingRead, meta_start: int, target: HostRowsTarget | None
                  ) -> torch.Tensor | None:
        """Import a completed READ into the KV store; returns the drafter features."""
        layout = pending.context.layout
        seconds = time.monotonic() - pending.started
        req.counters["disagg_transfer_s"] = seconds
        req.counters["disagg_transfer_bytes"] = float(layout.total_bytes)
        self.counters["transfer_seconds"] += seconds
        self.counters["transfer_bytes"] += layout.total_bytes
        self.counters["transfers"] += 1
        buffer = pending.buffers[0]
        keys = {k: v.clone() for k, v in layout.unpack_keys(buffer, meta_start).items()}
        features = layout.unpack_features(buffer, meta_start)
        features = features.clone() if features is not None else None
        rows = layout.unpack_rows(buffer).clone() if target is None else None
        self.kv.import_prompt(req.request_id, rows, keys)
        return features

    def cancel(self, req: Request, reason: str) -> bool:
        if req.request_id in self.transferring:  # NIXL may still write into its pages: free them once the READ ended
            self._abandoned.setdefault(req.request_id, reason)
            return True
        context = self.contexts.pop(req.request_id, None)
        if context is not None and req.status is Status.WAITING:
            self.importer.release_remote(context)  # never pulled: the prefill side may free its region now
        return False

    def in_flight(self) -> int:
        return len(self.transferring)

    def close(self) -> set[str]:
        """The engine stops: give up the READs in flight; returns the ids of those cancelled meanwhile."""
        for pending in [p for _, p, _, _ in self.transferring.values()]:
            self.importer.finish(pending)
            self.importer.release_remote(pending.context)  # the READ is given up: the context may free its region
        cancelled = set(self._abandoned)
        self.transferring.clear()
        self._abandoned.clear()
        return cancelled

    def stats(self) -> dict[str, float]:
        return dict(self.counters)


class DecodeEngine:
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
    def requests(self) -> dict[str, Request]:
        return self.engine.requests

    @property
    def kv(self) -> KVStore:
        return self.engine.kv

    @property
    def dead(self) -> str | None:
        return self.engine.dead

    @property
    def errors(self) -> dict[str, str]:
        return self.imports.errors

    @property
    def transferring(self) -> dict[str, tuple[Request, PendingRead, int, HostRowsTarget | None]]:
        return self.imports.transferring

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    def step(self) -> list[RequestUpdate]:
        updates = self.engine.step()
        if not updates and not self.engine.scheduler.running and self.imports.transferring:
            time.sleep(0.0002)  # only READs in flight: do not spin the step loop at full speed
        return updates

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def poll_idle(self) -> None:
        self.engine.poll_idle()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        return self.engine.abort_request(request_id, reason)

    # ------------------------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
                    ) -> str:
        raise InvalidRequestError("the generation engine serves only imported requests (generation_only with "
                                  "context_phase_params); use add_imported_request")

    def add_imported_request(self, prompt_token_ids: list[int], params: SamplingParams, context: ContextPhaseParams,
                             request_id: str | None = None) -> str:
        """Queue a request whose context phase ran elsewhere; returns its id."""
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.validate(prompt, params)
        check_context(context, self, prompt)  # [#29] the params fit this engine's layout and were made for this prompt
        if len(prompt) != context.layout.prompt_len:
            raise InvalidRequestError(f"context_phase_params describe a {context.layout.prompt_len}-token prompt, "
                                      f"the request has {len(prompt)} tokens")
        if not 0 <= context.first_token < self.engine.model.cfg.vocab_size:
            raise InvalidRequestError(f"context_phase_params: first token {context.first_token} is outside the "
                                      "vocabulary")
        if (self.engine.spec is not None) != (context.layout.feature_rows > 0):
            raise InvalidRequestError("context_phase_params: drafter features "
                                      f"{'missing' if self.engine.spec is not None else 'present'}; run the context "
                                      "and generation engines with the same speculative setting")
        if request_id is not None and request_id in self.engine.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rid = self.engine.add_request(prompt, params, request_id, seed=context.seed)
        self.imports.contexts[rid] = context
        return rid


def load_decode_engine(engine_dir: str | Path, importer: NixlImporter, **runtime_overrides: Any) -> DecodeEngine:
    """A :class:`DecodeEngine` for an engine directory (``runtime_overrides`` as for ``LLM``)."""
    config, model, speculator = load_engine_parts(engine_dir, **runtime_overrides)
    return DecodeEngine(model, config, speculator, importer)
