"""`dhisparse-bench` at tiny scale: real dhisparse-serve, real perf_analyzer 2.51, one policy, one level."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from dhisparse_client.perf import PerfAnalyzerError, find_perf_analyzer


def test_bench_measures_one_policy_with_the_real_perf_analyzer(tiny_engine, tmp_path):
    try:
        find_perf_analyzer()
    except PerfAnalyzerError as error:
        pytest.skip(str(error))
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "dhisparse_client.bench", "--engine", str(tiny_engine), "--policies", "hisparse",
           "--concurrency", "2", "--requests", "4", "--prompt-tokens", "48", "--max-tokens", "6",
           "--prompts", "4", "--repeats", "1", "--pool-bytes", str(256 * 1024), "--engine-option", "page_rows=16",
           "--output-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hisparse" in done.stdout and "tok/s" in done.stdout
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert len(rows) == 1
    row = rows[0]
    assert row["policy"] == "hisparse" and row["concurrency"] == "2" and row["requests"] == "4"
    assert 1 <= float(row["tokens_per_request"]) <= 6
    assert float(row["token_throughput"]) > 0 and float(row["ttft_ms"]) > 0
    assert float(row["host_share"]) > 0  # hisparse keeps the history on host: some rows were fetched
    assert float(row["token_throughput_vs_baseline"]) == 1.0  # the baseline is the only policy measured
    assert (out / "bench.png").stat().st_size > 10_000
    assert (out / "hisparse" / "c2-r0.csv").exists() and (out / "hisparse" / "c2-r0.json").exists()


@pytest.mark.parametrize("workload", ["synthetic", "multi-turn"])
def test_bench_with_aiperf_against_the_openai_api(tiny_engine, tmp_path, workload):
    """`dhisparse-bench --aiperf`: the real AIPerf 0.13 (when installed: WITH_AIPERF=1 scripts/setup_triton.sh)
    against dhisparse-serve's OpenAI API; every request generates exactly --max-tokens tokens, counted by the
    server (usage)."""
    from dhisparse_client.aiperf import AIPerfError, find_aiperf

    try:
        find_aiperf()
    except AIPerfError as error:
        pytest.skip(str(error))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "dhisparse_client.bench", "--engine", str(tiny_engine), "--policies", "hisparse",
           "--aiperf", "--aiperf-workload", workload, "--turns", "2", "--chat-template", str(template),
           "--concurrency", "2", "--requests", "4", "--prompt-tokens", "32", "--max-tokens", "6", "--repeats", "1",
           "--pool-bytes", str(256 * 1024), "--engine-option", "page_rows=16", "--output-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = list(csv.DictReader(open(out / "bench.csv")))
    assert row["policy"] == "hisparse" and row["concurrency"] == "2" and int(row["requests"]) == 4
    assert float(row["tokens_per_request"]) == 6.0  # min_tokens = max_tokens, server-counted
    assert float(row["token_throughput"]) > 0 and float(row["ttft_ms"]) > 0
    assert float(row["itl_ms"]) >= 0  # 0 when a request's text came in one event (the random model's bytes)
    assert (out / "bench.png").stat().st_size > 10_000
    export = out / "hisparse" / "aiperf-c2-r0" / "profile_export.jsonl"
    turns = sorted({json.loads(line)["metadata"]["turn_index"] for line in export.read_text().splitlines()})
    assert turns == ([0, 1] if workload == "multi-turn" else [0])
