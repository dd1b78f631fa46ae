"""Disaggregated mode of the planner: the decode GPU receives imported history; prefill runs on separate GPUs.

The co-located :class:`Simulator` serialises every prefill on the decode GPU (the engine step stalls while a
prompt is prefilled). Here, as in ``dhisparse.disagg``:

- prefill runs on a pool of ``prefill_gpus`` GPUs of the same kind, FIFO in arrival order (each request on the
  first free one, ``prefill_seconds`` of the model on that hardware);
- the prompt's history (KV rows of every layer + indexer keys) then crosses a link of ``link_bytes_per_s`` with
  ``link_latency_s`` per transfer;
- **TTFT = prefill queue + prefill + transfer**: the context phase streams the first token and the decode side
  needs the history before its first decode step;
- the request joins the decode engine's queue once its history has arrived; decode-side admission, reclaim and
  refill are the unchanged KV manager's (an admission that cannot be covered waits), and the decode GPU's clock
  only advances with decode steps.

Throughput is per decode GPU (the paper's unit); the prefill GPUs are reported, not counted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from dhisparse_planner.simulator import SimResult, Simulator
from dhisparse_planner.timing import prefill_seconds


@dataclass(frozen=True)
class DisaggregationSpec:
    """The prefill side and the link (defaults: 8 prefill GPUs, 400 Gb/s RDMA NIC = 50 GB/s, 20 µs)."""

    prefill_gpus: int = 8
    link_bytes_per_s: float = 50e9
    link_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        if self.prefill_gpus < 1:
            raise ValueError(f"prefill_gpus must be >= 1, got {self.prefill_gpus}")
        if self.link_bytes_per_s <= 0 or self.link_latency_s < 0:
            raise ValueError("link_bytes_per_s must be > 0 and link_latency_s >= 0")


class DisaggregatedSimulator(Simulator):
    """:class:`Simulator` with prefill on separate GPUs and history transfer (see the module docstring)."""

    def __init__(self, *args, disaggregation: DisaggregationSpec = DisaggregationSpec(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.disagg = disaggregation
        self._prefill_free = [0.0] * disaggregation.prefill_gpus  # heap of times each prefill GPU is free
        self._in_flight: list[tuple[float, int, object]] = []  # heap (history ready at decode GPU, order, request)

    def history_bytes(self, prompt_tokens: int) -> float:
        """Bytes the link carries for one prompt: KV rows of every layer + indexer keys."""
        return float(prompt_tokens * self.model.resident_bytes_per_token())

    def _new_request(self, arrival_s: float) -> None:
        super()._new_request(arrival_s)
        req = self.core.waiting.pop()  # not the decode engine's yet: it is being prefilled elsewhere
        tokens = req.prompt_tokens  # type: ignore[attr-defined]
        start = max(arrival_s, heapq.heappop(self._prefill_free))
        prefill_s = prefill_seconds(self.hw, self.model, tokens)
        heapq.heappush(self._prefill_free, start + prefill_s)
        transfer_s = self.disagg.link_latency_s + self.history_bytes(tokens) / self.disagg.link_bytes_per_s
        ready = start + prefill_s + transfer_s
        req.first_token_s = ready
        req.ttft_split = (start - arrival_s, prefill_s, transfer_s)  # type: ignore[attr-defined]
        heapq.heappush(self._in_flight, (ready, self.issued, req))

    def _issue(self) -> None:
        w = self.workload
        if w.concurrency == 0:
            while self.arrivals and self.arrivals[0] <= self.clock:
                self._new_request(self.arrivals.popleft())
        else:
            alive = len(self.core.waiting) + len(self.core.running) + len(self._in_flight)
            while alive < w.clients_at(self.clock) and self.issued < w.total_requests:
                self._new_request(self.times.arrival(self.clock))
                alive += 1
        while self._in_flight and self._in_flight[0][0] <= self.clock:
            self.core.waiting.append(heapq.heappop(self._in_flight)[2])

    def _next_event_s(self) -> float | None:
        events = [t for t in (super()._next_event_s(), self._in_flight[0][0] if self._in_flight else None)
                  if t is not None]
        return min(events) if events else None

    def _on_admit(self, req) -> None:
        req.admitted_s = self.clock  # no prefill on the decode GPU; the first token came from the context phase

    def run(self, max_sim_steps: int = 10_000_000) -> SimResult:
        result = super().run(max_sim_steps)
        done = [r for r in self.requests if getattr(r, "ttft_split", None) is not None]
        for i, name in enumerate(("mean_prefill_queue_s", "mean_prefill_s", "mean_transfer_s")):
            result.extra[name] = sum(r.ttft_split[i] for r in done) / len(done) if done else 0.0
        admitted = [r for r in done if r.admitted_s is not None and r.first_token_s is not None]
        # How long histories wait at the decode GPU for admission (the decode policy's share of the latency the
        # client sees before its second token; TTFT itself does not depend on the decode policy here).
        result.extra["mean_decode_admission_wait_s"] = (
            sum(r.admitted_s - r.first_token_s for r in admitted) / len(admitted) if admitted else 0.0)
        result.extra["prefill_gpus"] = float(self.disagg.prefill_gpus)
        return result
