"""Independent simulations run ahead in worker processes, then served to the code that asks for them.

Every planner run is a pure function of its specs (hardware, model, serving, workload, scale, drafter and, for
the disaggregated mode, the prefill side): :func:`dhisparse_planner.simulator.run_key`. :func:`run_ahead` runs a
list of such :class:`Job` s in ``workers`` forked processes (longest first), stores each result under its key in
:data:`dhisparse_planner.simulator.AHEAD`, and from then on :func:`~dhisparse_planner.simulator.simulate` (and
:func:`run_job`) returns the stored result of an identical run instead of simulating it again. The experiments'
code is unchanged: it asks for the same runs and gets the same results, only sooner; a run asked for twice (the
co-located TTFT rows and the grid, say) is simulated once. ``tests/planner/test_batch.py`` checks that results
done ahead equal results simulated in place.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from dhisparse_planner.disaggregated import DisaggregatedSimulator, DisaggregationSpec
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import AHEAD, AHEAD_WALL_S, SimResult, Simulator, run_key
from dhisparse_planner.specs import DrafterSpec, HardwareSpec, ModelSpec
from dhisparse_planner.workload import ServingSpec, WorkloadSpec


@dataclass(frozen=True)
class Job:
    """One simulation: the arguments of :func:`~dhisparse_planner.simulator.simulate` (``disaggregation`` set:
    a :class:`~dhisparse_planner.disaggregated.DisaggregatedSimulator` run)."""

    hw: HardwareSpec
    model: ModelSpec
    serving: ServingSpec
    workload: WorkloadSpec
    scale: ScaleSpec
    drafter: DrafterSpec | None = None
    disaggregation: DisaggregationSpec | None = None

    @property
    def key(self) -> tuple:
        return run_key(self.hw, self.model, self.serving, self.workload, self.scale, self.drafter,
                       self.disaggregation)

    def cost(self) -> float:
        """A rough relative cost (for scheduling only): simulated request-steps, speculation counted double."""
        w, g = self.workload, self.scale.token_scale
        steps = w.total_requests * (w.output_tokens + w.input_tokens / 8) / g
        return steps * (2.0 if self.serving.speculation is not None else 1.0)

    def run(self) -> SimResult:
        if self.disaggregation is None:
            return Simulator(self.hw, self.model, self.serving, self.workload, self.scale, self.drafter).run()
        return DisaggregatedSimulator(self.hw, self.model, self.serving, self.workload, self.scale, self.drafter,
                                      disaggregation=self.disaggregation).run()


def _timed(job: Job) -> tuple[SimResult, float]:
    start = time.perf_counter()
    result = job.run()
    return result, time.perf_counter() - start


def run_job(job: Job) -> SimResult:
    """The job's result: the one done ahead, else simulated now (and kept)."""
    done = AHEAD.get(job.key)
    if done is None:
        done, wall = _timed(job)
        AHEAD[job.key] = done
        AHEAD_WALL_S[id(done)] = wall
    return done


def executor(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` forked processes (each inherits the parent's modules; jobs and results are pickled)."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))


def submit(pool: ProcessPoolExecutor, jobs: Iterable[Job]) -> list[tuple[Job, Future]]:
    """Submit the jobs not done yet (each distinct run once), longest first."""
    seen: set[tuple] = set()
    todo = []
    for job in jobs:
        if job.key not in AHEAD and job.key not in seen:
            seen.add(job.key)
            todo.append(job)
    todo.sort(key=lambda j: -j.cost())
    return [(job, pool.submit(_timed, job)) for job in todo]


def collect(pending: list[tuple[Job, Future]], log: Callable[[str], None] | None = None) -> float:
    """Wait for submitted jobs (in the order they finish) and store their results in :data:`AHEAD`; returns the
    worker seconds spent. ``log`` gets one line per finished job (progress)."""
    total = 0.0
    jobs = {id(future): job for job, future in pending}
    for future in as_completed([f for _, f in pending]):
        job = jobs[id(future)]
        result, wall = future.result()
        AHEAD[job.key] = result
        AHEAD_WALL_S[id(result)] = wall
        total += wall
        if log is not None:
            log(f"  ahead: {job.serving.label} C{job.workload.concurrency} {job.workload.input_tokens // 1024}K "
                f"overlap {job.serving.locality.overlap:g}{' disaggregated' if job.disaggregation else ''} "
                f"({wall:.0f} s)")
    return total


def run_ahead(jobs: Iterable[Job], workers: int = 2, log: Callable[[str], None] | None = None) -> float:
    """Run ``jobs`` in ``workers`` processes (in this process when ``workers <= 1``); see the module docstring."""
    if workers <= 1:
        start = time.perf_counter()
        for job in jobs:
            run_job(job)
        return time.perf_counter() - start
    with executor(workers) as pool:
        return collect(submit(pool, jobs), log)


def clear() -> None:
    """Forget every result done ahead."""
    AHEAD.clear()
    AHEAD_WALL_S.clear()
