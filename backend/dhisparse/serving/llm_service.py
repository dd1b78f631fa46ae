"""What the `dhisparse` Triton model runs: the engine loop, one responder thread per request, one supervisor.

Request path: `model.py` parses the tensors (`parse_llm_request`) and calls `LLMService.start`, which
submits to the `EngineLoop` (invalid requests raise before anything is queued) and starts a responder
thread. The responder iterates the request's update stream and sends Triton responses: one per update
when streaming (the last carries the COMPLETE_FINAL flag), a single one otherwise. Multi-token stop
sequences are matched here and end the request early (the engine request is cancelled).

The supervisor thread wakes every `interval_s` to (1) poll each open request's `is_cancelled()` (a
client that cancels or disconnects) and cancel it in the loop, which frees all its KV memory, and
(2) copy `EngineLoop.stats()` into the custom metrics, (3) notice an engine that stopped after a fault it could
not recover from (its clients already have their errors) and call `on_engine_dead` once: the Triton model then
unloads itself so that its readiness turns false, (4) poll the drain signal (`DrainWatch`): once the server
is shutting down new requests are refused, and open ones still running after the grace are stopped and answered
with a `ShuttingDownError`. All touch Triton from this one thread only.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from dhisparse.engine.loop import EngineLoop
from dhisparse.errors import InvalidRequestError
from dhisparse.serving.drain import DrainWatch
from dhisparse.serving.engine_metrics import EngineMetrics
from dhisparse.serving.llm_outputs import ResponseBuilder
from dhisparse.serving.llm_request import LLMRequest
from dhisparse.serving.response_group import ResponseGroup
from dhisparse.serving.stop_sequences import StopSequenceMatcher
from dhisparse.serving.tokenization import TokenBytes
from dhisparse.serving.triton_tensors import STUB_LOCK, send


class LLMService:
    """Serve `LLMRequest`s from a running `EngineLoop` to Triton response senders.

    Args:
        pb: the `triton_python_backend_utils` module.
        loop: the engine loop (owned: `close` closes it).
        metrics: where to publish statistics, or None.
        interval_s: supervisor period (cancellation latency and metrics freshness), seconds.
        on_engine_dead: called once (from the supervisor) when the engine stopped after a fault.
        token_bytes: the engine tokenizer's per-token bytes, for `stream_whole_characters` (None: such requests
            are refused).
    """

    def __init__(self, pb: Any, loop: EngineLoop, metrics: EngineMetrics | None, interval_s: float = 0.25,
                 on_engine_dead: Callable[[str], None] | None = None, drain: DrainWatch | None = None,
                 token_bytes: TokenBytes | None = None) -> None:
        self._pb = pb
        self._drain = drain
        self._stopped_for_shutdown: set[str] = set()  # requests ended by the drain: answered with its error
        self._token_bytes = token_bytes  # the engine's tokenizer, for stream_whole_characters (None: refused)
        self._on_engine_dead = on_engine_dead
        self._dead_reported = False
        self.loop = loop
        self._metrics = metrics
        self._interval_s = interval_s
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._active: dict[str, Any] = {}  # request id -> response sender, until its final response is sent
        # Held while sending a final response and while polling is_cancelled(): tritonserver 2.51 segfaults
        # when is_cancelled() runs on a sender whose final response has gone (its factory is freed).
        self._final_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._by_client_id: dict[str, list[str]] = {}  # Triton request id given by the caller -> engine ids
        self._cancelled_total = 0
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="dhisparse-supervisor", daemon=True)
        self._supervisor.start()

    # ------------------------------------------------------------------------------------------ requests
    def start(self, request: LLMRequest, sender: Any, client_id: str = "", sequence_index: int = 0) -> str:
        """Submit `request` (sequence `sequence_index` of it) and stream its responses to `sender`; returns the
        engine request id.

        `client_id` (the Triton request id, may be empty) lets a later control request `cancel_client`
        it. Raises InvalidRequestError (nothing queued, nothing sent) when the engine refuses the request, and
        ShuttingDownError once the server drains.
        """
        if self._drain is not None:
            self._drain.refuse_new_requests()
        request_id = f"triton-{next(self._ids)}"
        stream = self.loop.submit(request.prompt_token_ids, request.params.for_sequence(sequence_index), request_id)
        with self._lock:
            self._active[request_id] = sender
            if client_id:
                self._by_client_id.setdefault(client_id, []).append(request_id)
        threading.Thread(
            target=self._respond, args=(request_id, request, stream, sender, sequence_index),
            name=f"respond-{request_id}", daemon=True,
        ).start()
        return request_id

    def start_all(self, requests: list[LLMRequest], sender: Any, client_id: str = "") -> list[str]:
        """Serve every sequence of every prompt of one Triton request (`num_return_sequences` each) through one
        sender; its last response carries the final flag (see `ResponseGroup`). Every request is validated
        first: InvalidRequestError means nothing was started."""
        if self._drain is not None:
            self._drain.refuse_new_requests()
        for request in requests:
            if request.whole_characters and request.streaming and self._token_bytes is None:
                raise InvalidRequestError("stream_whole_characters needs the engine's tokenizer (tokenizer.json)")
            for index in range(request.num_return_sequences):
                self.loop.engine.validate(request.prompt_token_ids, request.params.for_sequence(index))
        jobs = [(r, i) for r in requests for i in range(r.num_return_sequences)]
        if len(jobs) == 1:
            return [self.start(requests[0], sender, client_id)]
        started: list[str] = []
        group = ResponseGroup(sender, len(jobs), self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                              lambda r: bool(r.has_error()), lambda: [self.loop.cancel(i) for i in started])
        for request, index in jobs:
            started.append(self.start(request, group.member(), client_id, index))
        return started

    def _send(self, sender: Any, arrays_or_error: dict | BaseException | Any | None, final: bool) -> None:
        """Send output arrays, an error (exception or `pb.TritonError`), or nothing (flags only)."""
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if final:
            with STUB_LOCK, self._final_lock:  # lock order: STUB_LOCK, then _final_lock (as the supervisor)
                with self._lock:
                    for request_id in [r for r, s in self._active.items() if s is sender]:
                        del self._active[request_id]
                self._send_now(sender, arrays_or_error, flags)
        else:
            self._send_now(sender, arrays_or_error, flags)

    def _send_now(self, sender: Any, arrays_or_error: dict | BaseException | Any | None, flags: int) -> None:
        send(self._pb, sender, arrays_or_error, flags)

    def _respond(self, request_id: str, request: LLMRequest, stream: Iterable, sender: Any,
                 sequence_index: int = 0) -> None:
        matcher = StopSequenceMatcher(request.stop_sequences, request.params.min_tokens)
        whole = self._token_bytes.whole_character_prefix if self._token_bytes is not None else None
        builder = ResponseBuilder(request, sequence_index, self.loop.engine.cfg.page_rows, whole)
        done = False  # the client has its final response (or is gone)
        sent_any = False  # a streamed response went out already
        try:
            for update in stream:
                if done:
                    continue  # drain what the loop still sends after an early stop
                with STUB_LOCK:  # numpy and Triton objects are built and sent by one thread at a time
                    done, sent_any = self._on_update(request_id, request, update, matcher, builder, sender, sent_any)
            if not done:  # the stream ended without a finishing update (loop shut down)
                error = self._cancelled_error() if self._was_cancelled(request_id) else RuntimeError(
                    "the engine loop stopped before the request finished")
                self._send_error(sender, error, sent_any)
        except Exception as error:
            if not done:
                failure = RuntimeError(f"request failed: {error}")
                self._send_error(sender, failure, sent_any)
        finally:
            with self._lock:
                self._active.pop(request_id, None)
                self._cancelled.discard(request_id)
                self._stopped_for_shutdown.discard(request_id)
                for client_id in [c for c, ids in self._by_client_id.items() if request_id in ids]:
                    self._by_client_id[client_id].remove(request_id)
                    if not self._by_client_id[client_id]:
                        del self._by_client_id[client_id]

    def _on_update(self, request_id: str, request: LLMRequest, update: Any, matcher: StopSequenceMatcher,
                   builder: ResponseBuilder, sender: Any, sent_any: bool) -> tuple[bool, bool]:
        """Handle one engine update of a request; returns ``(done, sent_any)``: whether the client has its final
        response now, and whether a streamed response went out already."""
        tokens = list(update.new_token_ids)
        finished = update.finished
        keep = matcher.feed(tokens)
        if keep is not None:
            finished = True
            if not update.finished:
                self.loop.cancel(request_id, reason="stop")  # finished by a stop sequence
        if self._was_cancelled(request_id):
            if request_id in self._stopped_for_shutdown:  # the server drains: the client learns why
                self._send_error(sender, self._drain.stopped() if self._drain else RuntimeError("stopped"), sent_any)
            else:
                # Flags only: an error-carrying final response sent from this thread after earlier
                # streamed ones never reaches a BLS caller on Triton 2.51 (its stream stalls).
                self._send(sender, None, final=True)
            return True, sent_any
        builder.add(update, keep)
        released = builder.release(final=finished) if request.streaming else 0
        if request.streaming and (released or finished):
            self._send(sender, builder.chunk() if released else None, final=finished)
            return finished, True
        if finished:
            self._send(sender, builder.whole(), final=True)
            return True, sent_any
        return False, sent_any

    def _send_error(self, sender: Any, error: BaseException | Any, sent_any: bool) -> None:
        """The final error of a request. After streamed responses, an error-carrying *final* response never
        reaches a BLS caller on Triton 2.51 (its stream stalls): then the error goes first, a flags-only final
        after it."""
        if sent_any:
            self._send(sender, error, final=False)
            self._send(sender, None, final=True)
        else:
            self._send(sender, error, final=True)

    def cancel_client(self, client_id: str) -> bool:
        """Cancel the open request started with `client_id`; False when there is none."""
        with self._lock:
            request_ids = [r for r in self._by_client_id.get(client_id, []) if r not in self._cancelled]
            self._cancelled.update(request_ids)
            self._cancelled_total += len(request_ids)
        for request_id in request_ids:
            self.loop.cancel(request_id)
        return bool(request_ids)

    def _was_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def _cancelled_error(self) -> Any:
        return self._pb.TritonError("request cancelled by the client", self._pb.TritonError.CANCELLED)

    # ---------------------------------------------------------------------------------------- supervisor
    def _supervise(self) -> None:
        while not self._stop.wait(self._interval_s):
            with STUB_LOCK, self._final_lock:  # no final response can be sent while we poll
                with self._lock:
                    open_requests = [(rid, s) for rid, s in self._active.items() if rid not in self._cancelled]
                newly_cancelled = [rid for rid, sender in open_requests if sender.is_cancelled()]
            for request_id in newly_cancelled:
                with self._lock:
                    self._cancelled.add(request_id)
                    self._cancelled_total += 1
                self.loop.cancel(request_id)
            self._drain_expired()
            if self._metrics is not None:
                stats = self.stats()
                with STUB_LOCK:
                    self._metrics.update(stats)
            if not self.loop.alive and not self._dead_reported and not self._stop.is_set():
                self._dead_reported = True  # every open stream has its error already (EngineLoop guarantees it)
                if self._on_engine_dead is not None:
                    self._on_engine_dead(str(self.loop.error or "the engine loop stopped"))

    def _drain_expired(self) -> None:
        """Once the shutdown grace is over, stop every open request; its responder answers with the drain's error."""
        if self._drain is None:
            return
        self._drain.poll()
        if not self._drain.expired:
            return
        with self._lock:
            ending = [rid for rid in self._active if rid not in self._cancelled]
            self._cancelled.update(ending)
            self._stopped_for_shutdown.update(ending)
        for request_id in ending:
            self.loop.cancel(request_id)

    def stats(self) -> dict[str, float]:
        """Engine statistics plus the serving layer's own counters."""
        with self._lock:
            serving = {"serving_active_requests": float(len(self._active)),
                       "serving_cancelled_requests": float(self._cancelled_total)}
        return {**self.loop.stats(), **serving}

    def close(self) -> None:
        """Stop the supervisor and the engine loop (open requests are aborted)."""
        self._stop.set()
        self._supervisor.join(timeout=5.0)
        self.loop.close()
