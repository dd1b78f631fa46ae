"""``--measured FILE``: GPU-check figures in place of modelled ones. No GPU check with ``glm5_stack`` exists yet
(issue 25); these tests use a fixture of that shape (tests/planner/data/gpu_check_glm5_stack.json), and the committed
check (docs/results/gpu_check/gpu_check.json) for its measured host-gather rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhisparse_planner import paper
from dhisparse_planner.measured import (
    load_measured,
    measured_claims,
    measured_step_s,
    newest_gpu_check,
    tokens_per_step,
    with_measured_link,
)
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200

FIXTURE = Path(__file__).parent / "data" / "gpu_check_glm5_stack.json"
M = GLM5_INDEXSHARE_NVFP4


def test_the_fixture_is_read_and_replaces_the_link_and_the_layer_steps() -> None:
    got = load_measured(FIXTURE, M.row_bytes)
    assert got.commit == "fixture-0000000" and got.gather_bytes_per_s == 30e9 and len(got.stack) == 7
    assert with_measured_link(H200, got).host_link_bytes_per_s == 30e9
    p = got.point("adaptive+dflash2", 128, 102400)
    assert p is not None and p.layer_step_ms == 1.8
    step = measured_step_s(H200, M, p)
    assert step > M.num_layers * 1.8e-3 + H200.step_overhead_s  # plus the MoE / dense weights read
    claims = measured_claims(got, H200, M, paper.SPEC)
    name = "adaptive+dflash2 / hisparse output, 100K C128 (measured per-layer step)"
    h = got.point("hisparse", 128, 102400)
    expected = (tokens_per_step("adaptive+dflash2", 102400, paper.SPEC) / step) / (1.0 / measured_step_s(H200, M, h))
    assert claims[name] == pytest.approx(expected)
    assert "adaptive / hisparse output, 32K C32 (measured per-layer step)" in claims
    assert not any("resident+dflash2" in k for k in claims)  # no resident+dflash2 point in the fixture


def test_nested_records_and_clear_errors(tmp_path: Path) -> None:
    nested = {"commit": "c", "glm5_stack": {"adaptive+dflash2": {"32": {"32768": {"layer_step_ms": 0.4}}}}}
    path = tmp_path / "nested.json"
    path.write_text(json.dumps(nested))
    got = load_measured(path, M.row_bytes)
    assert got.stack[0].label == "adaptive+dflash2" and got.stack[0].batch == 32 and got.gather_bytes_per_s is None
    path.write_text(json.dumps({"commit": "c"}))
    with pytest.raises(ValueError, match="glm5_stack"):
        load_measured(path, M.row_bytes)
    path.write_text(json.dumps({"commit": "c", "glm5_stack": [{"policy": "hisparse", "batch": 8, "history": 1}]}))
    with pytest.raises(ValueError, match="layer_step_ms"):
        load_measured(path, M.row_bytes)


def test_the_newest_check_with_a_stack_is_found(tmp_path: Path) -> None:
    (tmp_path / "2026-01-01.json").write_text(json.dumps({"commit": "a"}))
    assert newest_gpu_check(tmp_path) is None
    (tmp_path / "2026-02-01.json").write_text(FIXTURE.read_text())
    assert newest_gpu_check(tmp_path) == tmp_path / "2026-02-01.json"


COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results" / "gpu_check"


def test_the_committed_gpu_check_gives_its_mapped_host_gather_rate_without_a_stack() -> None:
    """docs/results/gpu_check/gpu_check.json (an H200, no glm5_stack: skipped for time) measured the gather of
    656-byte rows from the mapped host store: 24.1 GB/s at 6,400 rows, its largest row count, is the link."""
    got = load_measured(COMMITTED / "gpu_check.json", M.row_bytes)
    assert got.stack == () and got.commit == "not recorded"
    assert got.gather_bytes_per_s == pytest.approx(24.12e9, rel=1e-3)
    assert got.gather_note == "mapped_host.mapped_gather_656B at 6,400 rows"
    assert with_measured_link(H200, got).host_link_bytes_per_s == got.gather_bytes_per_s
    assert measured_claims(got, H200, M, paper.SPEC) == {}  # no stack: no measured step ratios
    assert newest_gpu_check(COMMITTED, M.row_bytes) == COMMITTED / "gpu_check.json"
    assert newest_gpu_check(COMMITTED) is None  # a stack is asked for


def test_gather_gbps_wins_over_the_mapped_gather_and_bad_records_are_named(tmp_path: Path) -> None:
    mapped = {"mapped_gather_656B": [{"rows": 100, "gb_s": 0.5}, {"rows": 6400, "gb_s": 24.0}]}
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"gather_gbps": {"656": {"8": 5.0, "128": 30.0}}, "mapped_host": mapped}))
    assert load_measured(path, M.row_bytes).gather_bytes_per_s == 30e9
    path.write_text(json.dumps({"mapped_host": {"mapped_gather_656B": [{"rows": 10}]}}))
    with pytest.raises(ValueError, match="mapped_gather_656B record 0"):
        load_measured(path, M.row_bytes)
    path.write_text(json.dumps({"mapped_host": mapped}))
    with pytest.raises(ValueError, match="no glm5_stack and no gather rate for 576-byte rows"):
        load_measured(path, 576)
