"""A background thread that owns an ``LLMEngine`` and serves concurrent callers (the Triton backend uses it).

Callers never touch the engine: ``submit`` validates synchronously and hands the request to the loop through an
inbox; updates come back on a per-request queue; ``cancel`` asks the loop to abort and free the request.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from dhisparse.engine.llm import LLM
from dhisparse.engine.request import RequestUpdate
from dhisparse.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from dhisparse.sampling.params import SamplingParams


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Cancel:
    request_id: str
    reason: str


class RequestStream:
    """Iterator over one request's ``RequestUpdate``s; ends after the finishing update."""

    def __init__(self, request_id: str, loop: EngineLoop) -> None:
        self.request_id, self._loop = request_id, loop
        self._queue: queue.Queue[RequestUpdate | BaseException | None] = queue.Queue()  # None: the end

    def __iter__(self) -> Iterator[RequestUpdate]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self._loop.cancel(self.request_id)


class EngineLoop:
    """Runs ``llm``'s engine on a background thread.

    Guarantees: every stream ends (a finishing update, or an exception: :class:`RequestFailedError` when the
    engine work it was part of failed, :class:`EngineDeadError` when the engine stopped); ``close`` ends the
    streams still open, including requests still in the inbox; once the engine is dead or the loop closed
    (or its thread died), ``submit`` raises :class:`EngineDeadError` and ``alive`` is False.
    """

    def __init__(self, llm: LLM, idle_wait_s: float = 0.05) -> None:
        self.llm, self.engine = llm, llm.engine
        self._inbox: queue.Queue[_Add | _Cancel] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stats: dict[str, float] = self.engine.stats()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.error: BaseException | None = None  # why the loop stopped serving (None while it serves)
        self._thread = threading.Thread(target=self._run, name="dhisparse-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the loop accepts and runs requests (False once closed, dead, or its thread is gone)."""
        return self.error is None and not self._stop.is_set() and self._thread.is_alive()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine is stopped: {self.error}")
        if self._stop.is_set():
            raise EngineDeadError("the engine loop is shut down")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
               ) -> RequestStream:
        """Validate and queue a request; raises ``InvalidRequestError`` on bad input and ``EngineDeadError`` when
        the loop no longer runs (nothing is queued either way)."""
        self._check_alive()
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.validate(prompt, params)
        with self._lock:
            self._check_alive()  # under the lock: a close() racing with us either sees this stream or we raise
            rid = request_id or f"loop-{next(self._ids)}"
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            stream = RequestStream(rid, self)
            self._streams[rid] = stream
            self._inbox.put(_Add(rid, prompt, params))
        self._wake.set()
        return stream

    def cancel(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request wherever it is (queued, waiting for admission, running) and free all it holds. Its
        stream ends with a finishing update of ``reason``: ``"abort"`` (a cancelled request) or ``"stop"``
        (the caller matched a stop sequence: the request counts as finished, not aborted)."""
        self._inbox.put(_Cancel(request_id, reason))
        self._wake.set()

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._stats)
        out["engine_alive"] = float(self.alive)
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; every open stream ends (an ``abort`` update, or an error if it was still queued)."""
        with self._lock:
            self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        # The thread ends the streams itself on its way out; if it is stuck in a step, end them from here
        # without touching the (single-threaded) engine.
        self._end_all(EngineDeadError("the engine loop was shut down before the request finished"),
                      touch_engine=not self._thread.is_alive())
        self.llm.close()  # a multi-rank engine's processes stop with the loop that owns it

    # ------------------------------------------------------------------------------------ loop thread
    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _Add):
                try:
                    self.engine.add_request(msg.prompt, msg.params, msg.request_id)
                except Exception as exc:
                    self._close_stream(msg.request_id, exc)
            else:
                rid, reason = msg.request_id, msg.reason
                if self.engine.abort_request(rid, reason):
                    self.engine.pop_finished(rid)
                    self._close_stream(rid, None, RequestUpdate(rid, [], True, reason))

    def _close_stream(self, rid: str, error: BaseException | None, update: RequestUpdate | None = None) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is None:
            return
        if update is not None:
            stream._queue.put(update)
        stream._queue.put(error)  # None ends the stream

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            if update.finish_reason == "error":
                self.engine.requests.pop(update.request_id, None)
                error_type = EngineDeadError if self.engine.dead is not None else RequestFailedError
                self._close_stream(update.request_id, error_type(update.error or "the request failed"))
                continue
            with self._lock:
                stream = self._streams.get(update.request_id)
            if stream is not None:
                stream._queue.put(update)
            if update.finished:
                self.engine.requests.pop(update.request_id, None)
                self._close_stream(update.request_id, None)

    def _end_all(self, error: BaseException, touch_engine: bool = True, graceful: bool = True) -> None:
        """End every open stream. The engine's requests are aborted (freeing their memory) and, when the loop
        closes gracefully, end with an ``abort`` update; everything else (the inbox, a failed loop) gets
        ``error``."""
        for rid in list(self.engine.requests) if touch_engine else []:
            if self.engine.dead is None:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # ending the streams matters more than a clean free
                    pass
            self.engine.requests.pop(rid, None)
            if graceful:
                self._close_stream(rid, None, RequestUpdate(rid, [], True, "abort"))
            else:
                self._close_stream(rid, error)
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._close_stream(rid, error)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self.engine.poll_idle()
                    with self._lock:
                        self._stats = self.engine.stats()
                    if self.engine.dead is not None:  # a multi-rank engine notices a lost rank while idle
                        raise EngineDeadError(self.engine.dead)
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                with self._lock:
                    self._stats = self.engine.stats()
                if self.engine.dead is not None:
                    raise EngineDeadError(self.engine.dead)
        except BaseException as exc:  # the loop must never die silently
            self.error = exc
            with self._lock:
                self._stop.set()
                self._stats = {**self._stats, "engine_dead": 1.0}
            self._end_all(exc if isinstance(exc, EngineDeadError) else
                          EngineDeadError(f"the engine loop failed: {type(exc).__name__}: {exc}"), graceful=False)
            return
        if self.error is None:
            self._end_all(EngineDeadError("the engine loop was shut down before the request finished"))
