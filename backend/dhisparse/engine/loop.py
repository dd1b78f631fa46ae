"""A background thread that owns an ``LLMEngine`` and serves concurrent callers (the Triton backend uses it).

Callers never touch the engine: ``submit`` validates synchronously and hands the request to the loop through an
inbox; updates come back on a per-request queue; ``cancel`` asks the loop to abort and free the request.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator

from dhisparse.engine.llm import LLM
from dhisparse.engine.request import RequestUpdate
from dhisparse.errors import InvalidRequestError
from dhisparse.sampling.params import SamplingParams

_END = object()


class RequestStream:
    """Iterator over one request's ``RequestUpdate``s; ends after the finishing update."""

    def __init__(self, request_id: str, loop: EngineLoop) -> None:
        self.request_id, self._loop = request_id, loop
        self._queue: queue.Queue = queue.Queue()

    def __iter__(self) -> Iterator[RequestUpdate]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self._loop.cancel(self.request_id)


class EngineLoop:
    def __init__(self, llm: LLM, idle_wait_s: float = 0.05) -> None:
        self.llm, self.engine = llm, llm.engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stats: dict[str, float] = self.engine.stats()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dhisparse-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
               ) -> RequestStream:
        """Validate and queue a request; raises ``InvalidRequestError`` on bad input (nothing is queued)."""
        if self._stop.is_set():
            raise InvalidRequestError("the engine loop is shut down")
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.validate(prompt, params)
        with self._lock:
            rid = request_id or f"loop-{next(self._ids)}"
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            stream = RequestStream(rid, self)
            self._streams[rid] = stream
        self._inbox.put(("add", rid, prompt, params))
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------------ loop thread
    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params = msg
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as exc:
                    self._close_stream(rid, exc)
            else:
                rid = msg[1]
                if self.engine.abort_request(rid):
                    self.engine.pop_finished(rid)
                    self._close_stream(rid, None, RequestUpdate(rid, [], True, "abort"))

    def _close_stream(self, rid: str, error: BaseException | None, update: RequestUpdate | None = None) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is None:
            return
        if update is not None:
            stream._queue.put(update)
        stream._queue.put(error if error is not None else _END)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.engine.poll_idle()
                with self._lock:
                    self._stats = self.engine.stats()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                updates = self.engine.step()
            except Exception as exc:
                self.error = exc
                for rid in list(self.engine.requests):
                    self.engine.abort_request(rid)
                    self.engine.requests.pop(rid, None)
                    self._close_stream(rid, RuntimeError(f"engine step failed: {exc!r}"))
                continue
            for update in updates:
                with self._lock:
                    stream = self._streams.get(update.request_id)
                if stream is not None:
                    stream._queue.put(update)
                if update.finished:
                    self.engine.requests.pop(update.request_id, None)
                    self._close_stream(update.request_id, None)
            with self._lock:
                self._stats = self.engine.stats()
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            self._close_stream(rid, None, RequestUpdate(rid, [], True, "abort"))
