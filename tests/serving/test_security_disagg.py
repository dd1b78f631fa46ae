"""Security suite: the trust boundary of disaggregated serving, attacked through a real server (``--role both``).

* A client cannot reach the internal models: a direct `context` request (which would publish a region and hand out
  the NIXL agent metadata of that process) and a direct `generation` request (which would READ wherever its params
  point) are refused; no region is published.
* Params the orchestrator never made are refused even with a valid request token (a compromised or buggy caller):
  random bytes (a fuzz over many inputs), genuine params of another request (another prompt: another tenant's
  history), genuine params replayed, params of another deployment's key. Every one ends that request with an error;
  the engine stays alive, ready and exact.
* UCX listens on loopback only (the server's ``--address``), never on the machine's other interfaces.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from attack import ready

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse import SamplingParams
from dhisparse.serving import process_guard
from dhisparse.serving.internal_auth import AUTH_INPUT, CONTEXT, GENERATION, InternalAuth, request_subject
from dhisparse_client import DHiSparseClient, GenerationError

FUZZ_INPUTS = 40


@pytest.fixture(scope="module")
def deployment(tiny_engine, tmp_path_factory):
    """One server with every role; yields ``(ServedEngine, its internal key file)``."""
    from conftest import POOL_BYTES, ServedEngine, start_triton

    from dhisparse.serving.disagg_repository import fill_disaggregated_repository
    from dhisparse.serving.repository import RepositorySpec

    overrides = {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES}
    spec = RepositorySpec(tiny_engine, overrides, metrics_interval_ms=100)
    config, server, _ = start_triton(tmp_path_factory.mktemp("triton-trust"),
                                     lambda repo: fill_disaggregated_repository(spec, repo))
    key_file = Path(config.model_repository) / ".dhisparse" / "internal.key"
    try:
        yield ServedEngine(tiny_engine, overrides, config.http_url, config.grpc_url, config.metrics_url, server), \
            key_file
    finally:
        server.stop()


def _inputs(values: dict[str, np.ndarray]) -> list:
    import tritonclient.grpc as grpcclient

    types = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(object): "BYTES",
             np.dtype(np.uint8): "UINT8"}
    out = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _request(ids: list[int], max_tokens: int = 6) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
            "request_output_len": np.array([[max_tokens]], dtype=np.int32), "streaming": np.array([[True]])}


def _run(client: DHiSparseClient, model: str, values: dict[str, np.ndarray], request_id: str) -> list[int]:
    return [int(t) for arrays in client.stream_results(model, _inputs(values), ["output_ids"], request_id=request_id)
            for t in arrays["output_ids"].reshape(-1)]


def _context_phase(client, auth: InternalAuth, ids: list[int], request_id: str) -> np.ndarray:
    """A context phase as the orchestrator runs it (signed): the genuine params of this prompt."""
    import tritonclient.grpc as grpcclient

    values = {**_request(ids), "request_type": np.array([[b"context_only"]], dtype=object)}
    values.pop("streaming")
    values[AUTH_INPUT] = auth.token(CONTEXT, request_subject(request_id, values))
    grpc = grpcclient.InferenceServerClient(client.grpc_url)
    try:
        return grpc.infer("context", _inputs(values), request_id=request_id).as_numpy("context_phase_params")
    finally:
        grpc.close()


def _generation(client, auth: InternalAuth | None, ids: list[int], params: np.ndarray, request_id: str) -> list[int]:
    values = {**_request(ids), "request_type": np.array([[b"generation_only"]], dtype=object),
              "context_phase_params": params.reshape(1, -1).astype(np.uint8)}
    if auth is not None:
        values[AUTH_INPUT] = auth.token(GENERATION, request_subject(request_id, values))
    return _run(client, "generation", values, request_id)


def _published(served) -> float:
    return served.client().metrics().get("regions_published", 0.0)


def _healthy_and_exact(served, offline_llm, ids: list[int]) -> None:
    assert ready(served.http_url)
    expected = offline_llm.generate([ids], SamplingParams(max_tokens=6))[0].token_ids
    assert _run(served.client(), "disaggregated_serving_bls", _request(ids), "healthy") == expected


def test_clients_cannot_call_the_internal_models(deployment, offline_llm, tokenizer):
    served, _ = deployment
    client = served.client()
    ids = tokenizer.encode("To be, or not").ids
    before = _published(served)
    context = {**_request(ids), "request_type": np.array([[b"context_only"]], dtype=object)}
    context.pop("streaming")
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="context is internal"):
            grpc.infer("context", _inputs(context))
        forged = {**context, AUTH_INPUT: np.array([[b"1700000000.0:" + b"0" * 64]], dtype=object)}
        with pytest.raises(InferenceServerException, match="no valid dhisparse_auth"):
            grpc.infer("context", _inputs(forged))
    finally:
        grpc.close()
    with pytest.raises(GenerationError, match="generation is internal"):
        _generation(client, None, ids, np.zeros(64, np.uint8), "direct")
    assert _published(served) == before, "a client made the context side publish a region"
    _healthy_and_exact(served, offline_llm, ids)


def test_foreign_replayed_and_forged_params_fail_only_their_request(deployment, offline_llm, tokenizer):
    served, key_file = deployment
    client, auth = served.client(), InternalAuth.from_key_file(key_file)
    mine, theirs = tokenizer.encode("To be, or not").ids, tokenizer.encode("Or to take arms").ids
    genuine = _context_phase(client, auth, theirs, "victim-context")
    # another prompt, even of the same length, never imports the victim's history
    same_length = [(t + 1) % 300 for t in theirs]
    for ids in (mine, same_length):
        with pytest.raises(GenerationError, match="another prompt|prompt"):
            _generation(client, auth, ids, genuine, f"thief-{len(ids)}-{ids[0]}")
    expected = offline_llm.generate([theirs], SamplingParams(max_tokens=6))[0].token_ids
    assert _generation(client, auth, theirs, genuine, "owner") == expected  # the rightful request still works
    with pytest.raises(GenerationError, match="already imported"):
        _generation(client, auth, theirs, genuine, "replay")
    other_key = InternalAuth(bytes(range(32)))
    resigned = _context_phase(client, auth, theirs, "victim-2")[:, :-32]
    import hashlib
    import hmac

    forged = np.frombuffer(resigned.tobytes() + hmac.new(bytes(range(32)), resigned.tobytes(), hashlib.sha256).digest(),
                           np.uint8)
    with pytest.raises(GenerationError, match="bad tag"):
        _generation(client, auth, theirs, forged, "forged")
    with pytest.raises(GenerationError, match="generation is internal"):
        _generation(client, other_key, theirs, genuine, "other-deployment")
    _healthy_and_exact(served, offline_llm, mine)


def test_fuzzed_params_each_end_their_request_and_the_engine_lives(deployment, offline_llm, tokenizer):
    served, key_file = deployment
    client, auth = served.client(), InternalAuth.from_key_file(key_file)
    ids = tokenizer.encode("To be, or not").ids
    genuine = _context_phase(client, auth, ids, "fuzz-seed").reshape(-1)
    rng = random.Random(29)
    cases = [np.frombuffer(rng.randbytes(rng.randrange(0, 600)), np.uint8) for _ in range(FUZZ_INPUTS // 2)]
    for _ in range(FUZZ_INPUTS - len(cases)):  # genuine params with a few bytes flipped
        mutated = genuine.copy()
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(mutated.size)] ^= rng.randrange(1, 256)
        cases.append(mutated)
    for i, case in enumerate(cases):
        with pytest.raises(GenerationError, match="context_phase_params|Triton|shape|empty"):
            _generation(client, auth, ids, case if case.size else np.zeros(1, np.uint8), f"fuzz-{i}")
    assert served.client().metrics().get("engine_alive", 1.0) == 1.0
    _healthy_and_exact(served, offline_llm, ids)


def _listening(pid: int) -> set[str]:
    """Local addresses ("ip:port", IPv4 hex from /proc/net/tcp) of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = fd.readlink().name if hasattr(fd, "readlink") else ""
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                out.add(fields[1])
    return out


def test_ucx_listens_on_the_servers_interface_only(deployment, tokenizer):
    served, key_file = deployment
    _context_phase(served.client(), InternalAuth.from_key_file(key_file), tokenizer.encode("To be").ids, "warm")
    stubs = [pid for pid in process_guard.group_processes(served.server.pid) if pid != served.server.pid]
    addresses = set().union(*(_listening(pid) for pid in stubs))
    assert addresses, "the NIXL agents' UCX listeners (one per agent)"
    loopback = "0100007F"  # 127.0.0.1 in /proc/net/tcp's byte order
    assert all(a.split(":")[0] in (loopback, "00000000000000000000000001000000") for a in addresses), addresses
