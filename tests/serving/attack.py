"""Helpers of the security suite (``test_security_*.py``, issue 29): every attack is tried against a real server.

Streams that record how each client was answered, readiness probes, process checks. The session server of
``conftest.py`` (``served``) is the default target; tests that stop or kill a server start their own.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BOUND_S = 120.0  # a hang guard far beyond any expected wait: a client that hangs fails the test here


def ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for every purpose here
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


@dataclass
class Outcome:
    """How one client's stream ended: ``ok`` (its final response), or ``error`` with the server's message."""

    chunks: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    finished: bool = False
    first: threading.Event = field(default_factory=threading.Event)


def stream_tokens(grpc_url: str, input_ids: list[int], max_tokens: int, outcome: Outcome, model: str = "dhisparse",
                  request_id: str = "") -> None:
    """Stream a token-id request, recording every chunk and how it ended (never raises)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from dhisparse_client import DHiSparseClient, GenerationError

    values = {"input_ids": np.array([input_ids], dtype=np.int32),
              "input_lengths": np.array([[len(input_ids)]], dtype=np.int32),
              "request_output_len": np.array([[max_tokens]], dtype=np.int32), "streaming": np.array([[True]])}
    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if array.dtype == bool else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = DHiSparseClient(grpc_url, model=model, timeout_s=BOUND_S)
    try:
        for arrays in client.stream_results(model, inputs, ["output_ids"], request_id=request_id):
            outcome.tokens += [int(t) for t in arrays["output_ids"].reshape(-1)]
            outcome.chunks += 1
            outcome.first.set()
        outcome.finished = True
    except GenerationError as error:
        outcome.error = str(error)
    finally:
        outcome.first.set()


def start_streams(grpc_url: str, input_ids: list[int], max_tokens: int, count: int
                  ) -> tuple[list[threading.Thread], list[Outcome]]:
    outcomes = [Outcome() for _ in range(count)]
    threads = [threading.Thread(target=stream_tokens, args=(grpc_url, input_ids, max_tokens, o), daemon=True)
               for o in outcomes]
    for thread in threads:
        thread.start()
    return threads, outcomes


def stream_text(grpc_url: str, model: str, prompt: str, max_tokens: int, outcome: Outcome) -> None:
    """Stream a text request (`ensemble` or `dhisparse_bls`), recording chunks and how it ended (never raises)."""
    from dhisparse_client import DHiSparseClient, GenerationError, GenerationOptions

    client = DHiSparseClient(grpc_url, model=model, timeout_s=BOUND_S)
    try:
        for _ in client.stream(prompt, GenerationOptions(max_tokens=max_tokens)):
            outcome.chunks += 1
            outcome.first.set()
        outcome.finished = True
    except GenerationError as error:
        outcome.error = str(error)
    finally:
        outcome.first.set()
