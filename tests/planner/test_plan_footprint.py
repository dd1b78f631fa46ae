"""``dhisparse-plan footprint``: per-session required / optional / speculative bytes, from the admission code."""

from __future__ import annotations

import json

import pytest

from dhisparse_planner.cli import main
from dhisparse_planner.footprint_cli import session_footprint
from dhisparse_planner.report import parse_config
from dhisparse_planner.specs import DRAFTERS, GLM5, GLM5_INDEXSHARE_NVFP4
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import ServingSpec


def test_cli_json_splits_required_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["footprint", "--model", "glm5", "--context", "32768", "--speculative", "dflash2",
                 "--num-draft-tokens", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hot_rows"] == GLM5.index_topk  # B does not grow with gamma
    assert out["required_bytes"] == out["non_speculative_bytes"] + out["speculative_bytes"]
    assert out["speculative_bytes"] == out["ring_bytes"] + out["staging_bytes"]
    assert out["ring_bytes"] == DRAFTERS["dflash2"].ring_bytes
    # GLM-5 has one indexer per layer: one staging slot of (gamma + 1) * index_topk - B rows
    assert out["staging_slots"] == 1 and out["staging_rows_per_slot"] == 8 * 2048 - 2048
    assert out["staging_overflow_bytes"] == -(-14336 // 64) * 64 * GLM5.row_bytes
    assert main(["footprint", "--model", "glm5", "--context", "32768"]) == 0
    assert "required_bytes" in capsys.readouterr().out


@pytest.mark.parametrize("model", [GLM5, GLM5_INDEXSHARE_NVFP4])
@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_speculation_adds_exactly_ring_plus_staging(model, gamma) -> None:
    plain = session_footprint(model, 32768, 8192, "adaptive", 4096, 64, None, gamma)
    spec = session_footprint(model, 32768, 8192, "adaptive", 4096, 64, "dflash2", gamma)
    assert plain["speculative_bytes"] == 0 and plain["hot_rows"] == spec["hot_rows"] == 4096
    assert spec["required_bytes"] == plain["required_bytes"] + spec["ring_bytes"] + spec["staging_bytes"]
    assert spec["staging_slots"] == (0 if (gamma + 1) * 2048 <= 4096 else model.index_group_size)
    assert spec["optional_bytes"] == plain["optional_bytes"] > 0


def test_a_drafter_no_longer_enlarges_the_hot_cache() -> None:
    base = ServingSpec(hot_rows=4096)
    spec = parse_config("adaptive+dflash2", base, SpeculationModel(gamma=7))
    assert spec.hot_rows == 4096 and spec.hot_rows_for(2048) == 4096
    assert ServingSpec().hot_rows_for(2048) == 2048  # default B = index_topk
