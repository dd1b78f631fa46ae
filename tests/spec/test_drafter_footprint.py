"""The planner's drafter shapes come from the published drafters' own configs (issue 30): its DFlash2 and DSpark
entries are ``drafter_footprint()`` of the transcribed ``config.json`` of incoai/GLM-5.3-DFlash2 and
deepseek-ai/DeepSeek-V4-Flash-DSpark, those configs pass the runtime's own parsers, the ring is what the config's
fields imply by hand, and the committed ``speculative_state.csv`` is what the planner computes from them now."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dhisparse.errors import ConfigError
from dhisparse.spec.published import (
    REFERENCE_CONFIGS,
    detect_format,
    drafter_footprint,
    reference_config,
    v4_fp8_row_bytes,
)
from dhisparse.spec.published.qwen_config import parse_qwen_drafter
from dhisparse_planner import deepseek_v4, drafter_shapes
from dhisparse_planner.footprint_cli import session_footprint
from dhisparse_planner.specs import DRAFTERS, GLM5
from dhisparse_planner.speculation import ACCEPTANCE

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_the_planners_drafter_bytes_are_drafter_footprint_of_the_published_configs():
    glm = drafter_footprint(reference_config("glm-5.3-dflash2"), max_context=1 << 20, bytes_per_value=2)
    v4 = drafter_footprint(reference_config("deepseek-v4-flash-dspark"), max_context=1 << 20, v4_fp8_rows=True)
    assert DRAFTERS["dflash2"].ring_bytes == glm.ring_bytes
    assert DRAFTERS["dspark"].ring_bytes == v4.ring_bytes
    # the block sizes the staging: the planner verifies the drafters' own blocks
    assert DRAFTERS["dflash2"].max_draft_tokens == glm.max_gamma == ACCEPTANCE["dflash2"].gamma == 7
    assert DRAFTERS["dspark"].max_draft_tokens == v4.max_gamma == ACCEPTANCE["dspark"].gamma == 5
    # the footprint the KV manager admits a GLM-5 session with carries exactly that ring
    session = session_footprint(GLM5, 32768, 8192, "adaptive", 0, 64, "dflash2", glm.max_gamma)
    assert session["ring_bytes"] == glm.ring_bytes
    assert session["speculative_bytes"] == glm.ring_bytes + session["staging_bytes"]


def test_the_rings_are_what_the_config_fields_imply():
    cfg = reference_config("glm-5.3-dflash2")
    # six sliding layers: the block's first query (the last token) sees the 2,047 positions before it
    rows = cfg["sliding_window"] - 1
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # bf16 K and V
    assert DRAFTERS["dflash2"].ring_bytes == cfg["num_hidden_layers"] * rows * per_layer == 50_307_072
    v4 = reference_config("deepseek-v4-flash-dspark")
    stages = len(v4["compress_ratios"]) - v4["num_hidden_layers"]
    assert stages == 3 and v4["num_nextn_predict_layers"] == 1  # the config's counter understates the stages
    assert DRAFTERS["dspark"].ring_bytes == stages * v4["sliding_window"] * 584 == 224_256
    # in this runtime's ring (model dtype, no FP8 round trip) the same window is 3 x 128 x 512 x 2 B
    bf16 = drafter_footprint(v4, max_context=1 << 20, bytes_per_value=2)
    assert bf16.ring_bytes == stages * v4["sliding_window"] * v4["head_dim"] * 2 == 393_216


def test_the_fp8_v4_row_is_the_one_the_v4_target_preset_prices():
    assert v4_fp8_row_bytes(512, 64) == deepseek_v4.FP8_ROW_BYTES == 584
    assert v4_fp8_row_bytes(128, 0) == 128 + 8  # two scales, padded to 8 bytes
    with pytest.raises(ConfigError, match="multiple of 64"):
        v4_fp8_row_bytes(100, 4)
    with pytest.raises(ConfigError, match="DeepSeek-V4 DSpark stages"):
        drafter_footprint(reference_config("glm-5.3-dflash2"), max_context=4096, v4_fp8_rows=True)


def test_the_reference_configs_pass_the_runtimes_parsers():
    glm = reference_config("glm-5.3-dflash2")
    assert detect_format(glm, "glm") == "dflash2"
    parsed = parse_qwen_drafter(glm, "dflash2", "glm")
    assert parsed.layer_windows == (2048,) * 6 and parsed.layer_causal == (False,) * 6
    assert (parsed.num_kv_heads, parsed.head_dim, parsed.block_size, parsed.context_window) == (8, 128, 8, 2047)
    assert detect_format(reference_config("deepseek-v4-flash-dspark"), "v4") == "dspark-v4"
    assert all(c.sources and c.checkpoint for c in REFERENCE_CONFIGS.values())
    with pytest.raises(KeyError, match="known"):
        reference_config("glm-5.3-flash-dflash2")


def test_the_committed_speculative_state_is_what_the_planner_computes():
    with (RESULTS / "speculative_state.csv").open() as f:
        committed = list(csv.DictReader(f))
    computed = drafter_shapes.speculative_state_rows()
    assert [r["drafter shape"] for r in committed] == [str(r["drafter shape"]) for r in computed]
    for got, want in zip(committed, computed, strict=True):
        for key in ("ring_gib", "staging_gib", "speculative_gib", "vs_paper"):
            assert float(got[key]) == pytest.approx(float(want[key]), abs=1e-9), (got["model"], key)
    # the shape the CSV prices first is the planner's drafter
    assert drafter_shapes.CANDIDATES[0].ring_bytes == DRAFTERS["dflash2"].ring_bytes
