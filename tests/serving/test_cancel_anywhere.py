"""Cancellation is seen wherever the request is: here while it waits for admission, and non-streaming.

Over HTTP (the generate endpoint) Triton 2.51 does not turn a dropped connection into a cancellation (its
documentation: gRPC and the C API only), so such a request runs to its end; the test pins that down.

Long requests fill the pool so that the victim waits (engine gauge `requests_waiting`); the victim's client then
cancels. The engine aborts it (nothing was admitted, nothing leaks) and the fillers are unaffected.
"""

from __future__ import annotations

import json
import queue
import socket
import time
import uuid

import pytest
from conftest import LONG
from idle import IDLE, settle
from test_cancellation import _wait_for

FILLERS = 12


def _start(grpc_url: str, model: str, values: dict, output: str):
    """An open gRPC stream with one request in flight (cancel with `stop_stream(cancel_requests=True)`)."""
    import tritonclient.grpc as grpcclient

    from dhisparse_client.client import _grpc_inputs

    client = grpcclient.InferenceServerClient(grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(model, _grpc_inputs(values), request_id=uuid.uuid4().hex,
                              enable_empty_final_response=True)
    return client, responses


def _ended_on_its_own(responses: queue.Queue) -> bool:
    """Whether a stream received its request's final response with no error (the request ran to its end)."""
    ended = False
    while not responses.empty():
        result, error = responses.get_nowait()
        if error is None and result is not None:
            final = result.get_response().parameters.get("triton_final_response")
            ended = ended or (final is not None and final.bool_param)
    return ended


def _http_generate_then_drop(http_url: str, model: str, body: dict) -> socket.socket:
    host, port = http_url.split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST /v2/models/{model}/generate HTTP/1.1\r\nHost: {http_url}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _seen(metrics: dict[str, float], before: dict[str, float]) -> float:
    """Requests the engine has been given since ``before``: waiting, running, or finished since then."""
    finished = metrics.get("requests_finished", 0.0) - before.get("requests_finished", 0.0)
    return metrics.get("requests_waiting", 0.0) + metrics.get("requests_running", 0.0) + finished


def _settled_waiting(client) -> float:
    """The engine's waiting gauge once it stopped changing over a few metrics refreshes."""
    last, stable = -1.0, 0
    while stable < 5:
        time.sleep(0.2)
        now = client.metrics().get("requests_waiting", 0.0)
        stable, last = (stable + 1, now) if now == last else (0, now)
    return last


@pytest.mark.parametrize("how", ["dhisparse-grpc", "dhisparse_bls-grpc", "dhisparse_bls-http"])
def test_a_waiting_non_streaming_request_is_cancelled(served, prompt_runs_long, how):
    model, transport = how.split("-")
    client = served.client()
    settle(client)
    before = client.metrics()
    fill = {"input_ids": prompt_runs_long, "input_lengths": len(prompt_runs_long), "request_output_len": LONG,
            "streaming": True}
    fillers = [_start(served.grpc_url, "dhisparse", fill, "output_ids") for _ in range(FILLERS)]
    try:
        _wait_for(lambda: client.metrics().get("kv_requests_running", 0.0) >= 1.0)
        assert _settled_waiting(client) >= 1  # fillers the pool cannot admit (they run long: the queue stays)
        if model == "dhisparse":
            victim = {"input_ids": prompt_runs_long, "input_lengths": len(prompt_runs_long),
                      "request_output_len": LONG, "streaming": False}
        else:
            victim = {"text_input": "To be", "max_tokens": LONG, "stream": False}
        if transport == "grpc":
            grpc_client, _ = _start(served.grpc_url, model, victim, "output_ids")
        else:
            sock = _http_generate_then_drop(served.http_url, model, victim)
        # The engine has the victim: every request it was given is waiting, running or finished. (Waiting behind the
        # fillers, unless a batch of them finished just then and it was admitted at once: its cancellation is then
        # seen while it runs, which the counts below allow for just the same.)
        _wait_for(lambda: _seen(client.metrics(), before) >= FILLERS + 1)
        if transport == "grpc":
            grpc_client.stop_stream(cancel_requests=True)
            grpc_client.close()
        else:
            sock.close()
        if transport == "grpc":
            _wait_for(lambda: client.metrics().get("serving_cancelled_requests", 0.0)
                      > before.get("serving_cancelled_requests", 0.0), timeout_s=30)
            _wait_for(lambda: client.metrics().get("requests_aborted", 0.0) > before.get("requests_aborted", 0.0))
    finally:
        for grpc_filler, _ in fillers:
            grpc_filler.stop_stream(cancel_requests=True)
            grpc_filler.close()
    # A filler admitted first can run its LONG tokens to the end before the cancellations on a fast engine (with
    # prefix reuse the fillers share their prompt's pages, so several run at once and finish together). Such a
    # request ended on its own: it is neither cancelled nor aborted. Its stream may or may not have received the
    # final response before `stop_stream` dropped the call, so the client-side count is only a lower bound; the
    # engine's counters are the truth (finished = ran to the end + aborted).
    seen_ending = sum(_ended_on_its_own(responses) for _, responses in fillers)
    assert settle(client, timeout_s=60) == IDLE  # idle, then one more refresh: counters current
    after = client.metrics()
    aborted = after["requests_aborted"] - before.get("requests_aborted", 0.0)
    cancelled = after["serving_cancelled_requests"] - before.get("serving_cancelled_requests", 0.0)
    finished = after["requests_finished"] - before.get("requests_finished", 0.0)
    assert finished == FILLERS + 1  # nothing lost: every request ended, one way or the other
    ran_to_end = finished - aborted
    assert aborted == cancelled  # every abort came from a client's cancellation, every cancellation aborted
    assert aborted >= 1  # the fillers still waiting at the cancellations were aborted, not run
    if transport == "grpc":
        # The victim was aborted (checked above, before any filler was cancelled); fillers seen ending ran to it.
        assert ran_to_end >= seen_ending
        assert ran_to_end <= FILLERS
    else:
        # Triton 2.51 forwards cancellation from gRPC and the C API only: a dropped HTTP generate request runs to
        # its end (it is not aborted), then its memory is released like any finished request's.
        assert ran_to_end >= seen_ending + 1
        assert aborted <= FILLERS
