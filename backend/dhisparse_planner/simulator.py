"""Step-level simulation of one decode GPU: :class:`EngineCore` (real KV code) + scale model + time model.

Public API::

    result = simulate(hw, model, serving, workload, scale=ScaleSpec(token_scale=32), drafter=None)
    result.summary()   # output tokens/s per GPU, mean TTFT, mean TPOT, host-fetched share, host_overlap, ...

``host_overlap`` in the summary is the fraction of host-fetch time the index-group schedule hid
(:mod:`dhisparse_planner.overlap`), an outcome of the run. A closed-loop run without load steps makes the same
KV decisions whatever the time constants are, so :func:`dhisparse_planner.retime.retime` can re-time it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from dhisparse_planner.core import EngineCore, SimRequest, StepOutcome
from dhisparse_planner.locality import SyntheticSelector
from dhisparse_planner.metrics import summarize
from dhisparse_planner.overlap import host_overlap
from dhisparse_planner.real_time import RealTime
from dhisparse_planner.scale import ScaledKV, ScaleSpec, build_scaled_kv, check_simulated_host
from dhisparse_planner.specs import DRAFTERS, DrafterSpec, HardwareSpec, ModelSpec
from dhisparse_planner.timing import StepLoad, decode_step_seconds, prefill_seconds
from dhisparse_planner.workload import ServingSpec, WorkloadSpec


@dataclass
class TimelinePoint:
    """One engine step: clock after it (s), batch, queue, memory split (real bytes), host share of the step."""

    time_s: float
    batch: int
    waiting: int
    required_bytes: float
    optional_bytes: float
    reserve_bytes: float
    pool_bytes: float
    host_share: float
    step_s: float
    tokens: float = 0.0  # real output tokens produced so far (every request, prefill tokens included)


@dataclass
class SimResult:
    """Per-request records, the timeline and the KV counters of one run (real units)."""

    label: str
    requests: list[SimRequest]
    timeline: list[TimelinePoint]
    counters: dict[str, float]
    output_tokens: float
    makespan_s: float
    sim_steps: int
    token_scale: int
    byte_factor: float
    max_batch: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # what the clock did, in order: ("issue" | "prefill" | "finish", request) and ("decode", StepLoad); None when
    # the run's decisions depend on time (load steps, Poisson arrivals) and it cannot be re-timed
    log: list[tuple[str, object]] | None = None
    drafter: DrafterSpec | None = None
    clients: int = 0  # closed-loop clients at the start (real_time.RealTime)
    prefill_tokens_per_step: int = 1  # the engine's per-real-step prefill budget (real_time.RealTime)

    def summary(self) -> dict[str, float]:
        """Whole-run and steady-state metrics (:func:`dhisparse_planner.metrics.summarize`)."""
        return summarize(self)


class Simulator:
    """One run of ``workload`` served with ``serving`` by ``model`` on ``hw`` (see the module docstring)."""

    def __init__(self, hw: HardwareSpec, model: ModelSpec, serving: ServingSpec, workload: WorkloadSpec,
                 scale: ScaleSpec = ScaleSpec(), drafter: DrafterSpec | None = None,
                 check_invariants_every: int = 0) -> None:
        spec = serving.speculation
        if spec is not None and drafter is None:
            drafter = DRAFTERS[spec.drafter]
        self.hw, self.model, self.serving, self.workload, self.drafter = hw, model, serving, workload, drafter
        pool = model.kv_pool_bytes(hw, drafter.weight_bytes if (drafter and spec) else 0.0)
        self.kvs: ScaledKV = build_scaled_kv(model, scale, serving.policy, pool,
                                             serving.hot_rows_for(model.index_topk), serving.page_rows,
                                             serving.reserve_bytes, serving.refill_pages_per_step,
                                             serving.max_query_len,
                                             drafter.ring_bytes if (drafter and spec) else 0.0,
                                             host_bytes=hw.host_bytes_per_gpu)
        check_simulated_host(self.kvs)
        g = self.kvs.token_scale
        self.g = g
        groups = -(-self.kvs.layout.num_layers // model.index_group_size)
        self.selector = SyntheticSelector(serving.locality, self.kvs.layout.index_topk, groups, g, workload.seed)
        self.gen = torch.Generator().manual_seed(workload.seed + 1)
        # one simulated step stands for g real ones, so it may prefill what g real steps may (the scale model)
        self.logical_tokens = (serving.admission.logical_tokens(model, pool, hw.host_bytes_per_gpu)
                               if serving.admission is not None else None)
        self.core = EngineCore(self.kvs.layout, self.kvs.config, serving.max_batch_size,
                               serving.max_prefill_tokens_per_step * g, self._positions,
                               prefill_tokens=lambda r: r.prompt_tokens,  # type: ignore[attr-defined]
                               on_release=self._released,
                               gate=self._token_budget_admits if serving.admission is not None else None)
        self.check_every = check_invariants_every
        self.clock = 0.0
        self.issued = 0
        self.retimable = workload.concurrency > 0 and not workload.concurrency_schedule
        self.times = RealTime(workload.concurrency if self.retimable else 0)
        self.log: list[tuple[str, object]] = []
        self.fetch_s = self.exposed_s = 0.0
        self.requests: list[SimRequest] = []
        self.arrivals: collections.deque[float] = collections.deque(
            workload.poisson_arrivals() if workload.concurrency == 0 else [])

    # ------------------------------------------------------------------------------------------- requests
    def _new_request(self, arrival_s: float) -> None:
        w, kvs = self.workload, self.kvs
        req = SimRequest(f"r{self.issued}", kvs.sim_tokens(w.input_tokens), kvs.sim_output_tokens(w.output_tokens),
                         arrival_s=arrival_s)
        req.prompt_tokens = w.input_tokens  # type: ignore[attr-defined]
        req.extra_real_tokens = 0  # type: ignore[attr-defined]
        self.issued += 1
        self.log.append(("issue", req))
        self.requests.append(req)
        self.core.waiting.append(req)

    def _issue(self) -> None:
        w = self.workload
        if w.concurrency == 0:
            while self.arrivals and self.arrivals[0] <= self.clock:
                self._new_request(self.arrivals.popleft())
            return
        alive = len(self.core.waiting) + len(self.core.running)
        while alive < w.clients_at(self.clock) and self.issued < w.total_requests:
            self._new_request(self.times.arrival(self.clock))
            alive += 1

    def _next_event_s(self) -> float | None:
        w = self.workload
        if w.concurrency == 0:
            return self.arrivals[0] if self.arrivals else None
        later = [s for s, c in w.concurrency_schedule if s > self.clock and c > 0]
        return min(later) if later and self.issued < w.total_requests else None

    def _real_generated(self, req: SimRequest) -> int:
        return 0 if req.generated < 1 else min(self.workload.output_tokens, 1 + (req.generated - 1) * self.g)

    def _token_budget_admits(self, req: SimRequest) -> bool:
        """The baseline's own admission rule (``serving.admission``), in real tokens."""
        rule, out = self.serving.admission, self.workload.output_tokens
        assert rule is not None and self.logical_tokens is not None
        running = [(r.prompt_tokens, self._real_generated(r), out) for r in self.core.running]  # type: ignore[attr-defined]
        return rule.admits(running, req.prompt_tokens, out, self.logical_tokens)  # type: ignore[attr-defined]

    def _released(self, req: SimRequest) -> None:
        self._finished_now.append(req)
        req.extra_real_tokens = min(self.workload.output_tokens, 1 + (req.generated - 1) * self.g)  # type: ignore[attr-defined]
        self.selector.forget(req.request_id)

    # ------------------------------------------------------------------------------------------- per step
    def _context(self, batch: list[SimRequest]) -> torch.Tensor:
        return torch.tensor([r.kv_length * self.g for r in batch], dtype=torch.int64)

    def _positions(self, batch: list[SimRequest], starts: torch.Tensor, query_lens: torch.Tensor,
                   q: int) -> dict[int, torch.Tensor]:
        per_group = self.selector.select([r.request_id for r in batch], starts, query_lens, q)
        size = self.model.index_group_size
        return {layer: per_group[layer // size] for layer in range(self.kvs.layout.num_layers)}

    def _accept(self, batch: list[SimRequest], query_lens: torch.Tensor) -> torch.Tensor:
        spec = self.serving.speculation
        if spec is None:
            return torch.ones(len(batch), dtype=torch.int64)
        return spec.sample_accepted(query_lens, self._context(batch), self.gen)

    def _on_admit(self, req: SimRequest) -> None:
        req.admitted_s = self.clock
        self.log.append(("prefill", req))
        prefill_s = prefill_seconds(self.hw, self.model, req.prompt_tokens)  # type: ignore[attr-defined]
        self.clock += prefill_s  # the GPU's time; the request's own first token: real_time.py
        share = req.prompt_tokens / self.serving.max_prefill_tokens_per_step  # type: ignore[attr-defined]
        req.first_token_s = self.times.first_token(req, prefill_s, share)

    def _decode_load(self, batch: list[SimRequest], query_lens: torch.Tensor, context: torch.Tensor,
                     host_rows_sim: float, refill_pages_sim: float) -> StepLoad:
        m, kvs = self.model, self.kvs
        ctx = context.to(torch.float64)
        q = query_lens.to(torch.float64)
        page_bytes_sim = kvs.config.page_rows * kvs.layout.row_bytes
        host_bytes = host_rows_sim * kvs.byte_factor * m.row_bytes
        refill_bytes = refill_pages_sim * page_bytes_sim * kvs.byte_factor / self.g
        spec = self.serving.speculation
        return StepLoad(batch=len(batch), query_tokens=int(q.sum()),
                        attention_rows=float((q * torch.clamp(ctx, max=m.index_topk)).sum()) * m.num_layers,
                        index_keys_scanned=float((q * ctx).sum()) * m.num_indexers,
                        index_keys_read=float(ctx.sum()) * m.num_indexers, host_bytes=host_bytes,
                        draft_tokens=0 if spec is None else spec.gamma * len(batch), refill_bytes=refill_bytes)

    def step(self) -> tuple[StepOutcome, float]:
        """One engine step; advances the clock. Returns the outcome and the decode time (s)."""
        core = self.core
        before = core.counters()
        out = StepOutcome()
        core.kv.poll()
        self._finished_now: list[SimRequest] = []
        self.times.begin_step(self.clock)
        self.log.append(("step", None))
        core.admit(out, self._on_admit)
        self.times.end_admissions()
        self.log.append(("admitted", None))
        self._stamp_finished()
        step_s = 0.0
        if core.running:
            batch = list(core.running)
            spec = self.serving.speculation
            q = (torch.ones(len(batch), dtype=torch.int64) if spec is None
                 else spec.verify_lengths(self._context(batch), len(batch)))
            load_ctx = self._context(batch)
            mid = core.counters()
            core.decode(out, q, self._accept)
            after = core.counters()
            load = self._decode_load(batch, q, load_ctx, after["rows_host"] - mid["rows_host"],
                                     after["optional_pages_refill_issued"] - before["optional_pages_refill_issued"])
            parts = decode_step_seconds(self.hw, self.model, load, self.drafter if spec else None)
            step_s = parts["total"] * self.g
            self.fetch_s += parts["fetch"] * self.g
            self.exposed_s += parts["host"] * self.g
            self.log.append(("decode", load))
            self.clock += step_s
            self.times.decoded(step_s, self.g)
            self._stamp_finished()
            host = after["rows_host"] - mid["rows_host"]
            sel = host + after["rows_direct"] - mid["rows_direct"] + after["rows_hot"] - mid["rows_hot"]
            self._record(len(batch), host / sel if sel else 0.0, step_s)
        out.counters = core.counters()
        return out, step_s

    def _stamp_finished(self) -> None:
        for req in self._finished_now:
            req.finish_s = self.times.finish(req, self.clock)
            self.log.append(("finish", req))
        self._finished_now = []

    def _record(self, batch: int, host_share: float, step_s: float) -> None:
        pool, f = self.core.kv.pool, self.kvs.byte_factor
        tokens = sum(self._real_generated(r) for r in self.requests)
        self.timeline.append(TimelinePoint(self.clock, batch, len(self.core.waiting), pool.required_bytes * f,
                                           pool.optional_bytes * f, pool.reserve_bytes * f, pool.pool_bytes * f,
                                           host_share, step_s, float(tokens)))
        self.max_batch = max(self.max_batch, batch)

    def run(self, max_sim_steps: int = 10_000_000) -> SimResult:
        """Run until every request of the workload has finished (or ``max_sim_steps``)."""
        self.timeline: list[TimelinePoint] = []
        self.max_batch = 0
        steps = 0
        idle = 0
        while steps < max_sim_steps:
            self._issue()
            core = self.core
            if not core.waiting and not core.running:
                nxt = self._next_event_s()
                if nxt is None:
                    break
                self.clock = max(self.clock, nxt)
                self.retimable = False
                continue
            out, _ = self.step()
            steps += 1
            if self.check_every and steps % self.check_every == 0:
                core.kv.check_invariants()
            idle = idle + 1 if not out.batch and not out.admitted else 0
            if idle > 3:
                raise RuntimeError("simulation stalled: requests wait but nothing runs (pool too small?)")
        core = self.core
        core.kv.poll()
        if self.check_every:
            core.kv.check_invariants()
        real_tokens = sum(r.extra_real_tokens for r in self.requests if r.finish_s is not None)  # type: ignore[attr-defined]
        start = min((r.arrival_s for r in self.requests), default=0.0)
        return SimResult(self.serving.label, self.requests, self.timeline,
                         {k: float(v) for k, v in core.kv.counters.items()}, float(real_tokens),
                         self.clock - start, steps, self.g, self.kvs.byte_factor, self.max_batch,
                         {"host_overlap": host_overlap(self.fetch_s, self.exposed_s)},
                         self.log if self.retimable else None, self.drafter if self.serving.speculation else None,
                         self.workload.concurrency if self.retimable else 0, self.serving.max_prefill_tokens_per_step)


# Results of runs done ahead in worker processes (dhisparse_planner.batch.run_ahead), by run key; simulate() returns
# the stored result of an identical run instead of simulating it again (every run is a pure function of its key).
AHEAD: dict[tuple, SimResult] = {}
AHEAD_WALL_S: dict[int, float] = {}  # id(result) -> seconds the worker spent on it


def run_key(hw: HardwareSpec, model: ModelSpec, serving: ServingSpec, workload: WorkloadSpec, scale: ScaleSpec,
            drafter: DrafterSpec | None = None, disaggregation: object | None = None) -> tuple:
    """What determines a run's result (all frozen specs); ``disaggregation`` None for the co-located mode."""
    return (hw, model, serving, workload, scale, drafter, disaggregation)


def simulate(hw: HardwareSpec, model: ModelSpec, serving: ServingSpec, workload: WorkloadSpec,
             scale: ScaleSpec = ScaleSpec(), drafter: DrafterSpec | None = None,
             check_invariants_every: int = 0) -> SimResult:
    """Build a :class:`Simulator` and run it to completion (or return the result of the identical run done
    ahead, see :data:`AHEAD`)."""
    if AHEAD and not check_invariants_every:
        done = AHEAD.get(run_key(hw, model, serving, workload, scale, drafter))
        if done is not None:
            return done
    return Simulator(hw, model, serving, workload, scale, drafter, check_invariants_every).run()
