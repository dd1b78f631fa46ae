"""Run NVIDIA's AIPerf (genai-perf's successor) against the OpenAI-compatible endpoint and read what it measured.

`scripts/setup_triton.sh` installs AIPerf 0.13 when `WITH_AIPERF=1` (into its own virtualenv `.tools/aiperf/`,
~1.2 GB: it needs numpy 2 and pulls transformers, datasets, …, which the project venv must not get) and writes the
wrapper `.tools/bin/aiperf`. One call is one `aiperf profile` run at one concurrency level over a fixed number of
requests, streaming, with the engine directory as its tokenizer and the server's own token counts
(`--use-server-token-count`: the OpenAI responses' `usage`). Every request asks for exactly `max_tokens` tokens
(`min_tokens` = `max_tokens`, an extension the server honours), as perf_analyzer's runs generate a fixed length.

Workloads: ``synthetic`` (independent prompts of `prompt_tokens` tokens, `/v1/chat/completions` or
`/v1/completions`) and ``multi-turn`` (`/v1/chat/completions` conversations of `turns` turns, each turn a new user
message of `prompt_tokens` tokens appended to the whole history, AIPerf's ``--conversation-turn-mean``).
The run's summary (`profile_export_aiperf.json`) becomes a `LevelResult`, the row type of perf_analyzer's runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dhisparse_client.perf import LevelResult

WORKLOADS = ("synthetic", "multi-turn")


class AIPerfError(RuntimeError):
    """AIPerf is missing, failed, or reported failed requests; the message says which."""


def find_aiperf(explicit: Path | None = None) -> Path:
    """`explicit`, `$DHISPARSE_AIPERF`, the repo's `.tools/bin/aiperf`, then `aiperf` on PATH."""
    repo_tool = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "aiperf"
    for candidate in (explicit, os.environ.get("DHISPARSE_AIPERF"), repo_tool, shutil.which("aiperf")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise AIPerfError("aiperf not found: run WITH_AIPERF=1 scripts/setup_triton.sh (or pass --aiperf-binary)")


@dataclass(frozen=True)
class Workload:
    """What AIPerf sends.

    Attributes:
        kind: ``synthetic`` or ``multi-turn``.
        prompt_tokens: tokens of each prompt (of each turn's user message for multi-turn), by AIPerf's tokenizer.
        max_tokens: tokens generated per request (exactly: min_tokens is set to it).
        turns: turns per conversation (multi-turn).
        endpoint: ``chat`` or ``completions`` (multi-turn needs chat).
    """

    kind: str = "synthetic"
    prompt_tokens: int = 1024
    max_tokens: int = 32
    turns: int = 3
    endpoint: str = "chat"

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        if self.kind == "multi-turn" and self.endpoint != "chat":
            raise ValueError("the multi-turn workload needs the chat endpoint")
        if min(self.prompt_tokens, self.max_tokens, self.turns) < 1:
            raise ValueError("prompt_tokens, max_tokens and turns must be >= 1")

    def context_tokens(self) -> int:
        """Tokens the longest request holds (the last turn's whole history), before any chat template."""
        turns = self.turns if self.kind == "multi-turn" else 1
        return turns * (self.prompt_tokens + self.max_tokens)

    def arguments(self, concurrency: int, request_count: int) -> list[str]:
        args = ["--endpoint-type", self.endpoint, "--streaming", "--use-server-token-count",
                "--synthetic-input-tokens-mean", str(self.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(self.max_tokens), "--output-tokens-stddev", "0",
                "--extra-inputs", f"min_tokens:{self.max_tokens}", "--concurrency", str(concurrency)]
        if self.kind == "multi-turn":
            conversations = max(concurrency, math.ceil(request_count / self.turns))
            args += ["--conversation-num", str(conversations), "--conversation-turn-mean", str(self.turns),
                     "--conversation-turn-stddev", "0", "--request-count", str(conversations * self.turns)]
        else:
            args += ["--request-count", str(request_count)]
        return args


def _stat(report: dict, name: str, key: str = "avg") -> float:
    value = report.get(name, {}).get(key)
    return float(value) if value is not None else math.nan


def level_result(report: dict, concurrency: int) -> LevelResult:
    """A `LevelResult` from AIPerf's `profile_export_aiperf.json` (times in ms; perf_analyzer-only fields NaN).
    Token counts are the server's (usage): output tokens/s over the run, p50 TTFT and inter-token latency."""
    return LevelResult(
        concurrency=concurrency, request_throughput=_stat(report, "request_throughput"),
        token_throughput=_stat(report, "output_token_throughput"),
        latency_p50_ms=_stat(report, "request_latency", "p50"), ttft_ms=_stat(report, "time_to_first_token", "p50"),
        ttft_p90_ms=_stat(report, "time_to_first_token", "p90"), itl_ms=_stat(report, "inter_token_latency", "p50"),
        requests=int(_stat(report, "request_count")), tokens_per_request=_stat(report, "output_sequence_length"),
        responses_per_request=_stat(report, "http_req_chunks_received"),
        duration_s=_stat(report, "benchmark_duration"), pa_request_throughput=math.nan, pa_token_throughput=math.nan)


def run_aiperf(binary: Path, openai_url: str, model: str, tokenizer_dir: Path, workload: Workload, concurrency: int,
               request_count: int, workdir: Path, tag: str = "", timeout_s: float = 900.0) -> tuple[LevelResult, dict]:
    """One `aiperf profile` run; its artifacts stay in `workdir/<tag>/` (tag: ``aiperf-c<concurrency>``).
    Returns the level's `LevelResult` and AIPerf's whole summary. `openai_url`: the API's base URL (``…/v1``)."""
    artifacts = workdir / (tag or f"aiperf-c{concurrency}")
    shutil.rmtree(artifacts, ignore_errors=True)
    base = openai_url.removesuffix("/").removesuffix("/v1")
    cmd = [str(binary), "profile", "--model", model, "--url", base, "--tokenizer", str(tokenizer_dir),
           *workload.arguments(concurrency, request_count), "--random-seed", "0", "--no-auto-plot",
           "--output-artifact-dir", str(artifacts), "--ui-type", "none"]
    # AIPerf loads a local tokenizer directory only when HF_HUB_OFFLINE is unset (no request is made for a path)
    environment = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, errors="replace",
                              env=environment)
    except subprocess.TimeoutExpired as error:
        raise AIPerfError(f"aiperf timed out after {timeout_s:.0f} s at concurrency {concurrency}") from error
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "aiperf.log").write_text(" ".join(cmd) + "\n\n" + done.stdout + done.stderr)
    summary = artifacts / "profile_export_aiperf.json"
    if done.returncode != 0 or not summary.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise AIPerfError(f"aiperf exited with {done.returncode} at concurrency {concurrency}\n{tail}")
    report = json.loads(summary.read_text())
    errors = _stat(report, "request_error_rate")
    if errors and errors > 0:
        raise AIPerfError(f"aiperf: {errors:.1f}% of requests failed at concurrency {concurrency}: "
                          f"{report.get('error_summary')}")
    return level_result(report, concurrency), report
