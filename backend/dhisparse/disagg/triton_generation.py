"""What the Triton `generation` model runs: a :class:`DecodeEngine` on its own thread, one responder per request.

`model.py` parses the tensors (`parse_llm_request` + `context_phase_params`) and calls `GenerationService.start`.
The engine thread is the only one that touches the engine and the custom metrics (Triton 2.51 crashed when
metrics were updated from several threads); responders turn each request's updates into Triton responses (one
per update when streaming, one at the end otherwise; the first token, which the context phase produced, is
part of the first update). A transfer that failed ends the request with an error response naming the cause.

Cancellation: every ``interval_s`` the engine thread polls each open request's ``is_cancelled()`` (a client that
cancelled or disconnected) and aborts it in the engine, which frees its KV memory (and, for a request still waiting
for admission, tells the prefill side to release its region); a control request with ``cancel_request_id`` (sent by
`disaggregated_serving_bls` when its own client cancels) does the same. ``is_cancelled()`` and final responses are
serialised by one lock: tritonserver 2.51 crashes when ``is_cancelled()`` runs on a sender whose final response
has gone.

Faults: a request that a failed engine step ended gets an error response naming the fault. An engine that could
not restore its invariants after a fault (``engine.dead``), or whose step raised, is *dead*: every open request
gets an error, new requests are refused with it, and ``on_engine_dead`` is called once (the Triton model then
unloads itself, like the co-located `dhisparse` model, so its readiness turns false and ``dhisparse-serve``
stops the server and exits with code 3).

Trust: ``start`` checks the params against this engine and the request (``trust.check_context``) and refuses a
context phase imported before (``trust.ImportLedger``) before anything is queued. Shutdown: with a ``DrainWatch``,
new requests are refused once the server drains and the open ones still running after the grace get its error.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dhisparse.disagg.decode import DecodeEngine
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.disagg.ranks import ParallelDecodeEngine
from dhisparse.disagg.trust import ImportLedger, check_context
from dhisparse.errors import EngineDeadError
from dhisparse.serving.drain import DrainWatch
from dhisparse.serving.engine_metrics import EngineMetrics
from dhisparse.serving.llm_request import LLMRequest, output_arrays
from dhisparse.serving.stop_sequences import StopSequenceMatcher
from dhisparse.serving.triton_tensors import response, send

_END = object()
_CANCELLED = object()


class GenerationService:
    """Serve imported requests from a :class:`DecodeEngine` (see the module docstring)."""

    def __init__(self, pb: Any, engine: DecodeEngine | ParallelDecodeEngine, metrics: EngineMetrics | None,
                 interval_s: float = 0.25, idle_wait_s: float = 0.01,
                 on_engine_dead: Callable[[str], None] | None = None, drain: DrainWatch | None = None) -> None:
        self._pb, self.engine, self._metrics = pb, engine, metrics
        self._drain, self._ledger = drain, ImportLedger()
        self._on_engine_dead = on_engine_dead
        self.dead: str | None = None  # why the engine stopped (None: serving)
        self._interval_s, self._idle_wait_s = interval_s, idle_wait_s
        self._ids = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._open: dict[str, Any] = {}  # request id -> sender, until its final response is sent
        self._by_client: dict[str, str] = {}  # Triton request id of the caller -> request id
        self._final_lock = threading.Lock()
        self._cancelled_total = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dhisparse-generation", daemon=True)
        self._thread.start()

    def start(self, request: LLMRequest, context: ContextPhaseParams, sender: Any, client_id: str = "") -> str:
        """Validate and queue `request`; raises InvalidRequestError (nothing queued) when the engine refuses it."""
        prompt = request.prompt_token_ids
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self._drain is not None:
            self._drain.refuse_new_requests()
        self.engine.validate(prompt, request.params)
        check_context(context, self.engine.layout_template, prompt)  # the params fit this engine and this request
        self._ledger.take(context)  # and were not imported before
        request_id = f"gen-{next(self._ids)}"
        updates: queue.Queue = queue.Queue()
        with self._lock:
            self._queues[request_id] = updates
            self._open[request_id] = sender
            if client_id:
                self._by_client[client_id] = request_id
        self._inbox.put(("add", request_id, prompt, request.params, context))
        self._wake.set()
        threading.Thread(target=self._respond, args=(request_id, request, updates, sender),
                         name=f"respond-{request_id}", daemon=True).start()
        return request_id

    # ------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        last_metrics = 0.0
        while not self._stop.is_set():
            try:
                last_metrics = self._turn(last_metrics)
            except Exception as error:  # the engine thread must never die silently
                self._die(f"{type(error).__name__}: {error}")
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()

    def _die(self, reason: str) -> None:
        """The engine cannot go on: end every open request with an error and report once."""
        if self.dead is None:
            self.dead = reason if reason.startswith("the engine stopped") else f"the engine stopped: {reason}"
            if self._on_engine_dead is not None:
                self._on_engine_dead(self.dead)
        with self._lock:
            open_requests = list(self._queues)
        for request_id in open_requests:
            self._deliver(request_id, EngineDeadError(self.dead))

    def _turn(self, last_metrics: float) -> float:
        """One pass of the engine thread: take new work, one engine step (or an idle poll), metrics."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if message[0] == "abort":  # cancelled, or a stop sequence ended the request early
                if self.engine.abort_request(message[1]):
                    self.engine.requests.pop(message[1], None)
                self._deliver(message[1], _END)
                continue
            _, request_id, prompt, params, context = message
            try:
                self.engine.add_imported_request(prompt, params, context, request_id)
            except Exception as error:
                self._deliver(request_id, error)
        if self.engine.has_unfinished():
            for update in self.engine.step():
                self._deliver(update.request_id, update)
                if update.finished:
                    error = self.engine.errors.pop(update.request_id, None) or update.error
                    self._deliver(update.request_id, RuntimeError(error) if error else _END)
                    self.engine.requests.pop(update.request_id, None)
        else:
            self.engine.poll_idle()
            self._wake.wait(self._idle_wait_s)
            self._wake.clear()
        now = time.monotonic()
        if now - last_metrics >= self._interval_s:
            last_metrics = now
            self._poll_cancelled()
            self._drain_expired()
            stats = self.engine.stats()
            with self._lock:
                self._stats = stats
            if self._metrics is not None:
                self._metrics.update(self.stats())
        if self.engine.dead is not None:
            self._die(self.engine.dead)
        return last_metrics

    def _poll_cancelled(self) -> None:
        with self._final_lock:  # no final response is sent while is_cancelled() runs
            with self._lock:
                open_requests = list(self._open.items())
            cancelled = [rid for rid, sender in open_requests if sender.is_cancelled()]
        for request_id in cancelled:
            self._cancel(request_id)

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            if self._open.pop(request_id, None) is None:
                return
            self._cancelled_total += 1
            updates = self._queues.pop(request_id, None)
        if updates is not None:
            updates.put(_CANCELLED)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def _drain_expired(self) -> None:
        """Once the shutdown grace is over, end every open request with the drain's error (and abort it)."""
        if self._drain is None:
            return
        self._drain.poll()
        if not self._drain.expired:
            return
        with self._lock:
            ending = list(self._open)
        for request_id in ending:
            self._deliver(request_id, self._drain.stopped())
            self._inbox.put(("abort", request_id))

    def cancel_client(self, client_id: str) -> bool:
        """Cancel the open request started with Triton request id ``client_id``; False when there is none."""
        with self._lock:
            request_id = self._by_client.pop(client_id, None)
        if request_id is None:
            return False
        self._cancel(request_id)
        return True

    def _final(self, request_id: str, sender: Any, arrays: dict | BaseException | None) -> None:
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with self._final_lock:
            with self._lock:
                self._open.pop(request_id, None)
                for client in [c for c, r in self._by_client.items() if r == request_id]:
                    del self._by_client[client]
            send(self._pb, sender, arrays, flags)

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            updates = self._queues.get(request_id)
            if item is _END or isinstance(item, BaseException):
                self._queues.pop(request_id, None)
        if updates is not None:
            updates.put(item)

    # ---------------------------------------------------------------------------------------- responders
    def _respond(self, request_id: str, request: LLMRequest, updates: queue.Queue, sender: Any) -> None:
        matcher = StopSequenceMatcher(request.stop_sequences)
        collected: list[int] = []
        while True:
            item = updates.get()
            if item is _CANCELLED:
                # Flags only: an error-carrying final response after streamed ones stalls a BLS caller (2.51).
                self._final(request_id, sender, None if request.streaming else RuntimeError("request cancelled"))
                return
            if item is _END:
                self._final(request_id, sender, None if request.streaming else output_arrays(collected))
                return
            if isinstance(item, BaseException):
                self._final(request_id, sender, RuntimeError(f"request failed: {item}"))
                return
            if item.finished and item.finish_reason == "error":
                continue  # the error follows
            tokens, finished = list(item.new_token_ids), item.finished
            keep = matcher.feed(tokens)
            if keep is not None:  # a multi-token stop sequence ended here: stop the engine request too
                tokens, finished = tokens[:keep], True
                if not item.finished:
                    self._inbox.put(("abort", request_id))
                    self._wake.set()
            collected.extend(tokens)
            if finished:
                if request.streaming:
                    self._final(request_id, sender, output_arrays(tokens) if tokens else None)
                else:
                    self._final(request_id, sender, output_arrays(collected))
                return
            if request.streaming and tokens:
                with self._lock:
                    still_open = request_id in self._open
                if still_open:
                    sender.send(response(self._pb, output_arrays(tokens)))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, "serving_active_requests": float(len(self._open)),
                    "serving_cancelled_requests": float(self._cancelled_total)}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10.0)
        self.engine.close()
