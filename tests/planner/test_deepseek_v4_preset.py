"""The DeepSeek-V4-Flash preset and its footprint (the numbers docs/results/deepseek_v4_500k.md reports)."""

from __future__ import annotations

from dhisparse_planner.deepseek_v4 import DSV4_FLASH, FP8_ROW_BYTES, request_split


def test_preset_schedule_matches_the_model_card():
    DSV4_FLASH.validate()
    kinds = DSV4_FLASH.layer_types
    assert kinds[:2] == ("sliding_attention",) * 2
    assert len(DSV4_FLASH.csa_layers) == 21 and len(DSV4_FLASH.hca_layers) == 20


def test_footprint_split_is_consistent():
    prompt, out = 500_000, 2048
    res = request_split(DSV4_FLASH, "resident", prompt, out)
    his = request_split(DSV4_FLASH, "hisparse", prompt, out)
    ada = request_split(DSV4_FLASH, "adaptive", prompt, out)
    entries = 21 * (prompt // 4 + 1) * FP8_ROW_BYTES
    assert res["csa_pages_bytes"] >= entries  # resident holds every selectable row
    assert his["csa_pages_bytes"] < entries / 20  # host-backed: hot cache + tail pages only
    assert his["required_bytes"] == ada["required_bytes"] and his["tail_bytes"] == res["tail_bytes"]
    assert 0.99 * entries <= ada["optional_bytes"] <= entries  # the prompt's complete entry pages
