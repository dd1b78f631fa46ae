"""Re-time a finished run under other time constants without simulating it again.

In a closed-loop run without load steps the KV manager's decisions (admissions, hits, misses, reclaims,
refills) and the batch of every step do not depend on the clock: only on the order of steps. The simulator
logs what moved the clock (request issued, prefill, decode step with its :class:`StepLoad`, request
finished); :func:`retime` replays that log with another :class:`HardwareSpec` / :class:`ModelSpec` time model
and returns a result whose summary equals that of a full re-simulation (tests check it). This makes the
sensitivity analysis of the time constants cheap.
"""

from __future__ import annotations

import copy
import dataclasses

from dhisparse_planner.core import SimRequest
from dhisparse_planner.overlap import host_overlap
from dhisparse_planner.real_time import RealTime
from dhisparse_planner.simulator import SimResult
from dhisparse_planner.specs import DrafterSpec, HardwareSpec, ModelSpec
from dhisparse_planner.timing import StepLoad, decode_step_seconds, prefill_seconds


def retime(result: SimResult, hw: HardwareSpec, model: ModelSpec, drafter: DrafterSpec | None = None) -> SimResult:
    """``result`` with every time recomputed under ``hw`` / ``model`` (``drafter``: the run's own by default).

    ``model`` may differ from the simulated one only in time-model fields (parameters, FLOP counts, heads);
    a change of memory sizes needs a new simulation. Raises ValueError for runs that cannot be re-timed."""
    if result.log is None:
        raise ValueError("this run cannot be re-timed: its decisions depend on time (load steps or Poisson "
                         "arrivals); simulate it again instead")
    drafter = drafter if drafter is not None else result.drafter
    g = result.token_scale
    clones: dict[int, SimRequest] = {id(r): copy.copy(r) for r in result.requests}
    points = iter(result.timeline)
    timeline = []
    clock = fetch_s = exposed_s = 0.0
    times = RealTime(result.clients)
    for kind, obj in result.log:
        if kind == "decode":
            assert isinstance(obj, StepLoad)
            parts = decode_step_seconds(hw, model, obj, drafter if obj.draft_tokens > 0 else None)
            step_s = parts["total"] * g
            fetch_s += parts["fetch"] * g
            exposed_s += parts["host"] * g
            clock += step_s
            times.decoded(step_s, g)
            timeline.append(dataclasses.replace(next(points), time_s=clock, step_s=step_s))
            continue
        if kind == "step":
            times.begin_step(clock)
            continue
        if kind == "admitted":
            times.end_admissions()
            continue
        req = clones[id(obj)]
        if kind == "issue":
            req.arrival_s = times.arrival(clock)
        elif kind == "prefill":
            req.admitted_s = clock
            prefill_s = prefill_seconds(hw, model, req.prompt_tokens)  # type: ignore[attr-defined]
            clock += prefill_s
            req.first_token_s = times.first_token(req, prefill_s,
                                                  req.prompt_tokens / result.prefill_tokens_per_step)  # type: ignore[attr-defined]
        elif kind == "finish":
            req.finish_s = times.finish(req, clock)
        else:
            raise ValueError(f"unknown log entry {kind!r}")
    requests = [clones[id(r)] for r in result.requests]
    start = min((r.arrival_s for r in requests), default=0.0)
    extra = dict(result.extra, host_overlap=host_overlap(fetch_s, exposed_s))
    log = [(kind, obj if obj is None or kind == "decode" else clones[id(obj)]) for kind, obj in result.log]
    return dataclasses.replace(result, requests=requests, timeline=timeline, makespan_s=clock - start,
                               extra=extra, log=log, drafter=drafter)
