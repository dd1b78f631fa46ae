"""The paper's headline claims with their uncertainty (see docs/planner.md, "Uncertainty").

- :func:`calibrate_locality`: the selection model fitted to the published resolution shares (paper setup,
  low load) and to selection traces of our engine; the nominal is the published-share fit, the plausible range
  spans both fits (at least +-0.03 overlap, +-0.05 recent fraction around the nominal). The locality is varied at
  the calibrated box's two corners (:func:`locality_corners`): least locality (both low) and most (both high).
- The claims themselves and their verdicts: :mod:`dhisparse_planner.claims`.
- :func:`make_rerun`: how the non-time constants are varied: the locality from the sweeps run at its corners, the
  other ones by simulating a fixed subset of headline points again (:data:`RERUN_KEYS`; the other claims then say
  "not varied" for that constant).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from dhisparse_planner.batch import Job, run_job
from dhisparse_planner.calibrate import PublishedFit, TraceFit, TraceMoments, fit_published, fit_trace_moments
from dhisparse_planner.claims import LONG
from dhisparse_planner.constants import Constant, Setup, affects
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.paper import ADMISSION, BASE, PAPER_REQUESTS_PER_CLIENT, SCALE, SPEC
from dhisparse_planner.report import parse_config
from dhisparse_planner.simulator import SimResult, simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.workload import WorkloadSpec

Key = tuple[str, int, float]
Row = dict[str, float | str]
POLICIES_ADMITTED = tuple(policy for policy, _ in ADMISSION)  # the baselines that admit by SGLang's budget


# ------------------------------------------------------------------------------------------------ calibration
def paper_shares(policy: str, locality: LocalityModel) -> dict[str, float]:
    """Resolution shares of one 32K/8K request without speculation in the paper setup (low load: at low load a
    request's resolution does not depend on the others')."""
    serving = dataclasses.replace(parse_config(policy, BASE, SPEC, ADMISSION), locality=locality)
    res = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, WorkloadSpec(32768, 8192, concurrency=1, num_requests=1),
                   SCALE)
    return res.summary()


FIT_ITERS = 3  # regula-falsi steps per one-dimensional fit (each step: one 32K/8K single-request simulation)


@dataclasses.dataclass(frozen=True)
class LocalityCalibration:
    published: PublishedFit
    trace: TraceFit | None
    nominal: LocalityModel
    overlap_range: tuple[float, float]
    recent_range: tuple[float, float]


def calibrate_locality(trace: dict | None, log: bool = False, iters: int = FIT_ITERS) -> LocalityCalibration:
    """Fit to the published shares and (if given) to an engine trace summary
    (:func:`dhisparse_planner.engine_trace.trace_summary`, e.g. ``docs/results/engine_trace.json``)."""
    published = fit_published(paper_shares, LocalityModel(overlap=0.85, recent_fraction=0.3), iters=iters,
                              overlap_bracket=(0.75, 0.95), recent_bracket=(0.1, 0.6))
    trace_fit = None
    if trace is not None:
        observed = TraceMoments(float(trace["kept"]), float(trace["recent"]), int(trace["pairs"]))
        trace_fit = fit_trace_moments(observed, trace["limits"], int(trace["index_topk"]), int(trace["window"]))
    ovs = [published.overlap] + ([trace_fit.overlap] if trace_fit else [])
    rfs = [published.recent_fraction] + ([trace_fit.recent_fraction] if trace_fit else [])
    ov_range = (max(0.0, min(min(ovs), published.overlap - 0.03)), min(0.99, max(max(ovs), published.overlap + 0.03)))
    rf_range = (max(0.0, min(min(rfs), published.recent_fraction - 0.05)),
                min(1.0, max(max(rfs), published.recent_fraction + 0.05)))
    nominal = LocalityModel(overlap=round(published.overlap, 3), recent_fraction=round(published.recent_fraction, 3))
    ov_range = (round(ov_range[0], 3), round(ov_range[1], 3))
    rf_range = (round(rf_range[0], 3), round(rf_range[1], 3))
    if log:
        print(f"  published-share fit: overlap {published.overlap:.3f}, recent {published.recent_fraction:.3f}"
              + (f"; engine trace: overlap {trace_fit.overlap:.3f}, recent {trace_fit.recent_fraction:.3f}"
                 if trace_fit else ""), flush=True)
    return LocalityCalibration(published, trace_fit, nominal, ov_range, rf_range)


def calibrated_constants(cal: LocalityCalibration) -> tuple[Constant, ...]:
    """:data:`CONSTANTS` with the locality entries replaced by the calibration: the overlap's entry stands for the
    calibrated box (overlap and recent fraction together, at its corners), the recent fraction's is dropped."""
    from dhisparse_planner.constants import CONSTANTS

    out = []
    for c in CONSTANTS:
        if c.target == "locality" and c.field == "overlap":
            c = dataclasses.replace(c, name="locality (overlap, recent fraction)", value=cal.nominal.overlap,
                                    low=cal.overlap_range[0], high=cal.overlap_range[1])
        elif c.target == "locality" and c.field == "recent_fraction":
            continue  # varied with the overlap, at the calibrated box's corners
        out.append(c)
    return tuple(out)


