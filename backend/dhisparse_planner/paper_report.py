"""The paper's claims as the reproduction reports them: one table row per claim with the paper's figure, the
planner's nominal value, its range over the constants, a verdict (:func:`dhisparse_planner.claims.verdict`) with its
reason, and whether the row rests on measured GPU figures (:mod:`dhisparse_planner.measured`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from dhisparse_planner.claims import PaperClaim, claim_of, verdict
from dhisparse_planner.sensitivity import claim_ranges

Row = dict[str, float | str]
COLUMNS = ("claim", "paper", "planner nominal", "planner range", "time-only constants jointly", "verdict", "reason",
           "basis")


def _fmt(v: float) -> str:
    return "∞" if math.isinf(v) else ("n/a" if math.isnan(v) else f"{v:.3g}")


def claim_rows(nominal: dict[str, float], sens: list[Row], joint: list[Row], basis: str = "modelled") -> list[Row]:
    """One row per claim of ``nominal`` (names from :mod:`dhisparse_planner.claims`, readings included): its range
    over every constant's ends (``sens``, one at a time) and every time-only constant at once (``joint``)."""
    ranges = claim_ranges(sens) if sens else {}
    together = {str(r["claim"]): (float(r["joint_low"]), float(r["joint_high"])) for r in joint}
    out: list[Row] = []
    for name, value in nominal.items():
        claim = claim_of(name)
        if claim is None:
            continue
        _, lo, hi = ranges.get(name, (value, math.nan, math.nan))
        movers = sorted((r for r in sens if r["claim"] == name and r["swing"] == r["swing"]),
                        key=lambda r: -float(r["swing"]))

        def mover(movers: list[Row] = movers) -> str:
            return "; ".join(f"{r['constant']} ({_fmt(float(r['at_low']))} at its low end, "
                             f"{_fmt(float(r['at_high']))} at its high end)" for r in movers[:2])

        judged, reason = verdict(claim, value, lo, hi, mover)
        jlo, jhi = together.get(name, (math.nan, math.nan))
        out.append({"claim": name, "paper": claim.paper, "planner nominal": _fmt(value),
                    "planner range": f"{_fmt(lo)}–{_fmt(hi)}" if not math.isnan(lo) else "not varied",
                    "time-only constants jointly": f"{_fmt(jlo)}–{_fmt(jhi)}" if not math.isnan(jlo) else "not varied",
                    "verdict": judged, "reason": reason, "basis": basis})
    return out


def single_rows(items: Iterable[tuple[PaperClaim, float, float, float, str]]) -> list[Row]:
    """Rows for claims computed outside the grid (load step, speculative state, 500K): ``(claim, nominal, low,
    high, note)`` each; the note is appended to the verdict's reason."""
    out: list[Row] = []
    for claim, value, lo, hi, note in items:
        judged, reason = verdict(claim, value, lo, hi)
        out.append({"claim": claim.name, "paper": claim.paper, "planner nominal": _fmt(value),
                    "planner range": f"{_fmt(lo)}–{_fmt(hi)}" if not math.isnan(lo) else "not varied",
                    "time-only constants jointly": "not varied", "verdict": judged,
                    "reason": reason + (f"; {note}" if note else ""), "basis": "modelled"})
    return out


def measured_rows(measured: dict[str, float], source: str) -> list[Row]:
    """Rows resting on measured per-layer GPU steps (no verdict against a range: one value each)."""
    out: list[Row] = []
    for name, value in measured.items():
        base = name.replace(" (measured per-layer step)", "").replace("32K", "32K").strip()
        claim = claim_of(base)
        judged, reason = (verdict(claim, value, math.nan, math.nan) if claim is not None
                          else ("(no paper figure)", ""))
        out.append({"claim": name, "paper": claim.paper if claim else "–", "planner nominal": _fmt(value),
                    "planner range": "measured", "time-only constants jointly": "measured", "verdict": judged,
                    "reason": reason, "basis": f"measured ({source})"})
    return out
