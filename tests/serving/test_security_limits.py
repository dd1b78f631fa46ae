"""Security suite: oversized requests are refused at the edge, before any heavy work, and stall nobody else.

Each attack the issue measured (a 32 MB prompt, ``num_return_sequences`` = 3000, a 128 KB ``bad_words`` list, a
40 MB ``embedding_bias``) plus a batch beyond the limit is sent to the real server, through the ensemble, the BLS
model and the engine model: each gets an error naming the limit. Refusal time is compared with a small request's
latency (a ratio, measured in this run); another client's latency while the attacks run in a loop is compared with
its latency alone (medians of repeats, the ratio asserted with a generous bound for this shared machine and printed).
Within the limits, long stop / bad word lists still work, processed once per request (``sampling/request_tables``).

The same limits hold at the OpenAI port (`dhisparse.serving.openai.edge_limits`): its front end runs here in this
process beside the session's Triton server (as `dhisparse-serve --openai-port` runs it, on its own thread and event
loop), with the limits the Triton models were given. Each oversized OpenAI request (a body over
``max_request_bytes``, declared or chunked; prompts, chat messages, ``n``, stop strings, ``logit_bias`` and token-id
prompts over their limits) gets OpenAI's error JSON naming the limit, about as fast as a small request is answered,
while another OpenAI client's latency stays within the same bound as above. A prompt that the operator's limits let
through but that takes long to tokenise is tokenised on a worker thread: other clients are answered meanwhile.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import numpy as np
import pytest

from dhisparse_client import DHiSparseClient, GenerationError, GenerationOptions

MB = 1 << 20
REPEATS = 7
RATIO_BOUND = 3.0  # the target is 2x; this shared 2-core machine's noise gets some room (figures printed)


def _inputs(values: dict[str, np.ndarray]) -> list:
    """tritonclient inputs serialised once (an attacker re-sends the same bytes without paying to build them)."""
    import tritonclient.grpc as grpcclient

    types = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(bool): "BOOL",
             np.dtype(object): "BYTES"}
    out = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _text(value: str | bytes) -> np.ndarray:
    return np.array([[value if isinstance(value, bytes) else value.encode()]], dtype=object)


def _int(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def attacks() -> dict[str, tuple[str, dict[str, np.ndarray], str]]:
    """name -> (model, inputs, the limit its error must name)."""
    words = np.array([[f"w{i:05d}".encode() for i in range(128 * 1024 // 6)]], dtype=object)  # ~128 KB of words
    ids = list(range(3, 40))
    token_request = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": _int(len(ids)),
                     "request_output_len": _int(4)}
    return {
        "32 MB prompt, ensemble": ("ensemble", {"text_input": _text(b"x" * (32 * MB)), "max_tokens": _int(4)},
                                   "max_request_bytes"),
        "32 MB prompt, bls": ("dhisparse_bls", {"text_input": _text(b"x" * (32 * MB)), "max_tokens": _int(4)},
                              "max_request_bytes"),
        "100 KB prompt, ensemble": ("ensemble", {"text_input": _text(b"x" * (100 * 1024)), "max_tokens": _int(4)},
                                    "max_prompt_bytes"),
        "3000 sequences, ensemble": ("ensemble", {"text_input": _text("To be"), "max_tokens": _int(4),
                                                  "num_return_sequences": _int(3000)}, "max_num_return_sequences"),
        "3000 sequences, dhisparse": ("dhisparse", {**token_request, "num_return_sequences": _int(3000)},
                                      "max_num_return_sequences"),
        "128 KB bad_words, ensemble": ("ensemble", {"text_input": _text("To be"), "max_tokens": _int(4),
                                                    "bad_words": words}, "max_words"),
        "128 KB bad_words_list, dhisparse": ("dhisparse", {**token_request, "bad_words_list": np.stack(
            [np.arange(32768, dtype=np.int32) % 300, np.arange(1, 32769, dtype=np.int32)])[None]}, "max_words"),
        "40 MB embedding_bias, dhisparse": ("dhisparse", {**token_request, "embedding_bias": np.ones(
            (1, 10 * MB), dtype=np.float32)}, "max_request_bytes"),
        "bias words, ensemble": ("ensemble", {"text_input": _text("To be"), "max_tokens": _int(4),
                                              "embedding_bias_words": words[:, :1000],
                                              "embedding_bias_weights": np.ones((1, 1000), np.float32)},
                                 "max_bias_words"),
    }


def _refusal(client: DHiSparseClient, model: str, inputs: list) -> tuple[float, str]:
    began = time.perf_counter()
    with pytest.raises(GenerationError) as error:
        list(client.stream_results(model, inputs))
    return time.perf_counter() - began, str(error.value)


def _victim_latency(served) -> float:
    client = served.client()
    began = time.perf_counter()
    chunks = list(client.stream("To be", GenerationOptions(max_tokens=8)))
    assert chunks
    return time.perf_counter() - began


def test_oversized_requests_are_refused_at_once_naming_the_limit(served):
    client = DHiSparseClient(served.grpc_url, timeout_s=120)
    prepared = {name: (model, _inputs(values), limit) for name, (model, values, limit) in attacks().items()}
    alone = statistics.median(_victim_latency(served) for _ in range(REPEATS))
    refusals = {}
    for name, (model, inputs, limit) in prepared.items():
        times = []
        for _ in range(3):
            seconds, message = _refusal(client, model, inputs)
            assert f"limit {limit}" in message, (name, message)
            times.append(seconds)
        refusals[name] = statistics.median(times)
    # The floor of a large payload: the same bytes sent to a model that does not exist, which tritonserver refuses
    # once it has received the message (no flag of 2.51 bounds a request's size before that).
    floor = {}
    for name, (_, inputs, _) in prepared.items():
        if "MB" in name:
            floor[name] = statistics.median(_refusal(client, "no_such_model", inputs)[0] for _ in range(3))
    print(f"small request alone: {alone * 1000:.0f} ms (median of {REPEATS}); refusals (median of 3): "
          + ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in refusals.items())
          + "; the large payloads to a model that does not exist: "
          + ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in floor.items()))
    # Refused before any heavy work (tokenising, threads, tables): the small attacks cost about a small request; the
    # large ones about what receiving their payload costs anyway (plus its copy into the Python backend).
    small = {n: s for n, s in refusals.items() if n not in floor}
    assert max(small.values()) < 5 * alone, small
    assert all(refusals[n] < 10 * floor[n] for n in floor), (refusals, floor)

    samples, rounds = _latency_under_attack(ATTACKER, served.grpc_url, lambda: _victim_latency(served))
    during = statistics.median(samples)
    sent = len(prepared) * len(rounds)
    ratio = during / alone
    print(f"another client's latency: alone {alone * 1000:.0f} ms, during the attacks {during * 1000:.0f} ms "
          f"(ratio {ratio:.2f}, median of {len(samples)}; {sent} attacks sent meanwhile)")
    assert rounds, "the attacks never completed a round"
    assert ratio < RATIO_BOUND, (alone, during)


def _latency_under_attack(script: str, target: str, sample) -> tuple[list[float], list[str]]:
    """Another client's latencies (``sample()``) while ``script`` attacks ``target`` from its own process, until
    ``3 * REPEATS`` samples and at least one whole round of attacks; returns the samples and the rounds' lines.

    The attacker runs at the lowest CPU priority: on this 2-core machine its client-side work (building and sending
    32 MB messages) would otherwise compete with the server for the victim's CPU, which a remote attacker's does not.
    What the server does for each attack runs at normal priority."""
    attacker = subprocess.Popen([sys.executable, "-c", script, target], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.nice(19), env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    rounds: list[str] = []
    samples: list[float] = []
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "attacking"
        reader = threading.Thread(target=lambda: rounds.extend(line.strip() for line in attacker.stdout),
                                  daemon=True)
        reader.start()
        deadline = time.monotonic() + 300  # a hang guard
        while (len(samples) < 3 * REPEATS or not rounds) and time.monotonic() < deadline:
            samples.append(sample())  # until every attack kind ran at least once meanwhile
            time.sleep(0.1)
    finally:
        attacker.terminate()
        attacker.wait(timeout=120)
    return samples, rounds


ATTACKER = """
import signal, sys
from test_security_limits import attacks, _inputs
from dhisparse_client import DHiSparseClient, GenerationError
client = DHiSparseClient(sys.argv[1], timeout_s=120)
prepared = [(model, _inputs(values)) for model, values, _ in attacks().values()]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("attacking", flush=True)
while True:
    for model, inputs in prepared:
        try:
            list(client.stream_results(model, inputs))
        except GenerationError:
            pass
    print("round", flush=True)
