"""What the Triton `context` model runs: a :class:`PrefillService` behind a lock, and a thread that releases regions.

`execute` prefills each request (``request_type`` = ``context_only``) and answers ``output_ids`` (the first token),
``sequence_length`` and ``context_phase_params`` (UINT8 ``[1, N]``, :class:`ContextPhaseParams`). The release
thread polls the NIXL exporter, which frees a region when the generation side's READ notification arrives (or its
hold deadline passes); both touch the exporter under one lock. A control request carrying ``cancel_request_id``
(the Triton request id of an earlier context request, sent by the orchestrator when its client cancelled during
the context phase) frees that request's region at once (:meth:`ContextService.cancel`). The release thread is
also the only one that updates the model's custom metrics (the exporter's ``regions_*`` / ``bytes_*`` counts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from dhisparse.disagg.prefill import PrefillService
from dhisparse.errors import InvalidRequestError
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.llm_request import parse_llm_request

CONTEXT_ONLY = "context_only"
GENERATION_ONLY = "generation_only"


def request_type(inputs: Mapping[str, np.ndarray], default: str) -> str:
    """The ``request_type`` input as text (tensorrtllm_backend: ``context_only`` / ``generation_only``)."""
    if "request_type" not in inputs:
        return default
    value = np.asarray(inputs["request_type"]).reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


class ContextService:
    """Serialises prefills and region releases over one :class:`PrefillService`."""

    def __init__(self, service: PrefillService, poll_interval_s: float = 0.002, metrics: Any = None,
                 metrics_interval_s: float = 0.25, key: bytes = b"", limits: RequestLimits | None = None) -> None:
        if len(key) < 16:
            raise ValueError("ContextService needs the deployment's internal key: it signs every context_phase_params")
        self.service, self._key, self._limits = service, key, limits or RequestLimits()
        self._metrics, self._metrics_interval_s = metrics, metrics_interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval_s = poll_interval_s
        self._thread = threading.Thread(target=self._release_loop, name="dhisparse-context-release", daemon=True)
        self._thread.start()

    def run(self, inputs: Mapping[str, np.ndarray], request_id: str) -> dict[str, np.ndarray]:
        """Output arrays for one ``context_only`` request; raises InvalidRequestError on bad input."""
        arrival = time.perf_counter()
        kind = request_type(inputs, CONTEXT_ONLY)
        if kind != CONTEXT_ONLY:
            raise InvalidRequestError(f"request_type must be {CONTEXT_ONLY!r} for the context model, got {kind!r}")
        request = parse_llm_request(inputs, self._limits)
        with self._lock:
            params = self.service.run(request.prompt_token_ids, request.params, request_id, arrival=arrival)
        return {
            "output_ids": np.asarray([[[params.first_token]]], dtype=np.int32),
            "sequence_length": np.asarray([[1]], dtype=np.int32),
            "context_phase_params": params.to_numpy(self._key),
        }

    def cancel(self, request_id: str) -> int:
        """Free at once the region of the context request ``request_id`` (its client cancelled before the
        generation phase pulled it); returns how many regions were freed (0: already read, released or unknown)."""
        with self._lock:
            return len(self.service.exporter.cancel(request_id))

    @staticmethod
    def cancel_answer(freed: int) -> dict[str, np.ndarray]:
        """The answer to a ``cancel_request_id`` control request: no token, ``sequence_length`` = regions freed."""
        return {"output_ids": np.zeros((1, 1, 0), dtype=np.int32),
                "sequence_length": np.asarray([[freed]], dtype=np.int32),
                "context_phase_params": np.zeros((1, 0), dtype=np.uint8)}

    def _release_loop(self) -> None:
        last_metrics = 0.0
        while not self._stop.wait(self._interval_s):
            with self._lock:
                self.service.poll()
            now = time.monotonic()
            if self._metrics is not None and now - last_metrics >= self._metrics_interval_s:
                last_metrics = now
                with self._lock:
                    stats = self.service.exporter.stats()
                self._metrics.update(stats)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return self.service.stats()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        with self._lock:
            self.service.close()
