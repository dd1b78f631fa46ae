"""How far each constant moves a verdict: one bar per constant, from its low to its high plausible value.

A *claim* is a number computed from a grid's rows (a ratio such as adaptive / hisparse output at C128). For
each constant of :data:`~dhisparse_planner.constants.CONSTANTS` the claim is recomputed with the constant at the
low and at the high end of its range, every other constant nominal. Time-only constants re-time the finished
runs (:func:`~dhisparse_planner.retime.retime`, exact for closed loops); the others call ``rerun`` with the
changed setup (a new simulation, or grid results that already hold the changed value). Everything is seeded:
the report is a pure function of its inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from dhisparse_planner.constants import CONSTANTS, Constant, Setup
from dhisparse_planner.report import result_row
from dhisparse_planner.retime import retime
from dhisparse_planner.simulator import SimResult

Key = tuple[str, int, float]  # (config label, concurrency, overlap)
Row = dict[str, float | str]
ClaimsFn = Callable[[list[Row]], dict[str, float]]
RerunFn = Callable[[Constant, Setup], dict[Key, SimResult] | None]
COLUMNS = ("claim", "constant", "unit", "low", "high", "nominal", "at_low", "at_high", "swing", "how")


def rows_of(results: dict[Key, SimResult], gpus: int) -> list[Row]:
    """Table rows of a set of results (as :func:`dhisparse_planner.report.run_one` makes them)."""
    return [result_row(res, label, c, overlap, gpus) for (label, c, overlap), res in results.items()]


def retime_all(results: dict[Key, SimResult], setup: Setup, constant: Constant | None = None,
               value: float = 0.0) -> dict[Key, SimResult]:
    """Every result re-timed under ``setup`` (a drafter constant applies to each run's own drafter)."""
    out: dict[Key, SimResult] = {}
    for key, res in results.items():
        drafter = res.drafter
        if constant is not None and constant.target == "drafter" and drafter is not None:
            drafter = dataclasses.replace(drafter, **{constant.field: value})
        out[key] = retime(res, setup.hw, setup.model, drafter)
    return out


def sensitivity(base: dict[Key, SimResult], setup: Setup, claims: ClaimsFn, gpus: int,
                rerun: RerunFn | None = None, constants: Sequence[Constant] = CONSTANTS, workers: int = 1) -> list[Row]:
    """One row per claim and constant: the claim at the constant's low and high end (``nan`` where the
    constant does not apply or ``rerun`` declines it by returning None). ``workers > 1`` runs the re-simulated
    ends in that many forked processes (same results: every run is seeded)."""
    nominal = claims(rows_of(base, gpus))
    tasks = []
    for c in constants:
        lo, hi = c.range_around(setup.current(c))
        tasks += [(c, lo), (c, hi)]
    global _STATE
    _STATE = (base, setup, claims, gpus, rerun, tasks)
    ends: list[dict[str, float] | None] = [None] * len(tasks)
    heavy = [i for i, (c, _) in enumerate(tasks) if not c.retime]
    if workers > 1 and heavy:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for i, got in zip(heavy, pool.map(_end_claims, heavy), strict=True):
                ends[i] = got
    for i in range(len(tasks)):
        if ends[i] is None and (tasks[i][0].retime or workers <= 1):
            ends[i] = _end_claims(i)
    _STATE = None
    out: list[Row] = []
    for k in range(0, len(tasks), 2):
        c, lo = tasks[k]
        hi = tasks[k + 1][1]
        a_end, b_end = ends[k], ends[k + 1]
        how = "re-timed" if c.retime else ("re-simulated" if a_end is not None else "not varied")
        for claim, nom in nominal.items():
            a = a_end.get(claim, math.nan) if a_end is not None else math.nan
            b = b_end.get(claim, math.nan) if b_end is not None else math.nan
            out.append({"claim": claim, "constant": c.name, "unit": c.unit, "low": lo * c.scale,
                        "high": hi * c.scale, "nominal": nom, "at_low": a, "at_high": b,
                        "swing": abs(b - a) if not (math.isnan(a) or math.isnan(b)) else math.nan, "how": how})
    return out


_STATE: tuple | None = None


def _end_claims(i: int) -> dict[str, float] | None:
    """The claims with task ``i``'s constant at its value (module state: forked workers inherit it)."""
    assert _STATE is not None
    base, setup, claims, gpus, rerun, tasks = _STATE
    c, value = tasks[i]
    changed = setup.with_value(c, value)
    if value == setup.current(c):  # a range end at the nominal value: the nominal runs are that end
        results: dict[Key, SimResult] | None = base
    elif c.retime:
        results = retime_all(base, changed, c, value)
    else:
        results = rerun(c, changed) if rerun is not None else None
    return None if results is None else claims(rows_of(results, gpus))


def joint_time_ranges(base: dict[Key, SimResult], setup: Setup, claims: ClaimsFn, gpus: int,
                      one_at_a_time: Sequence[Row], constants: Sequence[Constant] = CONSTANTS) -> list[Row]:
    """Per claim: its value with *every* time-only constant at once at the end that lowered it one at a time
    (``joint_low``) and at the end that raised it (``joint_high``), by re-timing (exact, cheap). The direction of
    each constant is taken from the one-at-a-time rows (``sensitivity``), i.e. the claim is assumed monotonic in
    each constant over its range; constants that did not move a claim stay nominal for it."""
    timed = [c for c in constants if c.retime]
    ends = {c.name: c.range_around(setup.current(c)) for c in timed}
    nominal = claims(rows_of(base, gpus))
    by_claim: dict[str, dict[str, Row]] = {}
    for r in one_at_a_time:
        by_claim.setdefault(str(r["claim"]), {})[str(r["constant"])] = r
    cache: dict[tuple, dict[str, float]] = {}
    out: list[Row] = []
    for claim, nom in nominal.items():
        got = {}
        for side in ("low", "high"):
            pick = []
            for c in timed:
                r = by_claim.get(claim, {}).get(c.name)
                if r is None or math.isnan(float(r["swing"])) or float(r["at_low"]) == float(r["at_high"]):
                    continue
                low_end_lower = float(r["at_low"]) < float(r["at_high"])
                pick.append((c, ends[c.name][0 if low_end_lower == (side == "low") else 1]))
            key = tuple((c.name, v) for c, v in pick)
            if key not in cache:
                cache[key] = claims(rows_of(_retime_joint(base, setup, pick), gpus))
            got[side] = cache[key].get(claim, math.nan)
        out.append({"claim": claim, "nominal": nom, "joint_low": got["low"], "joint_high": got["high"],
                    "constants": "every time-only constant at its end (direction from the one-at-a-time bars)"})
    return out


def _retime_joint(base: dict[Key, SimResult], setup: Setup, pick: Sequence[tuple[Constant, float]]
                  ) -> dict[Key, SimResult]:
    changed = setup
    for c, v in pick:
        changed = changed.with_value(c, v)
    out: dict[Key, SimResult] = {}
    for key, res in base.items():
        drafter = res.drafter
        for c, v in pick:
            if c.target == "drafter" and drafter is not None:
                drafter = dataclasses.replace(drafter, **{c.field: v})
        out[key] = retime(res, changed.hw, changed.model, drafter)
    return out


def claim_ranges(rows: Sequence[Row]) -> dict[str, tuple[float, float, float]]:
    """Per claim: (nominal, lowest, highest) value over every constant's two ends."""
    out: dict[str, tuple[float, float, float]] = {}
    for r in rows:
        claim = str(r["claim"])
        vals = [float(r["nominal"])] + [float(r[k]) for k in ("at_low", "at_high") if not math.isnan(float(r[k]))]
        nom, lo, hi = out.get(claim, (float(r["nominal"]), math.inf, -math.inf))
        out[claim] = (nom, min(lo, *vals), max(hi, *vals))
    return out


def plot_sensitivity(rows: Sequence[Row], path: Path, claims: Sequence[str] | None = None) -> Path:
    """A tornado chart per claim: one bar per constant from its low-end to its high-end value of the claim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(str(r["claim"]) for r in rows)) if claims is None else list(claims)
    cols = 1 if len(names) < 3 else 2
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, (0.22 * len(CONSTANTS) + 0.9) * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, claim in zip(axes.flat, names, strict=False):
        sel = [r for r in rows if r["claim"] == claim and not math.isnan(float(r["swing"]))]
        sel.sort(key=lambda r: float(r["swing"]))
        nominal = float(sel[0]["nominal"]) if sel else math.nan
        for i, r in enumerate(sel):
            a, b = float(r["at_low"]), float(r["at_high"])
            ax.barh(i, b - nominal, left=nominal, color="tab:blue", alpha=0.8)
            ax.barh(i, a - nominal, left=nominal, color="tab:orange", alpha=0.8)
        ax.set_yticks(range(len(sel)))
        ax.set_yticklabels([f"{r['constant']} [{float(r['low']):.3g}–{float(r['high']):.3g}{r['unit']}]"
                            for r in sel], fontsize=6)
        ax.axvline(nominal, color="k", lw=0.8)
        if claim.endswith("×") or "/" in claim:
            ax.axvline(1.0, color="grey", lw=0.6, ls=":")
        ax.set_title(f"{claim}\nnominal {nominal:.3g}; orange: constant at its low end, blue: at its high end",
                     fontsize=7)
        ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def ratio_claims(pairs: Sequence[tuple[str, str]], concurrencies: Sequence[int]) -> ClaimsFn:
    """Claims for ``dhisparse-plan --sensitivity``: per pair ``(a, b)`` and concurrency, ``a / b`` output per GPU
    and ``b / a`` mean TTFT (above 1: ``a`` is better)."""
    def claims(rows: list[Row]) -> dict[str, float]:
        idx = {(str(r["label"]), int(float(r["concurrency"]))): r for r in rows}
        out: dict[str, float] = {}
        for a, b in pairs:
            for c in concurrencies:
                ra, rb = idx.get((a, c)), idx.get((b, c))
                if ra is None or rb is None:
                    continue
                out[f"{a} / {b} output C{c}"] = _div(ra["output_tok_per_s_per_gpu"], rb["output_tok_per_s_per_gpu"])
                out[f"{b} / {a} mean TTFT C{c}"] = _div(rb["mean_ttft_s"], ra["mean_ttft_s"])
        return out

    return claims


def _div(a: float | str, b: float | str) -> float:
    a, b = float(a), float(b)
    return a / b if b > 0 and not math.isnan(a) else math.nan