"""


def test_batch_beyond_the_limit_is_refused(served):
    client = DHiSparseClient(served.grpc_url, timeout_s=120)
    batch = {"text_input": np.array([[b"To be"]] * 9, dtype=object), "max_tokens": np.full((9, 1), 4, np.int32)}
    for model in ("ensemble", "dhisparse_bls"):
        _, message = _refusal(client, model, _inputs(batch))
        assert "batch" in message and "8" in message, message


def test_long_word_lists_within_the_limits_still_work(served, offline_llm, tokenizer):
    from dhisparse import SamplingParams

    ids = tokenizer.encode("To be, or not").ids
    bad = [[t] for t in range(100, 300)] + [[5, 6, 7]] * 50  # 250 words: under max_words
    params = SamplingParams(max_tokens=12, bad_words=tuple(tuple(w) for w in bad))
    expected = offline_llm.generate([ids], params)[0].token_ids
    offsets = np.cumsum([len(w) for w in bad]).astype(np.int32)
    flat = np.array([t for w in bad for t in w], dtype=np.int32)
    words = np.full((1, 2, flat.size), -1, dtype=np.int32)
    words[0, 0], words[0, 1, : offsets.size] = flat, offsets
    values = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": _int(len(ids)),
              "request_output_len": _int(12), "streaming": np.array([[True]]), "bad_words_list": words}
    client = DHiSparseClient(served.grpc_url, timeout_s=120)
    got = [int(t) for arrays in client.stream_results("dhisparse", _inputs(values), ["output_ids"])
           for t in arrays["output_ids"].reshape(-1)]
    assert got == expected and not set(got) & set(range(100, 300))


# ------------------------------------------------------------------------------------------------ the OpenAI port
MODEL = "tiny"


def openai_attacks() -> dict[str, tuple[str, bytes, bool, int, str]]:
    """name -> (route, JSON body, sent chunked (no Content-Length), the HTTP status, the limit its error must name)."""
    def body(**fields) -> bytes:
        return json.dumps({"model": MODEL, "max_tokens": 4, **fields}).encode()

    huge = body(prompt="x" * (32 * MB))
    return {
        "32 MB prompt": ("completions", huge, False, 413, "max_request_bytes"),
        "32 MB prompt, chunked": ("completions", huge, True, 413, "max_request_bytes"),
        "100 KB prompt": ("completions", body(prompt="x" * (100 * 1024)), False, 400, "max_prompt_bytes"),
        "100 KB chat message": ("chat/completions", body(messages=[{"role": "user", "content": "x" * (100 * 1024)}]),
                                False, 400, "max_prompt_bytes"),
        "20000 chat messages": ("chat/completions", body(messages=[{"role": "user", "content": ""}] * 20000), False,
                                400, "max_prompt_bytes"),
        "9 prompts": ("completions", body(prompt=["To be"] * 9), False, 400, "max_batch"),
        "n = 3000": ("completions", body(prompt="To be", n=3000), False, 400, "max_num_return_sequences"),
        "1000 stop strings": ("completions", body(prompt="To be", stop=[f"s{i}" for i in range(1000)]), False, 400,
                              "max_words"),
        "100 KB stop string": ("completions", body(prompt="To be", stop=["s" * (100 * 1024)]), False, 400,
                               "max_word_bytes"),
        "100000 logit_bias entries": ("completions", body(prompt="To be", logit_bias={str(i): 1
                                                                                    for i in range(100000)}),
                                      False, 400, "vocab_size"),
        "50000 token ids": ("completions", body(prompt=list(range(3, 103)) * 500), False, 400, "max_prompt_tokens"),
    }


def post(client: httpx2.Client, url: str, route: str, content: bytes, chunked: bool = False) -> httpx2.Response:
    if chunked:  # a generator body goes out with Transfer-Encoding: chunked, so the server cannot know its size
        data = content
        content = (data[i: i + (1 << 16)] for i in range(0, len(data), 1 << 16))  # type: ignore[assignment]
    return client.post(f"{url}/{route}", content=content, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def openai_front(served):
    """The OpenAI front end of the session's server, checking the limits its Triton models were given."""
    from dhisparse.serving.openai.server import OpenAIOptions, OpenAIServer
    from dhisparse.serving.repository import RepositorySpec

    limits = RepositorySpec(served.engine_dir, served.overrides).resolved_limits()
    front = OpenAIServer(served.engine_dir, served.grpc_url, OpenAIOptions(0, model_name=MODEL), served.overrides,
                         limits)
    front.start()
    try:
        yield front
    finally:
        front.stop()


