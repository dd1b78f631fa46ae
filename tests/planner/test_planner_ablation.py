"""scripts/planner_ablation.py: its points are reproduce_paper.py's, every fix has a way back (or says why not),
re-timing with keys read per query only slows speculative steps, and its report has the table it promises."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import sys
from pathlib import Path

import pytest

from dhisparse_planner import paper
from dhisparse_planner.locality import CALIBRATED
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import ServingSpec, WorkloadSpec

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "planner_ablation.py"


def _script():
    spec = importlib.util.spec_from_file_location("planner_ablation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["planner_ablation"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ABL = _script()


def test_the_points_are_reproduce_papers_and_every_fix_can_be_reverted() -> None:
    sweeps = ABL.headline_sweeps()
    plan = paper.reproduction_sweeps(CALIBRATED, (CALIBRATED, CALIBRATED))
    ours = {j.key for s in sweeps.values() for j in s.jobs()}
    theirs = {j.key for name in ("32K", "100K", "32K DP8", "100K DP8") for j in plan[name].jobs()}
    assert ours <= theirs and len(ours) == 3 * 3 + 3 + 3 * 3 + 3  # the same runs reproduce_paper.py simulates
    fixes = ABL.fixes()
    assert sorted({f.point for f in fixes}) == list(range(1, 9))
    for f in fixes:
        assert (f.revert is None) != (f.derive is None) or f.point == 7
        if f.revert is not None:
            reverted = f.revert(sweeps)
            assert reverted and all(s != sweeps[k] for k, s in reverted.items())  # a switch that changes the runs


def test_keys_read_per_query_slows_only_speculative_steps() -> None:
    spec = SpeculationModel(drafter="dflash2", gamma=3)
    for s, slower in ((None, False), (spec, True)):
        serving = ServingSpec(policy="adaptive", hot_rows=4096, speculation=s)
        res = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, WorkloadSpec(8192, 512, concurrency=2, num_requests=4),
                       ScaleSpec(64))
        before, after = res.summary(), ABL.keys_read_per_query(res).summary()
        if slower:
            assert after["output_tok_per_s"] < before["output_tok_per_s"]
            assert after["host_share"] == before["host_share"]  # the same decisions
        else:
            assert after["output_tok_per_s"] == pytest.approx(before["output_tok_per_s"])


def test_the_report_has_the_table_the_movers_and_the_run_time(tmp_path: Path) -> None:
    rows = [{"point": 4, "fix": "sourced acceptance", "without": "old", "switch": "s", "claim": name,
             "paper": "x", "with the fix": 2.0, "without the fix": 1.5, "delta": 0.5} for name, _ in ABL.CLAIMS[:2]]
    waits = [{"model": "current", "label": "hisparse", "concurrency": 8, "admissions_waited": 0}]
    ABL.write(tmp_path, rows, waits, datetime.datetime(2026, 12, 2, 6, 0, tzinfo=datetime.timezone.utc), 123.0,
              200.0, 300.0, 64)
    text = (tmp_path / "ablation.md").read_text()
    assert "planner_ablation.py" in text and "**123 s wall**" in text and "2026-12-02 06:00 UTC" in text
    assert "| sourced acceptance (4) | old |" in text and "+0.5" in text and "Not switched" in text
    assert "sourced acceptance (4): +0.5" in text  # the mover table
    lines = (tmp_path / "ablation.csv").read_text().splitlines()
    assert lines[0].split(",")[:2] == ["point", "fix"] and len(lines) == 3
    assert dataclasses.is_dataclass(ABL.Fix)
