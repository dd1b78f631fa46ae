"""Security suite: a hardened deployment, started the way an operator would (`dhisparse-serve` flags).

* The operator's Triton: ``--triton-root`` runs the server, libraries and Python backend of a directory laid out as an
  NGC container's ``/opt/tritonserver`` (made here from the bundled wheel: the same code path); the ready line names
  its version and a release older than the advisories' fix is warned about.
* ``--model-repo``: a foreign non-empty directory is refused untouched; ours is reused, and entries that are not ours
  any more are removed (never served).
* gRPC TLS: a TLS client is served, a plaintext one is not; ``--no-http`` serves gRPC alone (tritonserver has no
  HTTP TLS); ``--admin-key-file`` opens the admin APIs to holders of
  the key only (HTTP header ``dhisparse-admin-key``).
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import POOL_BYTES

from dhisparse.serving import process_guard
from dhisparse.serving.internal_auth import read_key_file, write_key_file
from dhisparse.serving.triton_install import TritonInstall, make_root
from dhisparse_client.serve_process import ServeError, ServeProcess

OPTIONS = {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES, "page_rows": 16}


def _certificate(directory) -> tuple:
    if shutil.which("openssl") is None:
        pytest.skip("openssl (to make a test certificate) is not installed")
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def _index(http_url: str, key: str | None) -> int:
    headers = {"dhisparse-admin-key": key} if key else {}
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_foreign_model_repository_is_refused_untouched(tiny_engine, tmp_path):
    foreign = tmp_path / "repo"
    (foreign / "someone_elses_model" / "1").mkdir(parents=True)
    (foreign / "notes.txt").write_text("precious")
    serve = ServeProcess(tiny_engine, OPTIONS, extra_args=["--model-repo", str(foreign)])
    with pytest.raises(ServeError, match="not empty and was not written by dhisparse-serve"):
        serve.start(timeout_s=120)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt", "someone_elses_model"]


def test_operators_triton_with_tls_admin_key_and_our_repository(tiny_engine, prompt_runs_long, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    root = make_root(TritonInstall.locate(), tmp_path / "opt-tritonserver")  # an NGC-shaped installation
    cert, key = _certificate(tmp_path)
    admin = read_key_file(write_key_file(tmp_path / "admin.key")).hex()
    repo = tmp_path / "repo"
    flags = ["--triton-root", str(root), "--model-repo", str(repo), "--grpc-tls-cert", str(cert), "--grpc-tls-key",
             str(key), "--admin-key-file", str(tmp_path / "admin.key")]
    # gRPC only (HTTP off: tritonserver has no HTTP TLS); readiness is probed over TLS gRPC
    first = ServeProcess(tiny_engine, OPTIONS, log_path=tmp_path / "first.log", extra_args=[*flags, "--no-http"])
    grpc_only = first.start()
    http_port = int(grpc_only.http_url.rsplit(":", 1)[1])
    assert process_guard.listens(grpc_only.triton_pid, http_port) is False
    assert process_guard.listens(grpc_only.triton_pid, int(grpc_only.grpc_url.rsplit(":", 1)[1]))
    first.stop()
    (repo / "left_over_model" / "1").mkdir(parents=True)  # not ours any more: removed at the next start
    serve = ServeProcess(tiny_engine, OPTIONS, log_path=tmp_path / "server.log", extra_args=flags)
    endpoints = serve.start()
    try:
        output = serve.output_tail(60)
        assert "triton=2.51.0" in output and "predates Triton 2.59" in output, output
        argv = Path(f"/proc/{endpoints.triton_pid}/cmdline").read_bytes().split(b"\0")
        assert Path(argv[0].decode()) == root.resolve() / "bin" / "tritonserver"  # the operator's server runs
        assert f"--backend-directory={root.resolve() / 'backends'}".encode() in argv
        assert not (repo / "left_over_model").exists()
        secure = grpcclient.InferenceServerClient(endpoints.grpc_url, ssl=True, root_certificates=str(cert))
        try:
            assert secure.is_model_ready("dhisparse")
        finally:
            secure.close()
        plain = grpcclient.InferenceServerClient(endpoints.grpc_url)
        try:
            with pytest.raises(InferenceServerException):
                plain.is_server_ready(client_timeout=5)
        finally:
            plain.close()
        assert _index(endpoints.http_url, None) == 403
        assert _index(endpoints.http_url, "x" * 64) == 403
        assert _index(endpoints.http_url, admin) == 200  # the operator, with the key
    finally:
        serve.stop()


def test_host_bytes_beyond_the_machine_stops_the_start_naming_it(tiny_engine, tmp_path):
    serve = ServeProcess(tiny_engine, {**OPTIONS, "host_bytes": 10**15}, log_path=tmp_path / "server.log")
    with pytest.raises(ServeError) as refused:
        serve.start(timeout_s=300)
    assert "host_bytes 1000000000000000 exceeds the memory this process may use" in str(refused.value), refused.value
    assert "ready models" not in str(refused.value)
