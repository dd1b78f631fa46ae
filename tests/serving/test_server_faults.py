"""Faults through the real server: a failed engine step fails its requests, never the server.

* A soak with two injected faults (a decode forward that raises, a failed host copy) and random
  cancellations, 8 clients over the three models: no client hangs, the failed requests' clients get an error
  naming the fault, every byte returns, the server stays ready and exact.
* An engine that cannot restore its invariants: every client gets an error, the `dhisparse` model turns
  not-ready, and `dhisparse-serve` stops the server and exits with code 3 (its health endpoint stops
  answering ready).
"""

from __future__ import annotations

import random
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import POOL_BYTES, PROMPT, start_triton
from idle import IDLE, settle

from dhisparse_client import DHiSparseClient, GenerationError, GenerationOptions

REQUESTS = 200
CLIENTS = 8
BOUND_S = 120.0
FAULTS = "decode_forward@60,prefill_chunk@120"  # two faults, both certain to land inside the soak


@pytest.fixture(scope="module")
def faulty_server(tiny_engine, tmp_path_factory):
    from dhisparse.serving.repository import RepositorySpec, fill_model_repository

    overrides = {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES, "page_rows": 16, "fault_injection": FAULTS}
    spec = RepositorySpec(tiny_engine, overrides, metrics_interval_ms=100)
    config, server, _ = start_triton(tmp_path_factory.mktemp("triton-faults"),
                                     lambda repo: fill_model_repository(spec, repo))
    try:
        yield config
    finally:
        server.stop()


def _one(config, i: int) -> str:
    """One request; returns "ok", "cancelled" or the error text."""
    rng = random.Random(i)
    model = ("ensemble", "dhisparse_bls", "dhisparse")[i % 3]
    client = DHiSparseClient(config.grpc_url, config.http_url, config.metrics_url, model=model, timeout_s=BOUND_S)
    options = GenerationOptions(max_tokens=rng.randint(2, 12))
    cancel = rng.random() < 0.25
    try:
        if model == "dhisparse":
            stream = client.stream_token_ids([rng.randrange(3, 60) for _ in range(rng.randint(3, 40))], options)
        else:
            stream = client.stream(f"request {i}: " + rng.choice(["To be", "the question", "naïve"]), options)
        for _ in stream:
            if cancel:
                stream.close()
                return "cancelled"
        return "ok"
    except GenerationError as error:
        return str(error)


def test_soak_with_faults_and_cancellations(faulty_server, offline_llm, tokenizer):
    client = DHiSparseClient(faulty_server.grpc_url, faulty_server.http_url, faulty_server.metrics_url)
    settle(client)
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        futures = [pool.submit(_one, faulty_server, i) for i in range(REQUESTS)]
        results = [f.result(timeout=BOUND_S) for f in futures]  # a hung client fails here
    errors = [r for r in results if r not in ("ok", "cancelled")]
    assert errors, "no injected fault reached a client"
    assert all("injected fault" in e for e in errors), errors
    assert results.count("ok") > REQUESTS // 2
    assert settle(client, timeout_s=60) == IDLE  # zero leaked bytes, pages, requests
    metrics = client.metrics()
    assert metrics["step_faults"] >= 2 and metrics["engine_alive"] == 1.0
    assert metrics["requests_failed"] >= len(errors)
    assert client.is_ready()
    from dhisparse import SamplingParams

    ids = tokenizer.encode(PROMPT).ids
    expected = offline_llm.generate([ids], SamplingParams(max_tokens=16))[0].token_ids
    got = [t for chunk in DHiSparseClient(faulty_server.grpc_url, model="dhisparse").stream_token_ids(
        ids, GenerationOptions(max_tokens=16)) for t in chunk]
    assert got == expected  # still exact after the faults


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_unrecoverable_engine_answers_everyone_and_turns_not_ready(tiny_engine, prompt_runs_long, tmp_path):
    from dhisparse_client.serve_process import ServeProcess

    serve = ServeProcess(tiny_engine, {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES, "page_rows": 16,
                                       "fault_injection": "break_invariants@4"}, log_path=tmp_path / "server.log")
    endpoints = serve.start()
    try:
        results: dict[int, str] = {}

        def run(i: int) -> None:
            client = DHiSparseClient(endpoints.grpc_url, endpoints.http_url, model="dhisparse", timeout_s=BOUND_S)
            try:  # a prompt whose greedy continuation runs without EOS: every request is still open at the fault
                results[i] = str(list(client.stream_token_ids(prompt_runs_long, GenerationOptions(max_tokens=40))))
            except GenerationError as error:
                results[i] = f"error: {error}"

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        assert not any(t.is_alive() for t in threads), "a client hung on a dead engine"
        assert len(results) == 4 and all(r.startswith("error: ") for r in results.values()), results
        assert all("could not recover" in r or "injected fault at break_invariants" in r for r in results.values())
        code = serve.wait(timeout_s=60)  # dhisparse-serve notices the not-ready model and stops the server
        assert code == 3, serve.output_tail()
        assert "is no longer ready" in serve.output_tail()
        assert not _ready(f"http://{endpoints.http_url}/v2/health/ready")
    finally:
        serve.stop()
