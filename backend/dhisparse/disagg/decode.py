"""The generation (decode) role: an ``LLMEngine`` whose requests arrive with imported history.

``add_imported_request`` queues a request together with the :class:`ContextPhaseParams` of its context
phase. Admission is the co-located one: ``kv.try_admit`` reserves the required memory (an admission that
cannot be covered waits, reclaiming optional pages of running requests first, exactly as today) and only
then is the history pulled: one NIXL READ brings the prompt's rows straight into the host-store pages the
admission reserved (``KVManager.history_host_rows``) and the indexer keys and drafter features into a
registered scratch buffer; ``KVManager.import_host_history`` then makes the host pages valid and,
resident-first, keeps complete pages on device as optional pages while the pool has room. Policies
without a host store (``resident``, ``dense``) READ everything into the scratch buffer and use
``import_prompt``. The first token comes from the context phase; decoding (with or without speculation)
is the unchanged engine step.

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

from dhisparse.disagg.loading import load_engine_parts
from dhisparse.disagg.nixl_transfer import NixlImporter, PendingRead, TransferError
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.disagg.trust import check_context  # [#29]
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.request import Request, RequestUpdate, Status
from dhisparse.engine.sampling import SamplingParams
from dhisparse.errors import InvalidRequestError
from dhisparse.model.model import DSAModel
from dhisparse.spec.speculator import Speculator


class DecodeEngine(LLMEngine):
    """Decode engine for imported requests (see the module docstring)."""

    def __init__(self, model: DSAModel, cfg: EngineConfig, speculator: Speculator | None,
                 importer: NixlImporter) -> None:
        super().__init__(model, cfg, speculator)
        self.importer = importer
        self.imports: dict[str, ContextPhaseParams] = {}
        self.errors: dict[str, str] = {}
        # admitted requests whose READ is in flight: request id -> (request, READ, meta offset, host rows or None)
        self.transferring: dict[str, tuple[Request, PendingRead, int, torch.Tensor | None]] = {}
        self._abandoned: dict[str, str] = {}  # request id -> abort reason, for transferring requests cancelled

    # ------------------------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
                    ) -> str:
        raise InvalidRequestError("the generation engine serves only imported requests (generation_only with "
                                  "context_phase_params); use add_imported_request")

    def add_imported_request(self, prompt_token_ids: list[int], params: SamplingParams, context: ContextPhaseParams,
                             request_id: str | None = None) -> str:
        """Queue a request whose context phase ran elsewhere; returns its id."""
        prompt = [int(t) for t in prompt_token_ids]
        self.validate(prompt, params)
        check_context(context, self, prompt)  # [#29] the params fit this engine's layout and were made for this prompt
        if len(prompt) != context.layout.prompt_len:
            raise InvalidRequestError(f"context_phase_params describe a {context.layout.prompt_len}-token prompt, "
                                      f"the request has {len(prompt)} tokens")
        if not 0 <= context.first_token < self.model.cfg.vocab_size:
            raise InvalidRequestError(f"context_phase_params: first token {context.first_token} is outside the "
                                      "vocabulary")
        if (self.spec is not None) != (context.layout.feature_rows > 0):
            raise InvalidRequestError("context_phase_params: drafter features "
                                      f"{'missing' if self.spec is not None else 'present'}; run the context and "
                                      "generation engines with the same speculative setting")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt, params, context.seed)
        self.requests[request_id] = req
        self.imports[request_id] = context
        self.waiting.append(req)
        self.counters["requests_added"] += 1
        return request_id

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        req = self.requests.get(request_id)
        if request_id in self.transferring:  # NIXL may still write into its pages: free them once the READ ended
            if request_id in self._abandoned or req is None:
                return False
            self._abandoned[request_id] = reason
            return True
        context = self.imports.pop(request_id, None)
        if req is not None and req.status is Status.WAITING and context is not None:
            self.importer.release_remote(context)  # never pulled: the prefill side may free its region now
        return super().abort_request(request_id, reason)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.transferring)

    # ----------------------------------------------------------------------------------------- admission
    def _admit_and_prefill(self, updates: list[RequestUpdate]) -> None:
        completed = self._poll_transfers(updates)
        while self.waiting and len(self.running) + len(self.transferring) < self.cfg.max_batch_size:
            req = self.waiting[0]
            try:  # [#29] an admission that raises (host memory short, never admissible) fails this request only
                admitted = self.kv.try_admit(req.request_id, req.prompt_len, req.params.max_tokens)
            except Exception as error:  # [#29] (_finish takes it out of the queue)
                self._fail_import(req, f"admission failed: {error}", updates, self.imports.pop(req.request_id, None))
                continue  # [#29]
            if not admitted:
                if not req.counters.get("waited"):
                    req.counters["waited"] = 1.0
                    self.counters["admissions_waited"] += 1
                break
            self.waiting.popleft()
            req.kv_admitted = True  # LLMEngine._finish releases what the admission reserved
            req.admitted_time = time.perf_counter()
            context = self.imports.pop(req.request_id)
            try:
                self._post(req, context)
            except Exception as error:  # [#29] any failure to start the import fails this request, never the engine
                self._fail_import(req, str(error), updates, context)
        completed += self._poll_transfers(updates)
        if not completed and not self.running and self.transferring:
            time.sleep(0.0002)  # only READs in flight: do not spin the step loop at full speed

    def _poll_transfers(self, updates: list[RequestUpdate]) -> int:
        """Import the histories whose READ completed (their requests join the batch); fail those whose READ failed
        or timed out; free the cancelled ones. Returns how many READs ended."""
        ended = 0
        for request_id, (req, pending, meta_start, rows_at) in list(self.transferring.items()):
            try:
                if not self.importer.check(pending):
                    continue
                error = None
            except TransferError as failure:
                error = str(failure)
            ended += 1
            del self.transferring[request_id]
            self.importer.finish(pending)
            reason = self._abandoned.pop(request_id, None)
            if reason is not None:  # cancelled while the READ was in flight: nothing more to do than free it
                if error is not None:  # a failed READ sends no notification: the context may free its region now
                    self.importer.release_remote(pending.context)
                self._finish(req, reason)
                if reason == "abort":
                    self.counters["requests_aborted"] += 1
                continue
            if error is not None:
                self._fail_import(req, error, updates, pending.context)
                continue
            try:
                features = self._complete(req, pending, meta_start, rows_at)
            except Exception as failure:  # [#29] any failure to import fails this request, never the engine
                self._fail_import(req, str(failure), updates)  # the READ completed: NIXL notified the context
                continue
            context = pending.context
            req.status = Status.RUNNING
            if self.spec is not None:
                assert features is not None
                req.spec_state = self.spec.start(features.to(self.model.device))
            req.num_computed = req.prompt_len
            req.counters["disagg_queue_s"] = context.queue_s
            req.counters["disagg_prefill_s"] = context.prefill_s
            # TTFT split, summed over imported requests (/metrics: divide by `transfers` for means)
            self.counters["context_queue_seconds"] += context.queue_s
            self.counters["context_prefill_seconds"] += context.prefill_s
            self.running.append(req)
            self._append_tokens(req, [context.first_token], updates)
        return ended

    def _post(self, req: Request, context: ContextPhaseParams) -> None:
        """Post the READ of the request's history: prompt rows straight into the host pages its admission
        reserved, indexer keys and drafter features (everything, without a host store) into a buffer."""
        layout = context.layout
        host_rows_of = getattr(self.kv, "history_host_rows", None)
        rows_at = host_rows_of(req.request_id) if host_rows_of is not None else None
        meta_start = 0 if rows_at is None else layout.meta_offset
        buffer = self.importer.buffer(layout.total_bytes - meta_start)
        local, remote, lengths = [], [], []
        if layout.total_bytes > meta_start:
            local.append(np.array([buffer.data_ptr()]))
            remote.append(np.array([meta_start]))
            lengths.append(np.array([layout.total_bytes - meta_start]))
        persistent: list[torch.Tensor] = []
        if rows_at is not None:
            host = self.kv.host.rows  # ChunkedRows: fixed chunks that never move; a page lies in one chunk
            if host.dtype.itemsize != layout.element_bytes or host.row_dim != layout.row_dim:
                raise TransferError(f"context_phase_params: rows of {layout.row_dim} × {layout.rows_dtype} do not "
                                    f"match this engine's host store ({host.row_dim} × {host.dtype})")
            page_rows = self.kv.host.page_rows
            starts = torch.arange(0, layout.prompt_len, page_rows)
            run = (layout.prompt_len - starts).clamp(max=page_rows)
            sources = torch.arange(layout.num_sources).unsqueeze(1)
            first = rows_at[:, starts]  # [S, pages] global host rows of each page's first prompt row
            chunk = first // host.chunk_rows
            bases = torch.tensor([c.data_ptr() for c in host.chunks], dtype=torch.int64)
            local.append((bases[chunk] + (first - chunk * host.chunk_rows) * layout.row_bytes).reshape(-1).numpy())
            remote.append(((sources * layout.prompt_len + starts) * layout.row_bytes).reshape(-1).numpy())
            lengths.append((run * layout.row_bytes).expand(layout.num_sources, -1).reshape(-1).numpy())
            persistent.extend(host.chunks)
        pending = self.importer.post(context, persistent, [buffer], np.concatenate(local), np.concatenate(remote),
                                     np.concatenate(lengths))
        self.transferring[req.request_id] = (req, pending, meta_start, rows_at)

    def _complete(self, req: Request, pending: PendingRead, meta_start: int, rows_at: torch.Tensor | None
                  ) -> torch.Tensor | None:
        """Import a completed READ into the KV manager; returns the drafter features."""
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
        if rows_at is None:
            self.kv.import_prompt(req.request_id, layout.unpack_rows(buffer).clone(), keys)
        else:
            self.kv.import_host_history(req.request_id, keys)
        return features

    def _die(self, reason: str, updates: list[RequestUpdate]) -> None:
        """The engine stops: end the READs in flight too (their requests end with the engine's error)."""
        for request_id, (req, pending, _, _) in list(self.transferring.items()):
            self.importer.finish(pending)
            self.importer.release_remote(pending.context)  # the READ is given up: the context may free its region
            if request_id not in self._abandoned:
                self.waiting.append(req)  # LLMEngine._die ends every waiting request with the error
        self.transferring.clear()
        self._abandoned.clear()
        super()._die(reason, updates)

    def _fail_import(self, req: Request, message: str, updates: list[RequestUpdate],
                     unread: ContextPhaseParams | None = None) -> None:
        """End a request whose history could not be imported. ``unread``: its READ never completed (refused, failed
        or timed out), so no notification reached the context: tell it to free the region now (best effort; it
        frees it at its hold deadline otherwise)."""
        if unread is not None:
            self.importer.release_remote(unread)
        self.errors[req.request_id] = message
        self.counters["transfers_failed"] += 1
        self._end_with_error(req, message, updates)  # frees what the admission reserved; the update names it


def load_decode_engine(engine_dir: str | Path, importer: NixlImporter, **runtime_overrides: Any) -> DecodeEngine:
    """A :class:`DecodeEngine` for an engine directory (``runtime_overrides`` as for ``LLM``)."""
    config, model, speculator = load_engine_parts(engine_dir, **runtime_overrides)
    return DecodeEngine(model, config, speculator, importer)
