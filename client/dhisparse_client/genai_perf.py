"""Optional cross-check with NVIDIA's `genai-perf` 0.0.8 (it drives the same perf_analyzer 2.51 binary).

`scripts/setup_triton.sh` installs it when `WITH_GENAI_PERF=1` (into `.tools/genai-perf/`, ~650 MB of
dependencies kept out of the project venv) and writes the wrapper `.tools/bin/genai-perf`. It profiles the
ensemble as a tensorrtllm_backend model (`--service-kind triton --backend tensorrtllm --streaming`) with
synthetic prompts of the same token count, the engine directory as its Hugging Face tokenizer, and one
measurement window per run (genai-perf 0.0.8 has no request-count mode).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path


class GenaiPerfError(RuntimeError):
    """genai-perf is missing, failed or wrote no report; the message says which."""


def find_genai_perf() -> Path:
    """`$DHISPARSE_GENAI_PERF`, the repo's `.tools/bin/genai-perf`, then `genai-perf` on PATH."""
    repo_tool = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "genai-perf"
    for candidate in (os.environ.get("DHISPARSE_GENAI_PERF"), repo_tool, shutil.which("genai-perf")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise GenaiPerfError("genai-perf not found: run WITH_GENAI_PERF=1 scripts/setup_triton.sh")


def run_genai_perf(binary: Path, grpc_url: str, tokenizer_dir: Path, concurrency: int, prompt_tokens: int,
                   max_tokens: int, workdir: Path, model: str = "ensemble", interval_ms: int = 4000,
                   timeout_s: float = 600.0) -> dict[str, float]:
    """One `genai-perf profile` run; returns its p50 TTFT and ITL (ms) and average throughputs.

    Keys: `gp_token_throughput` (output tokens/s), `gp_request_throughput`, `gp_ttft_ms`, `gp_itl_ms`.
    """
    artifacts = workdir / f"genai-perf-c{concurrency}"
    shutil.rmtree(artifacts, ignore_errors=True)
    cmd = [str(binary), "profile", "-m", model, "--service-kind", "triton", "--backend", "tensorrtllm",
           "--streaming", "-u", grpc_url, "--tokenizer", str(tokenizer_dir),
           "--synthetic-input-tokens-mean", str(prompt_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(max_tokens), "--concurrency", str(concurrency),
           "--measurement-interval", str(interval_ms), "--artifact-dir", str(artifacts)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, errors="replace",
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except subprocess.TimeoutExpired as error:
        raise GenaiPerfError(f"genai-perf timed out after {timeout_s:.0f} s") from error
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "genai-perf.log").write_text(" ".join(cmd) + "\n\n" + done.stdout + done.stderr)
    report = artifacts / "profile_export_genai_perf.json"
    if done.returncode != 0 or not report.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-5:])
        raise GenaiPerfError(f"genai-perf exited with {done.returncode}\n{tail}")
    data = json.loads(report.read_text())
    return {"gp_token_throughput": data["output_token_throughput"]["avg"],
            "gp_request_throughput": data["request_throughput"]["avg"],
            "gp_ttft_ms": data["time_to_first_token"]["p50"], "gp_itl_ms": data["inter_token_latency"]["p50"]}
