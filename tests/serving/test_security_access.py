"""Security suite: what a client may ask of the real server (the session server, started as dhisparse-serve runs it).

* No remote model control: loading a model with a ``file:1/model.py`` override (which would run its Python), unloading
  the engine's model, listing the repository, registering shared memory, changing trace or log settings: refused over
  HTTP and over gRPC (a wrong admin key too); the code never runs, the engine keeps serving.
* Shared memory of the Python backend is owner-only.
* Cancels only reach the caller's own requests: another connection's ``stop`` with the victim's request id, and a
  forged ``cancel_request_id`` (the BLS models' control input), are refused; the victim's stream completes exactly.
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from attack import BOUND_S, Outcome, ready, stream_tokens

from dhisparse.serving import process_guard
from dhisparse_client import DHiSparseClient, GenerationError, GenerationOptions

PAYLOAD = "import pathlib\npathlib.Path({marker!r}).write_text('owned')\nclass TritonPythonModel:\n    pass\n"


def _http(url: str, method: str = "POST", body: dict | None = None, headers: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else b"" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                             **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _load_body(marker: Path) -> dict:
    code = PAYLOAD.format(marker=str(marker)).encode()
    config = json.dumps({"name": "owned", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "y", "data_type": "TYPE_INT32", "dims": [1]}]})
    return {"parameters": {"config": config, "file:1/model.py": base64.b64encode(code).decode()}}


def _still_serving(served) -> None:
    assert ready(served.http_url)
    assert _http(f"http://{served.http_url}/v2/models/dhisparse/ready", "GET")[0] == 200
    assert list(served.client().stream("To be", GenerationOptions(max_tokens=3)))


def test_model_control_over_http_is_refused(served, tmp_path):
    marker = tmp_path / "owned"
    base = f"http://{served.http_url}/v2"
    attacks = [("POST", f"{base}/repository/models/owned/load", _load_body(marker)),
               ("POST", f"{base}/repository/models/dhisparse/unload", {}),
               ("POST", f"{base}/repository/models/dhisparse/load", {}),
               ("POST", f"{base}/repository/index", {}),
               ("POST", f"{base}/systemsharedmemory/region/owned/register", {"key": "dhisparse_x", "offset": 0,
                                                                            "byte_size": 64}),
               ("GET", f"{base}/systemsharedmemory/status", None),
               ("POST", f"{base}/trace/setting", {"trace_file": str(tmp_path / "trace")}),
               ("POST", f"{base}/logging", {"log_file": str(tmp_path / "log")})]
    for method, url, body in attacks:
        for headers in ({}, {"dhisparse-admin-key": "guessed-key-0123456789"}):
            status, text = _http(url, method, body, headers)
            assert status == 403 and "restricted" in text, (url, headers, status, text)
    assert not marker.exists(), "the uploaded model.py ran"
    _still_serving(served)


def test_model_control_over_grpc_is_refused(served, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    marker = tmp_path / "owned"
    body = _load_body(marker)["parameters"]
    client = grpcclient.InferenceServerClient(served.grpc_url)
    attacks = {
        "load": lambda h: client.load_model("owned", headers=h, config=body["config"],
                                            files={"file:1/model.py": PAYLOAD.format(marker=str(marker)).encode()}),
        "unload": lambda h: client.unload_model("dhisparse", headers=h),
        "index": lambda h: client.get_model_repository_index(headers=h),
        "shm": lambda h: client.register_system_shared_memory("owned", "dhisparse_x", 64, headers=h),
        "trace": lambda h: client.update_trace_settings(settings={"trace_file": str(tmp_path / "t")}, headers=h),
        "log": lambda h: client.update_log_settings({"log_file": str(tmp_path / "l")}, headers=h),
    }
    try:
        for attack in attacks.values():
            for headers in (None, {"triton-grpc-protocol-dhisparse-admin-key": "guessed-key-0123456789"}):
                with pytest.raises(InferenceServerException, match="restricted"):
                    attack(headers)
        assert client.is_model_ready("dhisparse")
    finally:
        client.close()
    assert not marker.exists(), "the uploaded model.py ran"
    _still_serving(served)


def test_backend_shared_memory_is_owner_only(served):
    regions = process_guard.shm_regions(served.server.shm_prefix)
    assert regions, "the Python backend's regions"
    assert all(path.stat().st_mode & 0o077 == 0 for path in regions), [oct(p.stat().st_mode) for p in regions]


def _control(served, values: dict, request_id: str) -> str:
    """Send a control request to `dhisparse` as another client would; the error it gets."""
    client = DHiSparseClient(served.grpc_url, timeout_s=BOUND_S)
    with pytest.raises(GenerationError) as error:
        list(client.stream_raw("dhisparse", values, "output_ids"))
    return str(error.value)


def test_another_connection_cannot_stop_or_cancel_my_request(served, prompt_runs_long, offline_llm):
    from dhisparse import SamplingParams

    victim = Outcome()
    thread = threading.Thread(target=stream_tokens, args=(served.grpc_url, prompt_runs_long, 60, victim),
                              kwargs={"request_id": "victim-request"}, daemon=True)
    thread.start()
    assert victim.first.wait(BOUND_S)
    import tritonclient.grpc as grpcclient

    stop = grpcclient.InferInput("stop", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))
    client = DHiSparseClient(served.grpc_url, timeout_s=BOUND_S)
    with pytest.raises(GenerationError, match="stop by request id is disabled"):
        list(client.stream_results("dhisparse", [stop], ["output_ids"], request_id="victim-request"))
    message = _control(served, {"cancel_request_id": "victim-request"}, "attacker")
    assert "cancel_request_id is a control input" in message, message
    thread.join(BOUND_S)
    assert victim.finished and victim.error is None, victim.error
    expected = offline_llm.generate([prompt_runs_long], SamplingParams(max_tokens=60))[0].token_ids
    assert victim.tokens == expected  # untouched by either attempt
