"""A cancelled stream stops its request and every byte of its memory comes back (seen through /metrics)."""

from __future__ import annotations

import time

import pytest
from conftest import LONG, PROMPT
from idle import IDLE, occupancy, settle

from dhisparse_client import GenerationOptions


def _wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("model", ["dhisparse_bls", "dhisparse"])
def test_cancelled_stream_releases_its_memory(served, prompt_runs_long, model):
    client = served.client(model)
    settle(client)
    before = client.metrics()
    if model == "dhisparse":
        stream = client.stream_token_ids(prompt_runs_long, GenerationOptions(max_tokens=LONG))
    else:
        stream = client.stream(PROMPT, GenerationOptions(max_tokens=LONG))
    for _ in range(3):
        next(stream)
    _wait_for(lambda: client.metrics().get("kv_requests_running", 0.0) >= 1.0)  # really holding memory now
    holding = occupancy(client.metrics())
    assert holding["kv_required_bytes"] > 0 and holding["kv_host_pages_used"] > 0  # every tier in use
    stream.close()  # cancels the request on the server

    assert settle(client, timeout_s=60) == IDLE
    final = client.metrics()
    assert final["requests_aborted"] - before.get("requests_aborted", 0.0) == 1.0
    assert final["serving_cancelled_requests"] - before.get("serving_cancelled_requests", 0.0) == 1.0
    assert final["generated_tokens"] - before.get("generated_tokens", 0.0) < LONG  # stopped well before the end
    assert list(served.client().stream("To be", GenerationOptions(max_tokens=2)))  # still serving
