"""``dhisparse-plan --sensitivity``: one row per claim and constant, the same report on every run, the plot."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dhisparse_planner.cli import main
from dhisparse_planner.constants import CONSTANTS

ARGS = ["--input-tokens", "4096", "--output-tokens", "256", "--configs", "adaptive", "hisparse", "--concurrency", "2",
        "--overlap", "0.7", "0.9", "--sensitivity"]


def test_sensitivity_report_is_deterministic_with_one_bar_per_constant(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert main([*ARGS, "--out", str(tmp_path / "a")]) == 0
    assert main([*ARGS, "--sensitivity-time-only", "--no-plots", "--out", str(tmp_path / "b")]) == 0
    full = list(csv.DictReader((tmp_path / "a" / "sensitivity.csv").open()))
    timed = list(csv.DictReader((tmp_path / "b" / "sensitivity.csv").open()))
    assert {r["constant"] for r in full} == {c.name for c in CONSTANTS}
    assert {r["constant"] for r in timed} == {c.name for c in CONSTANTS if c.retime}
    assert {r["claim"] for r in full} == {"adaptive / hisparse output C2", "hisparse / adaptive mean TTFT C2"}
    # the time-only report is the same rows as the full one's time-only part: runs are seeded, re-timing is exact
    assert timed == [r for r in full if r["constant"] in {c.name for c in CONSTANTS if c.retime}]
    overlap = next(r for r in full if r["constant"] == "locality overlap" and "output" in r["claim"])
    assert (float(overlap["low"]), float(overlap["high"])) == (0.7, 0.9)  # the grid's own overlaps
    assert (tmp_path / "a" / "sensitivity.png").stat().st_size > 1000
    assert main(["--configs", "adaptive", "--sensitivity", "--out", str(tmp_path / "c"), "--no-plots"]) == 2
