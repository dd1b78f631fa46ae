"""Request times inside simulated steps: when a closed-loop client's next request arrives, when a co-located prefill
gives its first token, when a request really finishes (issue 28, point 6).

The scale model steps ``g`` real decode steps at once, and admits at step boundaries, so every request admitted in
one simulated step starts decoding in the same step and finishes in the same one. A real engine spreads them: with
``max_prefill_tokens_per_step`` it prefills a few prompts per real step, interleaved with decode steps, and each
request then decodes from its own first token on. Left at step granularity, a closed loop of identical requests
stays in lockstep: every wave arrives at once and queues behind all its prefills, which a real engine never sees
once its clients have spread. :class:`RealTime` keeps the simulation's decisions (admissions, the batch of every
step, the clock's total: GPU time) and times the requests as the real engine would:

- **Arrival**: a client's next request arrives when its previous one finished (its real finish, below), not at the
  step boundary the simulation next looks at.
- **First token** (co-located): prefills run through one *lane* in admission order. A request is ready at its
  arrival if it was admitted at the first boundary after it (a real engine admits it within a real step), else at
  the start of the step that admitted it (it waited for memory or a token budget); its prefill starts when it is
  ready and the lane is free and takes its prefill time plus the decode steps interleaved with it (its share of a
  real step's prefill budget, in real decode steps).
- **Finish**: requests admitted in one simulated step decode in lockstep in the simulation; really, each started at
  its own first token, so each finishes that much earlier than the last one admitted with it.

Every time comes from the clock and the run's own records, so re-timing (``retime.py``) recomputes them exactly.
"""

from __future__ import annotations

import heapq

from dhisparse_planner.core import SimRequest


class RealTime:
    """Arrivals, first tokens and finishes of one run's requests (module docstring). ``clients``: closed-loop
    clients present at the start (0: open loop or load steps, arrivals come from the workload)."""

    def __init__(self, clients: int) -> None:
        self.free = [0.0] * clients  # heap: when each client may send its next request
        self.lane_free_s = 0.0
        self.real_step_s = 0.0  # the last real decode step's duration
        self.step_start_s = 0.0
        self.admitted: list[SimRequest] = []  # admitted in the current simulated step

    def arrival(self, clock: float) -> float:
        """Arrival of a closed-loop client's next request issued at ``clock``: when that client became free."""
        return min(clock, heapq.heappop(self.free)) if self.free else clock

    def begin_step(self, clock: float) -> None:
        self.step_start_s = clock
        self.admitted = []

    def first_token(self, req: SimRequest, prefill_s: float, budget_share: float) -> float:
        """First-token time of ``req``'s co-located prefill of ``prefill_s`` seconds that uses ``budget_share`` of
        a real step's prefill budget."""
        ready = req.arrival_s if not req.waited else max(req.arrival_s, self.step_start_s)
        start = max(ready, self.lane_free_s)
        self.lane_free_s = start + prefill_s + budget_share * self.real_step_s
        self.admitted.append(req)
        return self.lane_free_s

    def end_admissions(self) -> None:
        """After a step's admissions: how much earlier each one really started decoding than the last of them."""
        last = max((r.first_token_s or 0.0 for r in self.admitted), default=0.0)
        for r in self.admitted:
            r.decode_lead_s = last - (r.first_token_s or last)  # type: ignore[attr-defined]
        self.admitted = []

    def decoded(self, step_s: float, real_steps: int) -> None:
        self.real_step_s = step_s / real_steps

    def finish(self, req: SimRequest, clock: float) -> float:
        """``req``'s real finish for a simulated finish at ``clock``; its client becomes free then."""
        lead = getattr(req, "decode_lead_s", 0.0)
        start = req.first_token_s if req.first_token_s is not None else clock
        done = max(start, clock - lead)
        heapq.heappush(self.free, done)
        return done