def _openai_victim_latency(client: httpx2.Client, url: str) -> float:
    began = time.perf_counter()
    reply = post(client, url, "completions", json.dumps({"model": MODEL, "prompt": "To be", "max_tokens": 8}).encode())
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
    return time.perf_counter() - began


def test_oversized_openai_requests_are_refused_at_once_naming_the_limit(openai_front):
    url = openai_front.url
    prepared = openai_attacks()
    with httpx2.Client(timeout=120) as client:
        alone = statistics.median(_openai_victim_latency(client, url) for _ in range(REPEATS))
        refusals = {}
        for name, (route, content, chunked, status, limit) in prepared.items():
            times = []
            for _ in range(3):
                began = time.perf_counter()
                reply = post(client, url, route, content, chunked)
                times.append(time.perf_counter() - began)
                error = reply.json()["error"]
                assert reply.status_code == status and f"limit {limit}" in error["message"], (name, reply.text)
                assert error["type"] == "invalid_request_error" and error["code"] == "limit_exceeded", error
            refusals[name] = statistics.median(times)
        print(f"OpenAI: small request alone: {alone * 1000:.0f} ms (median of {REPEATS}); refusals (median of 3): "
              + ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in refusals.items()))
        # Refused before any heavy work: about a small request's time; a large body about what receiving (and, under
        # max_request_bytes, decoding) its bytes costs anyway
        small = {n: seconds for n, seconds in refusals.items() if len(prepared[n][1]) < MB}
        assert max(small.values()) < 5 * alone, small
        assert max(refusals.values()) < 10 * alone, refusals

        samples, rounds = _latency_under_attack(OPENAI_ATTACKER, url, lambda: _openai_victim_latency(client, url))
        during = statistics.median(samples)
    ratio = during / alone
    print(f"another OpenAI client's latency: alone {alone * 1000:.0f} ms, during the attacks {during * 1000:.0f} ms "
          f"(ratio {ratio:.2f}, median of {len(samples)}; {len(prepared) * len(rounds)} attacks sent meanwhile)")
    assert rounds, "the attacks never completed a round"
    assert all(line == "round" for line in rounds), rounds  # every attack got its refusal, every round
    assert ratio < RATIO_BOUND, (alone, during)


