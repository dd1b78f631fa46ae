"""Imported histories over NIXL: the generation engine's :class:`~dhisparse.engine.prompts.PromptSource`.

:meth:`NixlImports.queue` checks a request's :class:`ContextPhaseParams` against the engine and the prompt
(``trust.check_context``) and queues the request with them. Admission is the co-located one: ``kv.try_admit``
reserves the required memory (an admission that cannot be covered waits, reclaiming optional pages of running
requests first) and only then is the history pulled (:meth:`NixlImports.start`): one NIXL READ brings the prompt's
rows straight into the host-store pages the admission reserved (``KVStore.import_target``) and the indexer keys and
drafter features into a registered scratch buffer; ``KVStore.import_prompt(…, None, keys)`` then makes the host
pages valid and, resident-first, keeps complete pages on device as optional pages while the pool has room. Policies
without a host store (``resident``, ``dense``) READ everything into the scratch buffer and hand the rows to
``import_prompt``. The first token comes from the context phase.

Transfers are asynchronous: admission posts the READ (the request then holds its admission and a batch slot, in
:attr:`NixlImports.transferring`) and every later step polls it; a completed READ is imported and its request joins
the batch with its first token. The host store's chunks never move, so the pages a READ writes stay where the
admission put them. A request cancelled while its READ is in flight keeps its memory until the READ ended (NIXL may
still write into it), then is freed. A READ that fails or times out ends that request with an error (the message in
:attr:`NixlImports.errors`) and frees what the admission reserved.

Agreement (the tensor-parallel ranks of a generation engine, ``disagg/ranks.py``): every rank READs the same rows
into its own host store, but when each READ completes is a matter of timing, and a request that joined the batch on
one rank a step earlier than on another would make the ranks diverge. With ``agree`` (every rank's per-request
outcomes, all-gathered) a request's READ ends when it ended on *every* rank, in the same step everywhere: imported
when it succeeded on all of them, failed (the same message on every rank) when it failed on any, including a READ
that could not start on some rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from dhisparse.disagg.nixl_transfer import NixlImporter, PendingRead, TransferError
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.disagg.trust import check_context, layout_template  # [#29]
from dhisparse.engine.executor import Executor, Sampled
from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.prompts import Arrival
from dhisparse.engine.request import Request, Status
from dhisparse.errors import InvalidRequestError
from dhisparse.kv.store import HostRowsTarget, KVStore
from dhisparse.sampling import SamplingParams

log = logging.getLogger("dhisparse")

# A READ's outcome on one rank, as the agreement exchanges it
IN_FLIGHT, DONE, FAILED = 0, 1, 2
# every rank's outcome codes (rank order) from this rank's, one per request in flight (the same requests everywhere)
Agreement = Callable[[list[int]], list[list[int]]]


class NixlImports:
    """Imported histories over NIXL: the decode engine's prompt source (see the module docstring).

    ``contexts`` holds the context-phase parameters of queued requests; an admitted request's READ is in
    :attr:`transferring` until it ends. ``agree``: the agreement of tensor-parallel ranks (module docstring)."""

    def __init__(self, executor: Executor, importer: NixlImporter, agree: Agreement | None = None) -> None:
        self.kv: KVStore = executor.kv
        self.importer = importer
        self.agree = agree
        self._ended: dict[str, str] = {}  # request id -> its READ's local outcome ("" done, else why it failed)
        self.contexts: dict[str, ContextPhaseParams] = {}
        self.errors: dict[str, str] = {}  # request id -> why its import failed (the generation model's message)
        # admitted requests whose READ is in flight: request id -> (request, READ, meta offset, host rows or None)
        self.transferring: dict[str, tuple[Request, PendingRead, int, HostRowsTarget | None]] = {}
        self._abandoned: dict[str, str] = {}  # request id -> abort reason, for transferring requests cancelled
        self.counters: dict[str, float] = dict.fromkeys(
            ("transfers", "transfer_seconds", "transfer_bytes", "transfer_bytes_cached", "transfers_failed",
             "context_queue_seconds", "context_prefill_seconds"), 0.0)

    def queue(self, engine: LLMEngine, prompt_token_ids: list[int], params: SamplingParams,
              context: ContextPhaseParams, request_id: str | None = None) -> str:
        """Queue on ``engine`` (whose prompt source this is) a request whose context phase ran elsewhere, after
        checking the params against the engine and the prompt; returns its id."""
        prompt = [int(t) for t in prompt_token_ids]
        engine.validate(prompt, params)
        check_context(context, layout_template(engine), prompt)  # [#29] they fit this engine, made for this prompt
        if request_id is not None and request_id in engine.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rid = engine.add_request(prompt, params, request_id, seed=context.seed)
        self.contexts[rid] = context
        return rid

    def start(self, req: Request) -> Sampled | None:
        """Post the READ of the admitted request's history; it joins the batch when the READ completed."""
        context = self.contexts.pop(req.request_id)
        try:
            self._post(req, context)
        except Exception as error:  # [#29] any failure to start the import: release the region, fail this request
            if self.agree is not None:  # tensor-parallel ranks: it fails through the agreement, on every rank at once
                never = PendingRead(context, None, 0.0, time.monotonic(), [], finished=True)
                self.transferring[req.request_id] = (req, never, 0, None)
                self._ended[req.request_id] = f"transfer of {context.request_key!r} could not start: {error}"
                return None
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
            # pages of a cached prefix (prefix reuse) are held already: only the pages after it are pulled
            starts = torch.arange(target.cached_rows, layout.prompt_len, page_rows)
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
        # bytes READ; the rows of a cached prefix (prefix reuse) are held already and not pulled
        req.counters["disagg_transfer_bytes"] = float(sum(int(n.sum()) for n in lengths))
        req.counters["disagg_transfer_bytes_cached"] = float(
            0 if target is None else target.cached_rows * layout.num_sources * layout.row_bytes)
        self.transferring[req.request_id] = (req, pending, meta_start, target)

    def poll(self) -> list[Arrival]:
        """Import the histories whose READ completed (their requests join the batch); fail those whose READ failed
        or timed out; free the cancelled ones (under ``agree``: once the READ ended on every rank)."""
        entries = list(self.transferring.items())
        outcomes = [self._outcome(request_id, pending) for request_id, (_, pending, _, _) in entries]
        verdicts = outcomes if self.agree is None else self._agreed(entries, outcomes)
        ended: list[Arrival] = []
        for (request_id, (req, pending, meta_start, target)), verdict in zip(entries, verdicts, strict=True):
            if verdict is None:
                continue
            error = verdict or None
            local = self._ended.pop(request_id, "")
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
                ended.append(self._failed(req, error, local if local != error else ""))
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

    def _outcome(self, request_id: str, pending: PendingRead) -> str | None:
        """This rank's outcome of the request's READ: None in flight, "" done, else why it failed (kept once
        known: under agreement a READ that ended here may wait for the other ranks')."""
        if request_id in self._ended:
            return self._ended[request_id]
        try:
            if not self.importer.check(pending):
                return None
            outcome = ""
        except TransferError as failure:
            outcome = str(failure) or "the transfer failed"
        self._ended[request_id] = outcome
        return outcome

    def _agreed(self, entries: list[tuple[str, tuple[Request, PendingRead, int, HostRowsTarget | None]]],
                outcomes: list[str | None]) -> list[str | None]:
        """The verdicts every rank reaches from every rank's outcomes: None until the READ ended on every rank,
        then "" (done everywhere) or one message naming the ranks where it failed (the same on every rank)."""
        assert self.agree is not None
        codes = [IN_FLIGHT if o is None else DONE if o == "" else FAILED for o in outcomes]
        every = self.agree(codes)
        verdicts: list[str | None] = []
        for i, (_, (_, pending, _, _)) in enumerate(entries):
            column = [rank_codes[i] for rank_codes in every]
            if IN_FLIGHT in column:
                verdicts.append(None)
            elif all(code == DONE for code in column):
                verdicts.append("")
            else:
                failed = ", ".join(str(r) for r, code in enumerate(column) if code == FAILED)
                if outcomes[i]:
                    log.warning("tensor-parallel rank's READ failed: %s", outcomes[i])
                verdicts.append(f"transfer of {pending.context.request_key!r} from {pending.context.agent_name!r} "
                                f"failed on tensor-parallel rank(s) {failed}")
        return verdicts

    def _failed(self, req: Request, message: str, detail: str = "") -> Arrival:
        self.errors[req.request_id] = f"{message}: {detail}" if detail else message
        self.counters["transfers_failed"] += 1
        return Arrival(req, error=message)

    def _complete(self, req: Request, pending: PendingRead, meta_start: int, target: HostRowsTarget | None
                  ) -> torch.Tensor | None:
        """Import a completed READ into the KV store; returns the drafter features."""
        layout = pending.context.layout
        seconds = time.monotonic() - pending.started
        req.counters["disagg_transfer_s"] = seconds
        self.counters["transfer_seconds"] += seconds
        self.counters["transfer_bytes"] += req.counters["disagg_transfer_bytes"]
        self.counters["transfer_bytes_cached"] += req.counters["disagg_transfer_bytes_cached"]
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
        self._ended.clear()
        self._abandoned.clear()
        return cancelled

    def stats(self) -> dict[str, float]:
        return dict(self.counters)
