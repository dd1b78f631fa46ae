"""`dhisparse-bench --workload multi-turn` at tiny scale: two real dhisparse-serve processes (prefix reuse on and off),
conversations through Triton's `dhisparse` model with tensorrtllm_backend's perf outputs. Later turns find the
earlier turns' pages cached (`kv_cache_reused_blocks`), prefill only the rest, answer exactly as without reuse, and
both servers' /metrics agree with what the responses said.

Behind DHISPARSE_SLOW=1 (two servers, ~35-65 s): the tool's own run. Reuse through Triton with its perf outputs and
exact replies is shown in the default suite by tests/serving/test_openai.py's multi-turn chat (cached_tokens come from
the same kv_cache_reused_block(s) outputs)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not os.environ.get("DHISPARSE_SLOW"), reason="two servers, ~35-65 s; DHISPARSE_SLOW=1")
def test_multi_turn_workload_reuses_earlier_turns_through_triton(tiny_engine, tmp_path) -> None:
    out = tmp_path / "multiturn"
    cmd = [sys.executable, "-m", "dhisparse_client.bench", "--engine", str(tiny_engine), "--workload", "multi-turn",
           "--sessions", "2", "--turns", "3", "--turn-tokens", "40", "--max-tokens", "6",
           "--engine-option", "page_rows=16", "--output-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # includes: replies equal with and without reuse
    result = json.loads((out / "multiturn.json").read_text())
    turns = result["summary"]
    assert turns[0]["reused_tokens_reuse"] == 0
    for later in turns[1:]:  # every complete page of the previous turn's history (prompt and reply) is reused
        assert later["reused_tokens_reuse"] >= later["prompt_tokens"] - 40 - 6 - 16
        assert later["prefill_tokens_reuse"] < later["prefill_tokens_no_reuse"] == later["prompt_tokens"]
        assert later["reused_tokens_no_reuse"] == 0
    reuse, plain = result["metrics"]["reuse"], result["metrics"]["no_reuse"]
    assert reuse["kv_prefix_reuse_enabled"] == 1 and plain["kv_prefix_reuse_enabled"] == 0
    assert plain["kv_prefix_reused_tokens"] == 0 and plain["kv_prefix_lookup_tokens"] == 0
    with open(out / "multiturn.csv") as f:
        reused = sum(int(row["reused_tokens_reuse"]) for row in csv.DictReader(f))  # from the perf outputs
    assert reuse["kv_prefix_reused_tokens"] == reused > 0
    assert reuse["prefill_tokens_reused"] == reused
    assert (out / "multiturn.png").stat().st_size > 10_000