OPENAI_ATTACKER = """
import signal, sys
import httpx2
from test_security_limits import openai_attacks, post
prepared = list(openai_attacks().values())
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("attacking", flush=True)
with httpx2.Client(timeout=120) as client:
    while True:
        statuses = [(post(client, sys.argv[1], route, content, chunked).status_code, status)
                    for route, content, chunked, status, _ in prepared]
        print("round" if all(got == want for got, want in statuses) else f"unexpected {statuses}", flush=True)
"""


def test_a_long_tokenisation_does_not_hold_up_other_clients(served):
    """An operator raised max_prompt_bytes, so a 400 KB prompt is tokenised (about a second here) before its token
    count refuses it. Meanwhile another client's requests are answered: none waits for the tokenisation."""
    from dhisparse.serving.limits import RequestLimits
    from dhisparse.serving.openai.server import OpenAIOptions, OpenAIServer

    front = OpenAIServer(served.engine_dir, served.grpc_url, OpenAIOptions(0, model_name=MODEL), served.overrides,
                         RequestLimits(max_prompt_bytes=1 * MB))
    front.start()
    try:
        url = front.url
        prompt = json.dumps({"model": MODEL, "prompt": "To be, or not to be naive " * (400 * 1024 // 26)}).encode()
        refusal: list[httpx2.Response] = []
        with httpx2.Client(timeout=120) as attacker, httpx2.Client(timeout=120) as victim:
            assert victim.get(f"{url}/models").status_code == 200  # connected before the clock starts
            sender = threading.Thread(target=lambda: refusal.append(post(attacker, url, "completions", prompt)))
            began = time.perf_counter()
            sender.start()
            latencies = []
            while sender.is_alive():
                asked = time.perf_counter()
                assert victim.get(f"{url}/models").status_code == 200
                latencies.append(time.perf_counter() - asked)
            took = time.perf_counter() - began
            sender.join()
        assert refusal[0].status_code == 400 and "limit max_prompt_tokens" in refusal[0].json()["error"]["message"]
        print(f"a 400 KB prompt tokenised and refused in {took * 1000:.0f} ms; meanwhile {len(latencies)} requests "
              f"of another client, the slowest {max(latencies) * 1000:.0f} ms")
        # Tokenised on the event loop, the other client's requests would wait for all of it (one reply, as slow).
        assert len(latencies) >= 10 and max(latencies) < took / 4, (took, latencies)
    finally:
        front.stop()
