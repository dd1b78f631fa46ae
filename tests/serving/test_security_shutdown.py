"""Security suite: shutting down, the operator's way and the hard way (real `dhisparse-serve` processes).

* SIGTERM under load (streams on the engine model, the ensemble and the BLS model): the server turns not-ready at
  once and refuses new requests; every open stream is answered
  (its final response, or an error saying the server is shutting down); `dhisparse-serve` exits 0 and leaves no
  process of tritonserver's group and no shared-memory region behind; while it ran, its regions were owner-only.
* SIGKILL of `dhisparse-serve` under load: tritonserver (its parent-death signal) and the stubs exit, every client is
  answered, no region leaks, the ports come free; a restart on the same ports becomes ready, and one more start on
  those taken ports fails saying so instead of printing a false "ready".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from attack import BOUND_S, Outcome, alive, ready, start_streams, stream_text, wait_until
from conftest import POOL_BYTES, PROMPT

from dhisparse.serving import process_guard
from dhisparse.serving.repository import drain_file
from dhisparse.serving.server import free_ports
from dhisparse_client import DHiSparseClient, GenerationError, GenerationOptions
from dhisparse_client.serve_process import ServeError, ServeProcess

OPTIONS = {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES, "page_rows": 16}
STREAMS = 4
LONG = 470  # far more tokens than the grace lets them produce


def serve_repository(serve: ServeProcess):
    """The model repository of a running `dhisparse-serve` (from tritonserver's command line)."""
    argv = Path(f"/proc/{serve.endpoints.triton_pid}/cmdline").read_bytes().split(b"\0")
    return Path(next(a for a in argv if a.startswith(b"--model-repository=")).split(b"=", 1)[1].decode())


def _answered(outcome) -> bool:
    """A stream the server answered: it finished, or got the server's shutdown error."""
    return outcome.finished or (outcome.error is not None and "shutting down" in outcome.error)


def _leftovers(serve_pid: int, group: list[int]) -> tuple[list[int], list[str]]:
    processes = [pid for pid in group if alive(pid)]
    regions = [p.name for p in process_guard.shm_regions(f"{process_guard.SHM_PREFIX}{serve_pid}_")]
    return processes, regions


def test_sigterm_under_load_answers_every_stream_and_leaves_nothing(tiny_engine, prompt_runs_long, tmp_path):
    serve = ServeProcess(tiny_engine, OPTIONS, log_path=tmp_path / "server.log", extra_args=["--shutdown-grace", "0.5"])
    endpoints = serve.start()
    serve_pid = serve.pid
    try:
        group = process_guard.group_processes(endpoints.triton_pid)
        assert len(group) >= 2, "tritonserver and its stubs"
        regions = process_guard.shm_regions(f"{process_guard.SHM_PREFIX}{serve_pid}_")
        assert regions and all(p.stat().st_mode & 0o077 == 0 for p in regions), "shared memory is owner-only"
        threads, outcomes = start_streams(endpoints.grpc_url, prompt_runs_long, LONG, STREAMS)
        for model in ("ensemble", "dhisparse_bls"):  # the text paths too
            outcomes.append(Outcome())
            threads.append(threading.Thread(target=stream_text, args=(endpoints.grpc_url, model, PROMPT, LONG,
                                                                      outcomes[-1]), daemon=True))
            threads[-1].start()
        assert all(o.first.wait(BOUND_S) for o in outcomes) and all(o.chunks for o in outcomes), outcomes
        began = time.monotonic()
        os.kill(serve_pid, signal.SIGTERM)
        late = DHiSparseClient(endpoints.grpc_url, timeout_s=BOUND_S)
        assert wait_until(lambda: drain_file(serve_repository(serve)).exists(), 10)
        with pytest.raises(GenerationError, match="shutting down|not ready|Socket closed|failed to connect"):
            list(late.stream_token_ids(prompt_runs_long, GenerationOptions(max_tokens=4)))  # refused, not queued
        assert wait_until(lambda: not ready(endpoints.http_url), BOUND_S), "still ready after SIGTERM"
        not_ready_s = time.monotonic() - began
        for thread in threads:
            thread.join(BOUND_S)
        assert not any(t.is_alive() for t in threads), "a client hung through the shutdown"
        assert all(_answered(o) for o in outcomes), [o.error for o in outcomes]
        assert any(o.error for o in outcomes), "every stream finished within the grace: make LONG longer"
        assert serve.wait(timeout_s=BOUND_S) == 0, serve.output_tail()
        print(f"SIGTERM: not ready after {not_ready_s:.2f} s, exited after {time.monotonic() - began:.2f} s; "
              f"streams: {[o.error or 'finished' for o in outcomes]}")
        processes, regions = _leftovers(serve_pid, group)
        assert not processes and not regions, (processes, regions)
        assert not process_guard.ports_in_use("127.0.0.1", [int(u.rsplit(":", 1)[1]) for u in
                                                            (endpoints.http_url, endpoints.grpc_url)])
    finally:
        serve.stop()


def test_sigkill_of_the_launcher_leaves_no_orphan_and_a_taken_port_is_reported(tiny_engine, prompt_runs_long,
                                                                               tmp_path):
    ports = free_ports(3)
    flags = ["--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
             "--shutdown-grace", "0.5"]
    first = ServeProcess(tiny_engine, OPTIONS, log_path=tmp_path / "first.log", extra_args=flags)
    endpoints = first.start()
    serve_pid = first.pid
    group = process_guard.group_processes(endpoints.triton_pid)
    threads, outcomes = start_streams(endpoints.grpc_url, prompt_runs_long, LONG, 2)
    assert all(o.first.wait(BOUND_S) for o in outcomes)
    os.kill(serve_pid, signal.SIGKILL)
    first.stop()  # reaps the killed launcher; tritonserver is not its to stop any more
    for thread in threads:
        thread.join(BOUND_S)
    assert not any(t.is_alive() for t in threads), "a client hung after the launcher died"
    assert all(_answered(o) for o in outcomes), [o.error for o in outcomes]
    assert wait_until(lambda: not any(alive(p) for p in group), BOUND_S), "tritonserver or a stub outlived it"
    processes, regions = _leftovers(serve_pid, group)
    assert not processes and not regions, (processes, regions)

    second = ServeProcess(tiny_engine, OPTIONS, log_path=tmp_path / "second.log", extra_args=flags)
    try:
        again = second.start()  # the same ports: free again, and the ready line is this server's
        assert again.grpc_url == endpoints.grpc_url and again.triton_pid != endpoints.triton_pid
        assert ready(again.http_url)
        third = ServeProcess(tiny_engine, OPTIONS, log_path=tmp_path / "third.log", extra_args=flags)
        with pytest.raises(ServeError) as refused:
            third.start(timeout_s=BOUND_S)
        assert "already in use" in str(refused.value) and "ready models" not in str(refused.value), refused.value
        assert ready(again.http_url)  # the running server is untouched
    finally:
        second.stop()