def locality_corners(cal: LocalityCalibration) -> tuple[LocalityModel, LocalityModel]:
    """The calibrated box's corners: least locality (low overlap, low recent fraction) and most (both high)."""
    lo = dataclasses.replace(cal.nominal, overlap=cal.overlap_range[0], recent_fraction=cal.recent_range[0])
    hi = dataclasses.replace(cal.nominal, overlap=cal.overlap_range[1], recent_fraction=cal.recent_range[1])
    return lo, hi


# ------------------------------------------------------------------------------------------------ re-runs
# The headline points simulated again for each decision constant: the system comparator at 32K C128 and at 100K C128
# (with non-speculative adaptive at 100K for the 1.27x claim).
RERUN_KEYS: tuple[tuple[str, int], ...] = (("adaptive+dflash2", 128), ("hisparse", 128),
                                           ("adaptive+dflash2" + LONG, 128), ("hisparse" + LONG, 128),
                                           ("adaptive" + LONG, 128))


def make_rerun(base: dict[Key, SimResult], by_overlap: dict[float, dict[Key, SimResult]],
               log: bool = False) -> Callable[[Constant, Setup], dict[Key, SimResult] | None]:
    """``rerun`` for :func:`dhisparse_planner.sensitivity.sensitivity` over the paper's sweeps (module docstring)."""
    nominal_ov = next(iter(base))[2]

    def rerun(c: Constant, setup: Setup) -> dict[Key, SimResult] | None:
        if c.target == "locality" and c.field == "overlap":
            grid = by_overlap.get(round(setup.locality.overlap, 6))
            if grid is None:
                return None
            out = {k: v for k, v in base.items() if not affects(c, k[0].partition("@")[0])}  # e.g. resident
            out.update({(k[0], k[1], nominal_ov): v for k, v in grid.items()})
            return out
        out = {k: v for k, v in base.items() if not affects(c, k[0].partition("@")[0], POLICIES_ADMITTED)}
        for label, conc in RERUN_KEYS:
            if not affects(c, label.partition("@")[0], POLICIES_ADMITTED) or (label, conc, nominal_ov) not in base:
                continue
            out[(label, conc, nominal_ov)] = run_job(rerun_job(setup, label, conc))
            if log:
                print(f"    {c.name} = {setup.current(c) * c.scale:.3g}: {label} C{conc} re-simulated", flush=True)
        return out

    return rerun


def rerun_job(setup: Setup, label: str, conc: int) -> Job:
    """The re-simulation of headline point ``(label, conc)`` (100K labels end in ``@100K``) under ``setup``."""
    name, long = label.removesuffix(LONG), label.endswith(LONG)
    serving = dataclasses.replace(parse_config(name, BASE, setup.speculation or SPEC, ADMISSION),
                                  locality=setup.locality)
    if setup.admission is not None and serving.admission is not None:
        serving = dataclasses.replace(serving, admission=setup.admission)
    work = WorkloadSpec(102400 if long else 32768, 8192, concurrency=conc,
                        num_requests=conc * PAPER_REQUESTS_PER_CLIENT)
    return Job(setup.hw, setup.model, serving, work, SCALE)


def rerun_jobs(base_keys: Iterable[Key], setup: Setup, constants: Iterable[Constant]) -> list[Job]:
    """Every re-simulation :func:`make_rerun` will ask for (to run them ahead, :mod:`dhisparse_planner.batch`)."""
    keys = set(base_keys)
    jobs: list[Job] = []
    for c in constants:
        if c.retime or (c.target == "locality" and c.field == "overlap"):
            continue
        for value in c.range_around(setup.current(c)):
            if value == setup.current(c):  # the nominal runs are that end (sensitivity reuses them)
                continue
            changed = setup.with_value(c, value)
            jobs += [rerun_job(changed, label, conc) for label, conc in RERUN_KEYS
                     if affects(c, label.partition("@")[0], POLICIES_ADMITTED)
                     and any(k[0] == label and k[1] == conc for k in keys)]
    return jobs


__all__ = ["calibrate_locality", "calibrated_constants", "locality_corners", "make_rerun"]
