"""Verdicts (claims.verdict): within 15% of the paper's figure, bracketed by the range, or not reproduced; a claimed
gain ("up to 4×") needs a gain."""

from __future__ import annotations

import math

from dhisparse_planner.claims import BY_NAME, PaperClaim, verdict

NAN = math.nan
CONCURRENCY = BY_NAME["best adaptive(+dflash2) / best hisparse concurrency, 100K, TPOT ≤ 50 ms"]


def test_a_figure_within_15_percent_is_reproduced_and_a_range_around_it_brackets_it() -> None:
    claim = PaperClaim("x", "1.45×", 1.45, 1.45)
    assert verdict(claim, 1.27, NAN, NAN)[0] == "reproduced"
    assert verdict(claim, 1.2, 1.1, 1.5)[0] == "bracketed"
    judged, reason = verdict(claim, 1.1, 1.05, 1.2)
    assert judged == "not reproduced" and "below" in reason


def test_no_gain_never_reproduces_a_claimed_gain() -> None:
    assert CONCURRENCY.needs_gain and (CONCURRENCY.low, CONCURRENCY.high) == (1.0, 4.0)
    judged, reason = verdict(CONCURRENCY, 1.0, 0.5, 1.0)
    assert judged == "not reproduced" and reason.startswith("no gain")
    assert verdict(CONCURRENCY, 0.9, NAN, NAN)[0] == "not reproduced"  # within 15% of 1, still no gain
    assert verdict(CONCURRENCY, 2.0, 1.0, 4.0)[0] == "reproduced"
    assert verdict(CONCURRENCY, 4.5, NAN, NAN)[0] == "reproduced"  # 4x + 15%
    judged, reason = verdict(CONCURRENCY, 1.0, 0.5, 2.0)
    assert judged == "bracketed" and "no gain" in reason
    assert verdict(CONCURRENCY, 8.0, 6.0, 8.0)[0] == "not reproduced"
