"""Bench result arithmetic: medians over repeats, ratios to the baseline, the table (no server)."""

from __future__ import annotations

import math

from dhisparse_client.bench_report import BenchRow, add_ratios, combine_repeats, format_table
from dhisparse_client.perf import LevelResult


def _result(concurrency: int, tokens_per_s: float, ttft_ms: float) -> LevelResult:
    return LevelResult(concurrency, tokens_per_s / 10, tokens_per_s, 100.0, ttft_ms, ttft_ms * 2, 5.0, 8, 10.0,
                       10.0, 1.0, 1.0, 1.0)


def test_repeats_combine_to_medians_and_total_requests():
    rows = [BenchRow("adaptive", _result(4, t, f), host_share=h) for t, f, h in
            ((10.0, 300.0, 0.1), (30.0, 100.0, math.nan), (20.0, 200.0, 0.3))]
    combined = combine_repeats(rows)
    assert combined.result.token_throughput == 20.0 and combined.result.ttft_ms == 200.0
    assert combined.result.requests == 24 and combined.result.concurrency == 4
    assert math.isclose(combined.host_share, 0.2)  # NaN (no resolver work) is left out


def test_ratios_are_policy_over_baseline_at_the_same_concurrency():
    rows = [BenchRow("adaptive", _result(1, 30.0, 100.0)), BenchRow("hisparse", _result(1, 20.0, 200.0)),
            BenchRow("adaptive", _result(8, 50.0, 100.0))]
    adaptive1, hisparse1, adaptive8 = add_ratios(rows, "hisparse")
    assert adaptive1.ratios == {"token_throughput": 1.5, "ttft_ms": 0.5, "itl_ms": 1.0}
    assert hisparse1.ratios["token_throughput"] == 1.0
    assert adaptive8.ratios == {}  # the baseline was not measured there
    table = format_table([adaptive1, hisparse1, adaptive8], "hisparse")
    assert "1.50" in table and "policy / hisparse" in table and "gp tok/s" not in table


def test_server_token_count_corrects_speculative_responses():
    from dhisparse_client.perf import with_token_count

    result = _result(1, 10.0, 100.0)  # 8 requests, 10 responses each, ITL 5 ms between responses, 1 s
    corrected = with_token_count(result, generated_tokens=8 * 19.0)  # 19 tokens per request
    assert corrected.token_throughput == 152.0 and corrected.tokens_per_request == 19.0
    assert math.isclose(corrected.itl_ms, 5.0 * 9 / 18)
    assert with_token_count(result, 8 * 10.0).itl_ms == 5.0  # no speculation: unchanged


def test_aiperf_summary_becomes_a_row():
    """AIPerf 0.13's summary (a committed run: docs/results/aiperf) read into the row perf_analyzer's runs give."""
    import json
    from pathlib import Path

    from dhisparse_client.aiperf import Workload, level_result

    path = Path(__file__).parents[2] / "docs/results/aiperf/synthetic/hisparse/aiperf-c4-r0.json"
    report = json.loads(path.read_text())
    row = level_result(report, 4)
    assert row.concurrency == 4 and row.requests == report["request_count"]["avg"] == 8
    assert row.ttft_ms == report["time_to_first_token"]["p50"] and row.itl_ms == report["inter_token_latency"]["p50"]
    assert row.token_throughput == report["output_token_throughput"]["avg"] > 0
    assert row.tokens_per_request == 32.0  # min_tokens = max_tokens, counted by the server
    assert math.isnan(row.pa_request_throughput)
    multi = Workload("multi-turn", 512, 32, 3).arguments(4, 8)
    assert multi[multi.index("--conversation-num") + 1] == "4" and multi[multi.index("--request-count") + 1] == "12"
    assert Workload("multi-turn", 512, 32, 3).context_tokens() == 3 * (512 + 32)
