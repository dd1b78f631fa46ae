"""The ``dhisparse-plan`` CLI at tiny scale: table, CSV, PNGs and a recommendation; bad input exits 2."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dhisparse_planner.cli import main
from dhisparse_planner.report import recommend


def test_cli_writes_table_plots_and_recommendation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    rc = main(["--input-tokens", "4096", "--output-tokens", "256", "--configs", "resident", "hisparse",
               "adaptive+dspark", "--concurrency", "2", "3", "--overlap", "0.6", "0.9", "--out", str(tmp_path)])
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "plan.csv").open()))
    assert len(rows) == 3 * 2 * 2
    assert {r["label"] for r in rows} == {"resident", "hisparse", "adaptive+dspark"}
    assert all(int(r["requests_done"]) == int(r["concurrency"]) for r in rows)
    assert all(float(r["host_share"]) == 0.0 for r in rows if r["label"] == "resident")
    his = {r["overlap"]: float(r["host_share"]) for r in rows if r["label"] == "hisparse" and r["concurrency"] == "3"}
    assert his["0.6"] > his["0.9"] > 0.0  # less locality, more host fetches
    for name in ("output_tok_per_s_per_gpu", "mean_ttft_s", "mean_tpot_s", "host_share", "memory_split"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "Recommended under mean TPOT <= 50 ms" in out
    assert "Recommended" in (tmp_path / "plan.md").read_text()


def test_cli_rejects_bad_config(tmp_path: Path) -> None:
    assert main(["--configs", "speculative", "--out", str(tmp_path), "--no-plots"]) == 2
    assert main(["--configs", "adaptive+eagle", "--out", str(tmp_path), "--no-plots"]) == 2


def test_recommend_uses_worst_overlap_and_the_bound() -> None:
    def row(label: str, c: int, ov: float, tok: float, tpot: float) -> dict[str, float | str]:
        return {"label": label, "concurrency": c, "overlap": ov, "output_tok_per_s_per_gpu": tok,
                "mean_tpot_s": tpot, "host_share": 0.0, "requests_done": 1.0}

    rows = [row("a", 8, 0.6, 100, 0.02), row("a", 8, 0.9, 300, 0.01),  # worst: 100 tok/s
            row("b", 8, 0.6, 150, 0.03), row("b", 8, 0.9, 160, 0.03),  # worst: 150
            row("b", 16, 0.6, 400, 0.06), row("b", 16, 0.9, 500, 0.04)]  # worst TPOT 60 ms: over a 50 ms bound
    best = recommend(rows, 0.05)
    assert best is not None and (best["label"], best["concurrency"], best["output_tok_per_s_per_gpu"]) == ("b", 8, 150)
    assert recommend(rows, 0.005) is None


def test_cli_measured_retimes_with_the_measured_link_and_adds_measured_ratios(tmp_path: Path) -> None:
    """``--measured`` with a fixture in the shape of issue 25's GPU check (no real one exists yet)."""
    fixture = Path(__file__).parent / "data" / "gpu_check_glm5_stack.json"
    rc = main(["--input-tokens", "4096", "--output-tokens", "256", "--configs", "hisparse", "adaptive",
               "--concurrency", "2", "--overlap", "0.8", "--out", str(tmp_path), "--no-plots",
               "--measured", str(fixture)])
    assert rc == 0
    modelled = {r["label"]: r for r in csv.DictReader((tmp_path / "plan.csv").open())}
    measured = {r["label"]: r for r in csv.DictReader((tmp_path / "plan_measured.csv").open())}
    assert set(measured) == {"hisparse", "adaptive"}
    # the fixture's 30 GB/s gather is faster than the modelled 25 GB/s: hisparse, which fetches, gains
    key = "output_tok_per_s_per_gpu"
    assert float(measured["hisparse"][key]) >= float(modelled["hisparse"][key])
    text = (tmp_path / "plan_measured.md").read_text()
    assert "fixture-0000000" in text and "adaptive / hisparse output, 32K C32 (measured per-layer step)" in text
    assert main(["--out", str(tmp_path), "--no-plots", "--concurrency", "2", "--input-tokens", "4096",
                 "--output-tokens", "256", "--measured", str(tmp_path / "missing.json")]) == 2
