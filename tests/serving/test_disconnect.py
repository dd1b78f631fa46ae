"""A client process killed mid-stream: the server notices, aborts the request and its memory returns to idle.

Through `dhisparse_bls` and `dhisparse`, Triton 2.51's gRPC frontend turns the dropped connection into a
request cancellation that the backend sees (`is_cancelled()`), so the engine request is aborted. Through the
`ensemble`, Triton 2.51 does not forward cancellation to the composing models: the request runs to its end
(it is not aborted), then its memory is released like any finished request's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import LONG, PROMPT
from idle import IDLE, settle, wait_idle

from dhisparse_client import GenerationOptions

CHILD = textwrap.dedent("""
    import sys
    from dhisparse_client import DHiSparseClient, GenerationOptions
    grpc_url, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    for chunk in DHiSparseClient(grpc_url, model=model).stream(prompt, GenerationOptions(max_tokens=max_tokens)):
        print("chunk", flush=True)
""")


@pytest.mark.parametrize("model", ["dhisparse_bls", "ensemble"])
def test_killed_client_process_releases_its_request(served, prompt_runs_long, model):
    client = served.client()
    settle(client)
    before = client.metrics()
    child = subprocess.Popen([sys.executable, "-c", CHILD, served.grpc_url, model, PROMPT, str(LONG)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(3):  # the request is streaming: it holds memory on the server now
            assert child.stdout.readline().startswith("chunk"), "the child client got no tokens"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert wait_idle(client, timeout_s=60) == IDLE
    after = client.metrics()
    aborted = after["requests_aborted"] - before.get("requests_aborted", 0.0)
    generated = after["generated_tokens"] - before.get("generated_tokens", 0.0)
    if model == "ensemble":  # Triton 2.51 limitation: the ensemble's steps never see the cancellation
        assert aborted == 0.0
    else:
        assert aborted == 1.0
        assert after["serving_cancelled_requests"] - before.get("serving_cancelled_requests", 0.0) == 1.0
        assert generated < LONG  # stopped well before the end
    assert list(served.client().stream("To be", GenerationOptions(max_tokens=2)))
