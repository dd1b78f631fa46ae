"""What the Triton `generation` model runs: a :class:`DecodeEngine` on its own thread, one responder per request.

`model.py` parses the tensors (`parse_llm_request` + `context_phase_params`) and calls `GenerationService.start`.
The engine thread is the only one that touches the engine and the custom metrics (Triton 2.51 crashed when
metrics were updated from several threads); responders turn each request's updates into Triton responses (one
per update when streaming, one at the end otherwise; the first token, which the context phase produced, is
part of the first update). A transfer that failed ends the request with an error response naming the cause.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

from dhisparse.disagg.decode import DecodeEngine
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.serving.engine_metrics import EngineMetrics
from dhisparse.serving.llm_request import LLMRequest, output_arrays
from dhisparse.serving.stop_sequences import StopSequenceMatcher
from dhisparse.serving.triton_tensors import error_response, response

_END = object()


class GenerationService:
    """Serve imported requests from a :class:`DecodeEngine` (see the module docstring)."""

    def __init__(self, pb: Any, engine: DecodeEngine, metrics: EngineMetrics | None, interval_s: float = 0.25,
                 idle_wait_s: float = 0.01) -> None:
        self._pb, self.engine, self._metrics = pb, engine, metrics
        self._interval_s, self._idle_wait_s = interval_s, idle_wait_s
        self._ids = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dhisparse-generation", daemon=True)
        self._thread.start()

    def start(self, request: LLMRequest, context: ContextPhaseParams, sender: Any) -> str:
        """Validate and queue `request`; raises InvalidRequestError (nothing queued) when the engine refuses it."""
        prompt = request.prompt_token_ids
        self.engine.validate(prompt, request.params)
        request_id = f"gen-{next(self._ids)}"
        updates: queue.Queue = queue.Queue()
        with self._lock:
            self._queues[request_id] = updates
        self._inbox.put(("add", request_id, prompt, request.params, context))
        self._wake.set()
        threading.Thread(target=self._respond, args=(request_id, request, updates, sender),
                         name=f"respond-{request_id}", daemon=True).start()
        return request_id

    # ------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        last_metrics = 0.0
        while not self._stop.is_set():
            while True:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if message[0] == "cancel":  # a stop sequence ended the request early
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
                        error = self.engine.errors.pop(update.request_id, None)
                        self._deliver(update.request_id, RuntimeError(error) if error else _END)
                        self.engine.requests.pop(update.request_id, None)
            else:
                self.engine.poll_idle()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
            now = time.monotonic()
            if now - last_metrics >= self._interval_s:
                last_metrics = now
                stats = self.engine.stats()
                with self._lock:
                    self._stats = stats
                if self._metrics is not None:
                    self._metrics.update(stats)

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            updates = self._queues.get(request_id)
            if item is _END or isinstance(item, BaseException):
                self._queues.pop(request_id, None)
        if updates is not None:
            updates.put(item)

    # ---------------------------------------------------------------------------------------- responders
    def _respond(self, request_id: str, request: LLMRequest, updates: queue.Queue, sender: Any) -> None:
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        matcher = StopSequenceMatcher(request.stop_sequences)
        collected: list[int] = []
        while True:
            item = updates.get()
            if item is _END:
                if not request.streaming:
                    sender.send(response(self._pb, output_arrays(collected)), flags=final)
                return
            if isinstance(item, BaseException):
                sender.send(error_response(self._pb, RuntimeError(f"request failed: {item}")), flags=final)
                return
            if item.finished and item.finish_reason == "error":
                continue  # the error follows
            tokens, finished = list(item.new_token_ids), item.finished
            keep = matcher.feed(tokens)
            if keep is not None:  # a multi-token stop sequence ended here: stop the engine request too
                tokens, finished = tokens[:keep], True
                if not item.finished:
                    self._inbox.put(("cancel", request_id))
                    self._wake.set()
            collected.extend(tokens)
            if finished:
                if request.streaming:
                    if tokens:
                        sender.send(response(self._pb, output_arrays(tokens)), flags=final)
                    else:
                        sender.send(flags=final)
                else:
                    sender.send(response(self._pb, output_arrays(collected)), flags=final)
                return
            if request.streaming and tokens:
                sender.send(response(self._pb, output_arrays(tokens)))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10.0)
        self.engine.importer.close()
