"""A multi-rank engine through the real server (`dhisparse-serve`, gloo, 2 ranks), float64 so that tokens equal the
single-process engine's:

* tensor parallelism on two "hosts": the two-host recipe of docs/parallel.md, run as written (two process groups on
  this machine joined over loopback; host B has its own copy of the engine directory), serves the single-process
  tokens through the `dhisparse` model and the ensemble, labels its per-rank figures on `/metrics`, and stopping the
  server stops host B's rank cleanly;
* data-parallel attention: the same tokens, through the `dhisparse` model and through the OpenAI API beside it
  (`--openai-port`, the official `openai` client); then a rank killed mid-stream — its client gets an error within
  seconds, no client hangs, the model turns not-ready and `dhisparse-serve` exits with code 3, no rank process is left.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import PROMPT

from dhisparse_client import DHiSparseClient, GenerationError, GenerationOptions

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"dhisparse-serve: ready .*http=(\S+) grpc=(\S+) metrics=(\S+) pid=(\d+)")
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 3, 90, 17, 250, 11, 12, 13, 14, 15]]
TOKENS = 12


@pytest.fixture(scope="module")
def engine64(tmp_path_factory) -> Path:
    from tiny_engine import build_tiny_engine

    return build_tiny_engine(tmp_path_factory.mktemp("tiny64"), dtype="float64", max_model_len=512)


@pytest.fixture(scope="module")
def single_tokens(engine64) -> list[list[int]]:
    from dhisparse import LLM, SamplingParams

    llm = LLM(engine64)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))]


def recipe() -> tuple[str, str]:
    """The two command lines of docs/parallel.md's two-host recipe: (host B, host A)."""
    text = (REPO / "docs" / "parallel.md").read_text()
    block = text.split("<!-- two-host recipe -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 2 and "dhisparse-rank" in lines[0] and "dhisparse-serve" in lines[1], lines
    return lines[0], lines[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_env() -> dict[str, str]:
    import sys

    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _wait_ready(proc: subprocess.Popen, lines: list[str], timeout_s: float = 300.0) -> re.Match:
    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for line in list(lines):
            match = READY.search(line)
            if match:
                return match
        if proc.poll() is not None:
            raise AssertionError(f"dhisparse-serve exited with {proc.returncode}: {''.join(lines)[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("dhisparse-serve did not become ready")


def _stream_ids(grpc: str, http: str, prompt: list[int], tokens: int) -> list[int]:
    client = DHiSparseClient(grpc, http, model="dhisparse", timeout_s=120.0)
    return [t for chunk in client.stream_token_ids(prompt, GenerationOptions(max_tokens=tokens)) for t in chunk]


def _rank_pids(metrics_url: str) -> dict[int, int]:
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return {int(r): int(float(v)) for r, v in
            re.findall(r'dhisparse_rank_process_id\{[^}]*rank="(\d+)"[^}]*\} (\S+)', text)}


def test_two_host_recipe_serves_the_single_process_tokens(engine64, single_tokens, tmp_path) -> None:
    host_b_line, host_a_line = recipe()
    port = _free_port()
    engine_b = tmp_path / "host-b-engine"
    shutil.copytree(engine64, engine_b)  # host B's own copy

    def concrete(line: str, engine: Path) -> list[str]:
        line = line.replace("10.0.0.1", "127.0.0.1").replace("29500", str(port)).replace("/srv/engines/glm5",
                                                                                           str(engine))
        return shlex.split(line)

    b_words, a_words = concrete(host_b_line, engine_b), concrete(host_a_line, engine64)

    def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
        env = _venv_env()
        while "=" in words[0]:
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        return env, words

    env_b, cmd_b = split_env(b_words)
    env_a, cmd_a = split_env(a_words)
    cmd_a += ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--log-file", str(tmp_path / "a.log")]
    host_b = subprocess.Popen(cmd_b, env=env_b, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    host_a = subprocess.Popen(cmd_a, env=env_a, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    a_lines: list[str] = []
    try:
        ready = _wait_ready(host_a, a_lines)
        http, grpc, metrics = ready.group(1), ready.group(2), ready.group(3)
        assert [_stream_ids(grpc, http, p, TOKENS) for p in PROMPTS] == single_tokens
        text = DHiSparseClient(grpc, http, metrics).generate(PROMPT, GenerationOptions(max_tokens=6))
        assert isinstance(text, (bytes, str)) and len(text) > 0
        pids = _rank_pids(metrics)
        assert set(pids) == {0, 1}
        assert pids[1] not in _children(host_a.pid)  # rank 1 runs under host B's process, not the server's
        host_a.send_signal(signal.SIGINT)
        assert host_a.wait(60) == 0, "".join(a_lines)[-3000:]
        assert host_b.wait(60) == 0, host_b.stdout.read()[-3000:]  # type: ignore[union-attr]
    finally:
        for proc in (host_a, host_b):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - out
        out |= frontier
    return out


def test_data_parallel_serving_and_a_rank_killed_mid_stream(engine64, single_tokens, tmp_path) -> None:
    from dhisparse_client.serve_process import ServeProcess

    serve = ServeProcess(engine64, log_path=tmp_path / "server.log",
                         extra_args=("--data-parallel-size", "2", "--openai-port", "0"))
    endpoints = serve.start()
    try:
        http, grpc = endpoints.http_url, endpoints.grpc_url
        assert [_stream_ids(grpc, http, p, TOKENS) for p in PROMPTS] == single_tokens
        _check_openai_completions(endpoints, engine64, single_tokens)
        pids = _rank_pids(endpoints.metrics_url)
        assert set(pids) == {0, 1}
        results: dict[int, str] = {}
        started = threading.Event()

        def run(i: int) -> None:
            client = DHiSparseClient(grpc, http, model="dhisparse", timeout_s=120.0)
            try:
                for n, _ in enumerate(client.stream_token_ids(PROMPTS[i % 2], GenerationOptions(max_tokens=400))):
                    if n == 2:
                        started.set()
                results[i] = "finished"
            except GenerationError as error:
                results[i] = f"error: {error}"

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert started.wait(120)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung after a rank died"
        assert time.monotonic() - killed_at < 30
        assert all(r.startswith("error: ") for r in results.values()) and len(results) == 4, results
        assert any("rank 1" in r for r in results.values()), results
        assert serve.wait(timeout_s=60) == 3, serve.output_tail()
        assert "is no longer ready" in serve.output_tail()
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_alive(p) for p in pids.values()):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids.values())
    finally:
        serve.stop()


def _check_openai_completions(endpoints, engine: Path, single_tokens: list[list[int]]) -> None:
    """The OpenAI API in front of the multi-rank engine: token-id prompts (both in one request, so the two data-parallel
    groups serve them together) complete to the single-process engine's text and token counts."""
    import openai

    from dhisparse.serving.tokenization import TokenBytes, load_tokenizer

    api = openai.OpenAI(base_url=endpoints.openai_url, api_key="unused", max_retries=0, timeout=120)
    reply = api.completions.create(model=endpoints.openai_model, prompt=PROMPTS, max_tokens=TOKENS, temperature=0)
    text = TokenBytes(load_tokenizer(engine))
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [
        text.decode(ids).decode("utf-8", "replace") for ids in single_tokens]
    assert reply.usage.completion_tokens == sum(len(ids) for ids in single_tokens)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
