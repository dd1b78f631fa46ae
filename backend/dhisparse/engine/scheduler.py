"""The scheduler: who runs this step (apart from how it runs, ``engine/executor.py``).

It owns the waiting queue and the running batch and decides, each step:

- **admission order**: arrival order (FIFO); the head of the queue is offered to the KV store (``try_admit``) and a
  request the store refuses stays at the head (never dropped, never overtaken: the next admission waits for it);
- **batch composition**: at most ``max_batch_size`` requests hold a batch slot, counting those whose prompt is
  still arriving (disaggregated decode);
- **chunked-prefill budget**: after the first admission of a step, admissions stop once the step's prompt tokens
  would pass ``max_prefill_tokens_per_step`` (decode is not starved by a burst of long prompts);
- **DSpark's load-aware verification**: the confidence a draft prefix needs before it is verified rises from
  ``dspark_min_confidence`` to ``dspark_busy_confidence`` when the batch holds ``dspark_busy_batch`` requests or more.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass

from dhisparse.engine.request import Request, Status
from dhisparse.kv.store import KVStore


@dataclass(frozen=True)
class Admission:
    """One outcome of :meth:`Scheduler.admit`: the request was admitted (``error`` None) or its admission raised."""

    request: Request
    error: Exception | None = None


class Scheduler:
    """Waiting queue, running batch and the per-step decisions listed in the module docstring."""

    def __init__(self, kv: KVStore, *, max_batch_size: int, max_prefill_tokens_per_step: int,
                 dspark_min_confidence: float = 0.0, dspark_busy_confidence: float = 0.0,
                 dspark_busy_batch: int = 0) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self.dspark_min_confidence = dspark_min_confidence
        self.dspark_busy_confidence = dspark_busy_confidence
        self.dspark_busy_batch = dspark_busy_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.arriving: dict[str, Request] = {}  # admitted, prompt still arriving (holds a batch slot)
        self.admissions_waited = 0  # requests that waited at least once for admission

    # ---------------------------------------------------------------------------------------------- queue
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.arriving)

    def admit(self) -> Iterator[Admission]:
        """Offer waiting requests to the KV store in arrival order while the batch has room and the step's prefill
        budget allows; yield each admitted request (its caller prefills it, or starts its transfer, before the next
        offer, so the next decision sees the memory the previous one took). An exception from ``try_admit`` is
        yielded with its request (which stays queued; the caller ends it)."""
        prefilled = 0
        while self.waiting and len(self.running) + len(self.arriving) < self.max_batch_size:
            req = self.waiting[0]
            if prefilled and prefilled + req.prompt_len > self.max_prefill_tokens_per_step:
                return
            try:
                admitted = self.kv.try_admit(req.request_id, req.prompt_len, req.params.max_tokens)
            except Exception as exc:
                yield Admission(req, exc)
                if self.waiting and self.waiting[0] is req:  # the caller did not end it: do not retry it now
                    return
                continue
            if not admitted:
                if not req.counters.get("waited"):
                    req.counters["waited"] = 1.0
                    self.admissions_waited += 1
                return
            self.waiting.popleft()
            req.kv_admitted = True
            req.admitted_time = time.perf_counter()
            prefilled += req.prompt_len
            yield Admission(req)

    def start_running(self, req: Request) -> None:
        """An admitted request joins the decode batch (its prompt is imported)."""
        self.arriving.pop(req.request_id, None)
        req.status = Status.RUNNING
        self.running.append(req)

    def remove(self, req: Request) -> None:
        """Take a finishing request out of the queue or the batch (its KV is released by the caller)."""
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.arriving.pop(req.request_id, None)

    def clear(self) -> list[Request]:
        """Empty the queue and the batch (the engine stopped); returns every request that was in them."""
        every = [*self.waiting, *self.arriving.values(), *self.running]
        self.waiting.clear()
        self.arriving.clear()
        self.running.clear()
        return every

    # --------------------------------------------------------------------------------------------- batch
    def decode_batch(self) -> list[Request]:
        """The requests the step decodes: every running request, in admission order."""
        return list(self.running)

    def verification_threshold(self, batch_size: int) -> float:
        """The confidence a DSpark draft prefix needs to be verified at this batch size (load-aware shortening)."""
        busy = batch_size >= self.dspark_busy_batch
        return max(self.dspark_min_confidence, self.dspark_busy_confidence if busy else 0.0)
