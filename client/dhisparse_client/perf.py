"""Run the real `perf_analyzer` 2.51 (streaming gRPC) against a served ensemble and read what it measured.

One call measures one concurrency level over a fixed number of requests (`--request-count`). Two files
come back: the CSV report (`-f`: perf_analyzer's throughput and latency percentiles) and the profile export
(`--profile-export-file`: per-request send time and per-response receive times), from which time to first
token (first response - send), inter-token latency ((last - first) / (responses - 1)) and throughput over
the whole run (responses / (last response - first send)) are computed as genai-perf does. perf_analyzer's
own throughput columns are kept too (`pa_*`), but with a small `--request-count` they were seen to read
"count / ~1 s" whatever the concurrency, so the run-wide figures are the ones to compare. The ensemble
sends one response per engine update, i.e. one per generated token without speculation (with speculation
a response may carry several tokens: "tokens" below then means responses).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer failed, timed out, or wrote no usable report; the message carries its output tail."""


def find_perf_analyzer(explicit: Path | None = None) -> Path:
    """The 2.51 binary: `explicit`, `$DHISPARSE_PERF_ANALYZER`, the repo's `.tools/bin/perf_analyzer`
    (written by scripts/setup_triton.sh), then `perf_analyzer` on PATH (tritonclient 2.73's is a placeholder)."""
    repo_tool = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "perf_analyzer"
    candidates = [explicit, os.environ.get("DHISPARSE_PERF_ANALYZER"), repo_tool, shutil.which("perf_analyzer")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise PerfAnalyzerError("perf_analyzer 2.51 not found: run scripts/setup_triton.sh (or pass --perf-analyzer)")


def write_input_data(path: Path, prompts: Sequence[str], max_tokens: int) -> Path:
    """perf_analyzer `--input-data` JSON: one entry per prompt (used round-robin), streaming on."""
    entries = [{"text_input": {"content": [p], "shape": [1]}, "max_tokens": {"content": [max_tokens], "shape": [1]},
                "stream": {"content": [True], "shape": [1]}} for p in prompts]
    path.write_text(json.dumps({"data": entries}))
    return path


@dataclass(frozen=True)
class LevelResult:
    """What perf_analyzer measured at one concurrency level. Times in milliseconds.

    Attributes:
        request_throughput: completed requests per second over the run (first send to last response).
        token_throughput: generated tokens per second over the run (responses/s until `with_token_count`).
        latency_p50_ms: median request latency, send to final response (CSV "p50 latency").
        ttft_ms, ttft_p90_ms: median and 90th percentile time to first token over requests.
        itl_ms: median over requests of the mean inter-token latency.
        requests: requests in the profile export; tokens_per_request: mean tokens per request (responses
            until `with_token_count`); responses_per_request: mean responses per request.
        duration_s: first send to last response.
        pa_request_throughput, pa_token_throughput: the CSV's "Inferences/Second" and "Response Throughput".
    """

    concurrency: int
    request_throughput: float
    token_throughput: float
    latency_p50_ms: float
    ttft_ms: float
    ttft_p90_ms: float
    itl_ms: float
    requests: int
    tokens_per_request: float
    responses_per_request: float
    duration_s: float
    pa_request_throughput: float
    pa_token_throughput: float


def parse_csv(path: Path) -> dict[str, float]:
    """The one data row of a perf_analyzer `-f` CSV report, as floats (microsecond columns unchanged)."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if len(rows) != 1:
        raise PerfAnalyzerError(f"{path}: expected one measurement row, found {len(rows)}")
    return {key.strip(): float(value) for key, value in rows[0].items() if value not in ("", None)}


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def parse_profile(path: Path) -> tuple[list[float], list[float], list[int], float]:
    """Per request: TTFT (ms), mean inter-token latency (ms, requests with >= 2 responses), response count;
    and the run's duration (s) from the first send to the last response.

    The export's `response_outputs` hold raw text bytes that may split UTF-8 characters, so the file is
    decoded leniently (only timestamps are read)."""
    profile = json.loads(path.read_bytes().decode("utf-8", "replace"))
    ttfts, itls, counts = [], [], []
    first_send, last_response = float("inf"), float("-inf")
    for experiment in profile["experiments"]:
        for request in experiment["requests"]:
            stamps = request["response_timestamps"]
            if not stamps:
                continue
            first_send, last_response = min(first_send, request["timestamp"]), max(last_response, stamps[-1])
            ttfts.append((stamps[0] - request["timestamp"]) / 1e6)
            counts.append(len(stamps))
            if len(stamps) > 1:
                itls.append((stamps[-1] - stamps[0]) / 1e6 / (len(stamps) - 1))
    return ttfts, itls, counts, (last_response - first_send) / 1e9 if counts else 0.0


def with_token_count(result: LevelResult, generated_tokens: float) -> LevelResult:
    """Use the server's count of tokens generated during the level (`generated_tokens` delta on /metrics).

    With speculation one response carries several tokens, so responses undercount tokens: throughput becomes
    tokens / duration, and the inter-token latency is rescaled from per-response to per-token gaps with the
    mean counts, ((responses - 1) / (tokens - 1)). Without speculation tokens == responses: nothing changes.
    """
    tokens = generated_tokens / result.requests
    if not math.isfinite(tokens) or tokens <= 1 or result.responses_per_request <= 1:
        return result
    scale = (result.responses_per_request - 1) / (tokens - 1)
    return replace(result, token_throughput=generated_tokens / result.duration_s, tokens_per_request=tokens,
                   itl_ms=result.itl_ms * scale)


def median_result(results: Sequence[LevelResult]) -> LevelResult:
    """Field-wise median of repeated measurements of one level (`requests`: the total over repeats)."""
    if not results or len({r.concurrency for r in results}) != 1:
        raise ValueError("median_result needs measurements of one concurrency level")
    values = {f.name: statistics.median(getattr(r, f.name) for r in results) for f in fields(LevelResult)}
    values["concurrency"], values["requests"] = results[0].concurrency, sum(r.requests for r in results)
    return LevelResult(**values)


def run_level(binary: Path, grpc_url: str, input_data: Path, concurrency: int, request_count: int,
              workdir: Path, model: str = "ensemble", timeout_s: float = 600.0, tag: str = "") -> LevelResult:
    """Run perf_analyzer once (`--streaming`, gRPC, fixed request count) and summarise its reports, which
    are kept in `workdir` as `<tag>.csv`, `<tag>.json` and `<tag>.log` (tag: `c<concurrency>` by default)."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = workdir / (tag or f"c{concurrency}")
    csv_path, profile_path, log_path = stem.with_suffix(".csv"), stem.with_suffix(".json"), stem.with_suffix(".log")
    for stale in (csv_path, profile_path):  # perf_analyzer refuses to overwrite a profile export
        stale.unlink(missing_ok=True)
    cmd = [str(binary), "-m", model, "-i", "grpc", "-u", grpc_url, "--streaming", "--input-data", str(input_data),
           "--concurrency-range", f"{concurrency}:{concurrency}", "--request-count", str(request_count),
           "-f", str(csv_path), "--profile-export-file", str(profile_path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, errors="replace")
    except subprocess.TimeoutExpired as error:
        raise PerfAnalyzerError(f"perf_analyzer timed out after {timeout_s:.0f} s at concurrency {concurrency}"
                                ) from error
    log_path.write_text(" ".join(cmd) + "\n\n" + done.stdout + done.stderr)
    if done.returncode != 0 or not csv_path.exists() or not profile_path.exists():
        lines = (done.stdout + done.stderr).splitlines()
        tail = "\n".join([line for line in lines if "error" in line.lower()][:5] or lines[-15:])
        raise PerfAnalyzerError(f"perf_analyzer exited with {done.returncode} at concurrency {concurrency}\n{tail}")
    row = parse_csv(csv_path)
    ttfts, itls, counts, duration_s = parse_profile(profile_path)
    if not ttfts or duration_s <= 0:
        raise PerfAnalyzerError(f"{profile_path}: no request got a response")
    return LevelResult(
        concurrency=concurrency, request_throughput=len(counts) / duration_s,
        token_throughput=sum(counts) / duration_s, latency_p50_ms=row["p50 latency"] / 1e3,
        ttft_ms=statistics.median(ttfts), ttft_p90_ms=_percentile(ttfts, 0.9),
        itl_ms=statistics.median(itls) if itls else float("nan"), requests=len(ttfts),
        tokens_per_request=statistics.fmean(counts), responses_per_request=statistics.fmean(counts),
        duration_s=duration_s,
        pa_request_throughput=row["Inferences/Second"],
        pa_token_throughput=row.get("Response Throughput", float("nan")),
    )
