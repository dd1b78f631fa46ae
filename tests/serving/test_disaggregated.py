"""Disaggregated serving through the real Triton server: `context` and `generation` engine processes joined by NIXL,
orchestrated by `disaggregated_serving_bls`, used by the `ensemble` in place of the LLM model.

Greedy output equals offline co-located `LLM.generate`, streamed (the first token arrives from the context phase,
before the generation phase's tokens) and not streamed; the generation model exports transfer metrics.
"""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.serving.tokenization import TokenBytes

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse_client import GenerationError, GenerationOptions

PROMPTS = ["To be, or not to be", "the slings and arrows of outrageous fortune", "Or to take arms #3"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def disaggregated(tiny_engine, tmp_path_factory):
    from conftest import POOL_BYTES, ServedEngine, start_triton

    from dhisparse.disagg.repository import fill_disaggregated_repository
    from dhisparse.serving.repository import RepositorySpec

    overrides = {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES}
    spec = RepositorySpec(tiny_engine, overrides, metrics_interval_ms=100)
    config, server, models = start_triton(tmp_path_factory.mktemp("triton-disagg"),
                                          lambda repo: fill_disaggregated_repository(spec, repo))
    assert set(models) >= {"context", "generation", "disaggregated_serving_bls", "ensemble"}
    try:
        yield ServedEngine(tiny_engine, overrides, config.http_url, config.grpc_url, config.metrics_url, server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expected(offline_llm, tokenizer):
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    outputs = offline_llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
    return ids, [o.token_ids for o in outputs], [TokenBytes(tokenizer).decode(o.token_ids) for o in outputs]


def test_orchestrator_streams_the_first_token_then_the_generation_tokens(disaggregated, expected):
    ids, tokens, _ = expected
    client = disaggregated.client()
    for prompt_ids, want in zip(ids, tokens, strict=True):
        chunks = list(client.stream_token_ids(prompt_ids, GenerationOptions(max_tokens=MAX_TOKENS),
                                              model="disaggregated_serving_bls"))
        assert chunks[0] == want[:1]  # the context phase's token, sent on its own
        assert [t for c in chunks for t in c] == want


def test_ensemble_over_the_orchestrator_matches_offline(disaggregated, expected):
    _, _, texts = expected
    client = disaggregated.client("ensemble")
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert b"".join(client.stream(prompt, GenerationOptions(max_tokens=MAX_TOKENS))) == text
    assert client.generate(PROMPTS[0], GenerationOptions(max_tokens=MAX_TOKENS)) == texts[0]
    metrics = disaggregated.client().metrics()
    assert metrics["transfers"] >= len(PROMPTS) + 1 and metrics["transfer_bytes"] > 0
    assert metrics.get("transfers_failed", 0.0) == 0.0
    assert metrics["context_prefill_seconds"] > 0 and metrics["transfer_seconds"] > 0  # the TTFT split


def test_malformed_context_phase_params_give_a_clear_error(disaggregated, expected):
    import numpy as np
    import tritonclient.grpc as grpcclient

    ids, _, _ = expected
    arrays = {"input_ids": np.array([ids[0]], dtype=np.int32), "input_lengths": np.array([[len(ids[0])]], np.int32),
              "request_output_len": np.array([[4]], dtype=np.int32), "streaming": np.array([[True]]),
              "request_type": np.array([[b"generation_only"]], dtype=object),
              "context_phase_params": np.array([[1, 2, 3]], dtype=np.uint8)}
    datatypes = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(object): "BYTES",
                 np.dtype(np.uint8): "UINT8"}
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatypes[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with pytest.raises(GenerationError, match="context_phase_params"):
        list(disaggregated.client().stream_inputs("generation", inputs, "output_ids"))


def test_multi_token_stop_sequence_ends_the_generation_phase(disaggregated, expected):
    ids, tokens, _ = expected
    want = tokens[0]
    end = next(i for i in range(3, len(want)) if all(want[j:j + 2] != want[i - 1:i + 1] for j in range(i - 1)))
    stop = want[end - 1 : end + 1]  # a 2-token sequence whose first occurrence ends at position `end`
    values = {"input_ids": ids[0], "input_lengths": len(ids[0]), "request_output_len": MAX_TOKENS,
              "streaming": True, "stop_words_list": [stop, [2, -1]]}
    chunks = list(disaggregated.client().stream_raw("disaggregated_serving_bls", values, "output_ids"))
    assert [int(t) for c in chunks for t in c.reshape(-1)] == want[: end + 1]  # the stop sequence is kept


def test_cancelled_orchestrator_stream_frees_the_generation_side(disaggregated, prompt_runs_long):
    import time

    from conftest import LONG
    from idle import IDLE, settle, wait_idle

    client = disaggregated.client()
    settle(client)
    before = client.metrics()
    stream = client.stream_token_ids(prompt_runs_long, GenerationOptions(max_tokens=LONG),
                                     model="disaggregated_serving_bls")
    for _ in range(3):
        next(stream)
    deadline = time.monotonic() + 20
    while client.metrics().get("kv_requests_running", 0.0) < 1.0:  # the generation side really holds memory
        assert time.monotonic() < deadline, "the generation request never ran"
        time.sleep(0.05)
    stream.close()  # cancels the orchestrator's request; it forwards the cancellation to `generation`
    assert wait_idle(client) == IDLE
    after = client.metrics()
    assert after["requests_aborted"] - before.get("requests_aborted", 0.0) == 1.0
    assert after["serving_cancelled_requests"] - before.get("serving_cancelled_requests", 0.0) == 1.0
    assert after["generated_tokens"] - before.get("generated_tokens", 0.0) < LONG
