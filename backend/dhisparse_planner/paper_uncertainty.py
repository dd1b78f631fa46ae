"""The paper's headline claims with their uncertainty (see docs/planner.md, "Uncertainty").

- :func:`calibrate_locality`: the selection model fitted to the published resolution shares (paper setup,
  low load) and to selection traces of our engine; the nominal is the published-share fit, the plausible range
  spans both fits (at least +-0.03 overlap, +-0.05 recent fraction around the nominal).
- :func:`headline_claims`: every headline comparison as a function of table rows (32K grid labels as they are,
  100K labels suffixed ``@100K``), next to the paper's number (:data:`PAPER`).
- :func:`make_rerun`: how the non-time constants are varied: the locality overlap from the grid runs at its
  range ends, the other ones by simulating a fixed subset of headline points again (the rest of the claims then
  say "not varied" for that constant).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

from dhisparse_planner.batch import Job, run_job
from dhisparse_planner.calibrate import PublishedFit, TraceFit, TraceMoments, fit_published, fit_trace_moments
from dhisparse_planner.constants import BY_NAME, Constant, Setup, affects
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.paper import ADMISSION, BASE, PAPER_REQUESTS_PER_CLIENT, SCALE, SPEC
from dhisparse_planner.report import parse_config, recommend
from dhisparse_planner.simulator import SimResult, simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.workload import WorkloadSpec

Key = tuple[str, int, float]
Row = dict[str, float | str]
LONG = "@100K"

PAPER = {
    "adaptive / hisparse output, 32K C8": "1.7–1.9× (C8–C64)",
    "adaptive / hisparse output, 32K C32": "1.7–1.9× (C8–C64)",
    "adaptive / hisparse output, 32K C64": "1.7–1.9× (C8–C64)",
    "adaptive / hisparse output, 32K C128": "1.45×",
    "hisparse / adaptive mean TTFT, 32K C128": "2.3×",
    "adaptive+dflash2 / hisparse output, 100K C128": "1.45×",
    "adaptive+dflash2 / adaptive output, 100K C128": "1.27×",
    "hisparse / adaptive+dflash2 mean TTFT, 100K C128": "2.1×",
    "adaptive+dflash2 output per GPU, 100K C128 (tok/s)": "793",
    "resident+dflash2 / adaptive+dflash2 output, 32K C8": "1.05–1.09× (C≤32)",
    "resident+dflash2 / adaptive+dflash2 output, 32K C32": "1.05–1.09× (C≤32)",
    "best adaptive(+dflash2) / best hisparse, TPOT ≤ 50 ms": "2.3–3.7× (over bounds)",
    "best adaptive(+dflash2) / best hisparse, TPOT ≤ 100 ms": "2.3–3.7× (over bounds)",
    "best resident(+dflash2) / best adaptive(+dflash2), TPOT ≤ 50 ms": "(resident stops scaling at C64)",
}


def headline_claims(rows: list[Row]) -> dict[str, float]:
    """The claims of :data:`PAPER` that ``rows`` allow (one row per label and concurrency)."""
    idx = {(str(r["label"]), int(float(r["concurrency"]))): r for r in rows}
    out: dict[str, float] = {}

    def ratio(name: str, a: str, b: str, c: int, metric: str = "output_tok_per_s_per_gpu") -> None:
        ra, rb = idx.get((a, c)), idx.get((b, c))
        if ra is not None and rb is not None and float(rb[metric]) > 0:
            out[name] = float(ra[metric]) / float(rb[metric])

    for c in (8, 32, 64, 128):
        ratio(f"adaptive / hisparse output, 32K C{c}", "adaptive", "hisparse", c)
    ratio("hisparse / adaptive mean TTFT, 32K C128", "hisparse", "adaptive", 128, "mean_ttft_s")
    ratio("adaptive+dflash2 / hisparse output, 100K C128", "adaptive+dflash2" + LONG, "hisparse" + LONG, 128)
    ratio("adaptive+dflash2 / adaptive output, 100K C128", "adaptive+dflash2" + LONG, "adaptive" + LONG, 128)
    ratio("hisparse / adaptive+dflash2 mean TTFT, 100K C128", "hisparse" + LONG, "adaptive+dflash2" + LONG, 128,
          "mean_ttft_s")
    spec = idx.get(("adaptive+dflash2" + LONG, 128))
    if spec is not None:
        out["adaptive+dflash2 output per GPU, 100K C128 (tok/s)"] = float(spec["output_tok_per_s_per_gpu"])
    for c in (8, 32):
        ratio(f"resident+dflash2 / adaptive+dflash2 output, 32K C{c}", "resident+dflash2", "adaptive+dflash2", c)
    short = [r for r in rows if not str(r["label"]).endswith(LONG)]
    for bound in (0.05, 0.1):
        best = {label: recommend([r for r in short if r["label"] == label], bound)
                for label in ("hisparse", "adaptive", "adaptive+dflash2", "resident", "resident+dflash2")}
        val = {k: (float(v["output_tok_per_s_per_gpu"]) if v is not None else 0.0) for k, v in best.items()}
        present = {str(r["label"]) for r in short}
        if {"hisparse", "adaptive", "adaptive+dflash2"} <= present:
            ada = max(val["adaptive"], val["adaptive+dflash2"])
            out[f"best adaptive(+dflash2) / best hisparse, TPOT ≤ {1e3 * bound:g} ms"] = (
                ada / val["hisparse"] if val["hisparse"] > 0 else math.inf)
        if bound == 0.05 and {"resident", "resident+dflash2", "adaptive", "adaptive+dflash2"} <= present:
            ada = max(val["adaptive"], val["adaptive+dflash2"])
            res = max(val["resident"], val["resident+dflash2"])
            out["best resident(+dflash2) / best adaptive(+dflash2), TPOT ≤ 50 ms"] = res / ada if ada > 0 else math.inf
    return out


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
    """:data:`CONSTANTS` with the locality entries replaced by the calibration."""
    from dhisparse_planner.constants import CONSTANTS

    out = []
    for c in CONSTANTS:
        if c.target == "locality" and c.field == "overlap":
            c = dataclasses.replace(c, value=cal.nominal.overlap, low=cal.overlap_range[0], high=cal.overlap_range[1])
        elif c.target == "locality" and c.field == "recent_fraction":
            c = dataclasses.replace(c, value=cal.nominal.recent_fraction, low=cal.recent_range[0],
                                    high=cal.recent_range[1])
        out.append(c)
    return tuple(out)


# ------------------------------------------------------------------------------------------------ re-runs
RERUN_KEYS: tuple[tuple[str, int], ...] = (("adaptive", 128), ("hisparse", 128), ("adaptive+dflash2" + LONG, 128),
                                           ("hisparse" + LONG, 128))


def make_rerun(base: dict[Key, SimResult], by_overlap: dict[float, dict[Key, SimResult]],
               log: bool = False) -> Callable[[Constant, Setup], dict[Key, SimResult] | None]:
    """``rerun`` for :func:`dhisparse_planner.sensitivity.sensitivity` over the paper's grids (module docstring)."""
    nominal_ov = next(iter(base))[2]

    def rerun(c: Constant, setup: Setup) -> dict[Key, SimResult] | None:
        if c.target == "locality" and c.field == "overlap":
            grid = by_overlap.get(round(setup.locality.overlap, 6))
            return None if grid is None else {(k[0], k[1], nominal_ov): v for k, v in grid.items()}
        out = {k: v for k, v in base.items() if not affects(c, k[0])}
        for label, conc in RERUN_KEYS:
            if not affects(c, label) or (label, conc, nominal_ov) not in base:
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
            changed = setup.with_value(c, value)
            jobs += [rerun_job(changed, label, conc) for label, conc in RERUN_KEYS
                     if affects(c, label) and any(k[0] == label and k[1] == conc for k in keys)]
    return jobs


__all__ = ["BY_NAME", "PAPER", "calibrate_locality", "calibrated_constants", "headline_claims", "make_rerun"]
