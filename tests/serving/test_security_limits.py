"""Security suite: oversized requests are refused at the edge, before any heavy work, and stall nobody else.

Each attack the issue measured (a 32 MB prompt, ``num_return_sequences`` = 3000, a 128 KB ``bad_words`` list, a
40 MB ``embedding_bias``) plus a batch beyond the limit is sent to the real server, through the ensemble, the BLS
model and the engine model: each gets an error naming the limit. Refusal time is compared with a small request's
latency (a ratio, measured in this run); another client's latency while the attacks run in a loop is compared with
its latency alone (medians of repeats, the ratio asserted with a generous bound for this shared machine and printed).
Within the limits, long stop / bad word lists still work, processed once per request (``sampling/request_tables``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

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

    # The attacker runs in its own process at the lowest CPU priority: on this 2-core machine its client-side work
    # (building and sending 32 MB messages) would otherwise compete with the server for the victim's CPU, which a
    # remote attacker's does not. What the server does for each attack runs at normal priority.
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, served.grpc_url], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.nice(19), env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    rounds: list[str] = []
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "attacking"
        reader = threading.Thread(target=lambda: rounds.extend(line.strip() for line in attacker.stdout),
                                  daemon=True)
        reader.start()
        samples = []
        deadline = time.monotonic() + 300  # a hang guard
        while (len(samples) < 3 * REPEATS or not rounds) and time.monotonic() < deadline:
            samples.append(_victim_latency(served))  # until every attack kind ran at least once meanwhile
            time.sleep(0.1)
        during = statistics.median(samples)
    finally:
        attacker.terminate()
        attacker.wait(timeout=120)
    sent = len(prepared) * len(rounds)
    ratio = during / alone
    print(f"another client's latency: alone {alone * 1000:.0f} ms, during the attacks {during * 1000:.0f} ms "
          f"(ratio {ratio:.2f}, median of {len(samples)}; {sent} attacks sent meanwhile)")
    assert rounds, "the attacks never completed a round"
    assert ratio < RATIO_BOUND, (alone, during)


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
