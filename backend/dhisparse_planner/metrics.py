"""What a run reports: whole-run metrics and the closed loop's steady state (issue 28, point 6).

A closed-loop run with several requests per client (waves) starts with every client's first request at once and
ends draining the last ones. Its *steady state* is the window from the first completion (from then on every
finished request is replaced by its client's next one) to the last request's issue (from then on the load only
drains): ``steady_output_tok_per_s`` counts the real output tokens produced inside that window over its length, and
``steady_mean_ttft_s`` / ``steady_mean_tpot_s`` average the requests issued inside it. TTFT is from the request's
issue to its first token: the wait for admission (memory, host store, a baseline's token budget), the prefill queue
and the prefill itself. With one request per client there is no such window and the steady metrics equal the
whole-run ones.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dhisparse_planner.core import SimRequest
    from dhisparse_planner.simulator import SimResult


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _latencies(requests: list[SimRequest]) -> tuple[list[float], list[float]]:
    """TTFT and TPOT (s) of the finished requests among ``requests``."""
    ttft, tpot = [], []
    for r in requests:
        if r.finish_s is None or r.first_token_s is None:
            continue
        ttft.append(r.first_token_s - r.arrival_s)
        real = r.extra_real_tokens  # type: ignore[attr-defined]
        if real > 1:
            tpot.append((r.finish_s - r.first_token_s) / (real - 1))
    return ttft, tpot


MIN_STEADY_STEPS = 4  # simulated steps a steady window must span (shorter: the run has no steady state)
MIN_STEADY_SHARE = 0.1  # ... and this share of the run


def steady_window(result: SimResult) -> tuple[float, float] | None:
    """``(first completion, last issue)`` (s), or None when the run has no steady state (one wave, or a window
    shorter than :data:`MIN_STEADY_STEPS` steps or :data:`MIN_STEADY_SHARE` of the run)."""
    done = [r.finish_s for r in result.requests if r.finish_s is not None]
    if not done or not result.requests:
        return None
    start, end = min(done), max(r.arrival_s for r in result.requests)
    steps = sum(1 for p in result.timeline if start < p.time_s <= end)
    if end <= start or steps < MIN_STEADY_STEPS or end - start < MIN_STEADY_SHARE * result.makespan_s:
        return None
    return start, end


def tokens_at(result: SimResult, t: float) -> float:
    """Real output tokens produced by time ``t`` (s): the timeline's count, linear within the step that spans
    ``t`` (its tokens come out over its duration)."""
    times = [p.time_s for p in result.timeline]
    i = bisect.bisect_right(times, t)
    if i == 0:
        return 0.0
    if i == len(times):
        return result.timeline[-1].tokens
    after, before = result.timeline[i], result.timeline[i - 1]
    frac = (t - before.time_s) / (after.time_s - before.time_s) if after.time_s > before.time_s else 1.0
    return before.tokens + frac * (after.tokens - before.tokens)


def summarize(result: SimResult) -> dict[str, float]:
    """The run's metrics (see the module docstring); ``extra`` (host overlap, TTFT split) is appended."""
    done = [r for r in result.requests if r.finish_s is not None]
    ttft, tpot = _latencies(result.requests)
    c = result.counters
    selected = c["rows_direct"] + c["rows_hot"] + c["rows_host"]
    busy = [p for p in result.timeline if p.batch > 0]
    whole = result.output_tokens / result.makespan_s if result.makespan_s > 0 else 0.0
    out = {
        "output_tok_per_s": whole,
        "mean_ttft_s": _mean(ttft),
        "mean_tpot_s": _mean(tpot),
        "steady_output_tok_per_s": whole,
        "steady_mean_ttft_s": _mean(ttft),
        "steady_mean_tpot_s": _mean(tpot),
        "steady_window_s": 0.0,
        "direct_share": c["rows_direct"] / selected if selected else 0.0,
        "hot_share": c["rows_hot"] / selected if selected else 0.0,
        "host_share": c["rows_host"] / selected if selected else 0.0,
        "mean_batch": sum(p.batch for p in busy) / len(busy) if busy else 0.0,
        "max_batch": float(result.max_batch),
        "requests_done": float(len(done)),
        "admissions_waited": float(sum(r.waited for r in result.requests)),
        # what refused them (a request may wait for several): device memory, host store, a token budget
        **{f"waited_for_{why}": float(sum(why in r.wait_reasons for r in result.requests))
           for why in ("device", "host", "budget")},
        "reclaim_events": c["reclaim_events"],
        "makespan_s": result.makespan_s,
        "sim_steps": float(result.sim_steps),
    }
    window = steady_window(result)
    if window is not None:
        start, end = window
        inside = [r for r in result.requests if start < r.arrival_s <= end]
        s_ttft, s_tpot = _latencies(inside)
        out["steady_output_tok_per_s"] = (tokens_at(result, end) - tokens_at(result, start)) / (end - start)
        out["steady_mean_ttft_s"] = _mean(s_ttft)
        out["steady_mean_tpot_s"] = _mean(s_tpot)
        out["steady_window_s"] = end - start
    out.update(result.extra)
    return out
