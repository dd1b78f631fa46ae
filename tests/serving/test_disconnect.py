"""A client process killed mid-stream: the server notices, aborts the request and its memory returns to idle.

Through `dhisparse_bls` and `dhisparse` (token ids), Triton 2.51's gRPC frontend turns the dropped connection into a
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
from idle import IDLE, settle
from test_cancellation import _wait_for

from dhisparse_client import GenerationOptions

CHILD = textwrap.dedent("""
    import sys
    from dhisparse_client import DHiSparseClient, GenerationOptions
    grpc_url, model, prompt, ids, max_tokens = sys.argv[1:5] + [int(sys.argv[5])]
    client, options = DHiSparseClient(grpc_url, model=model), GenerationOptions(max_tokens=max_tokens)
    if model == "dhisparse":  # token ids straight to the LLM model
        stream = client.stream_token_ids([int(t) for t in ids.split(",")], options)
    else:
        stream = client.stream(prompt, options)
    for chunk in stream:
        print("chunk", flush=True)
""")


@pytest.mark.parametrize("model", ["dhisparse_bls", "dhisparse", "ensemble"])
def test_killed_client_process_releases_its_request(served, prompt_runs_long, model):
    client = served.client()
    settle(client)
    before = client.metrics()
    child = subprocess.Popen([sys.executable, "-c", CHILD, served.grpc_url, model, PROMPT,
                              ",".join(map(str, prompt_runs_long)), str(LONG)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(3):
            assert child.stdout.readline().startswith("chunk"), "the child client got no tokens"
        # Metrics lag by one refresh: see the request hold memory first, so that "idle" below is news.
        _wait_for(lambda: client.metrics().get("kv_requests_running", 0.0) >= 1.0)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert settle(client, timeout_s=60) == IDLE
    after = client.metrics()
    aborted = after.get("requests_aborted", 0.0) - before.get("requests_aborted", 0.0)
    generated = after.get("generated_tokens", 0.0) - before.get("generated_tokens", 0.0)
    if model == "ensemble":  # Triton 2.51 limitation: the ensemble's steps never see the cancellation
        assert (aborted, generated) == (0.0, LONG)  # it ran to its end, then was freed
    else:
        # The server noticed the disconnect. The engine may still win the race on a tiny model (every token
        # generated before the notice arrived): then there was nothing left to abort.
        noticed = after.get("serving_cancelled_requests", 0.0) - before.get("serving_cancelled_requests", 0.0)
        assert noticed == 1.0, (aborted, generated, noticed)
        assert (aborted, generated < LONG) in ((1.0, True), (0.0, False)), (aborted, generated)
    assert list(served.client().stream("To be", GenerationOptions(max_tokens=2)))
