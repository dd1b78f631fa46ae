"""Disaggregated serving through real Triton servers: `context` and `generation` engine processes joined by NIXL,
orchestrated by `disaggregated_serving_bls`, used by the `ensemble` in place of the LLM model.

Two tritonservers on loopback, as on two hosts: one serves only `context` (``--role context``), the other
`generation`, the orchestrator and the text models (``--role generation --context-url``); the orchestrator calls the
context server over gRPC and the history moves by NIXL READ between the two servers' engine processes.
``DHISPARSE_DISAGG_TOPOLOGY=one`` runs the same tests against one server holding every model (``--role both``,
the orchestrator calls `context` through BLS requests).

Greedy output equals offline co-located `LLM.generate`, streamed (the first token arrives from the context phase,
before the generation phase's tokens) and not streamed; the generation model exports transfer metrics; a client
that cancels during the context phase gets the context side's region freed at once (not at its hold deadline).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from dhisparse import SamplingParams
from dhisparse.serving.tokenization import TokenBytes

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse_client import GenerationError, GenerationOptions

PROMPTS = ["To be, or not to be", "the slings and arrows of outrageous fortune", "Or to take arms #3"]
MAX_TOKENS = 12


TOPOLOGY = os.environ.get("DHISPARSE_DISAGG_TOPOLOGY", "two")
HOLD_S = 600.0  # the context side's hold deadline: far beyond any wait below, so no region is freed by expiry
BLOCKERS = 4  # context requests queued in front of the one that is cancelled during its context phase


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    """The deployment's internal key, shared by the two servers (and by the tests that act as its orchestrator)."""
    from dhisparse.serving.internal_auth import write_key_file

    return write_key_file(tmp_path_factory.mktemp("keys") / "internal.key")


def orchestrator_call(context, key_file, arrays: dict, request_id: str):
    """``context.call`` as the orchestrator sends it: signed with the deployment's key (``internal_auth``)."""
    from dhisparse.serving.internal_auth import AUTH_INPUT, CONTEXT, InternalAuth, request_subject

    token = InternalAuth.from_key_file(key_file).token(CONTEXT, request_subject(request_id, arrays))
    return context.call({**arrays, AUTH_INPUT: token}, request_id)


@pytest.fixture(scope="module")
def deployment(tiny_engine, tmp_path_factory, key_file):
    """``(generation server, context server)``: two servers, or the same one twice (``TOPOLOGY = one``)."""
    from conftest import POOL_BYTES, ServedEngine, start_triton

    from dhisparse.serving.disagg_repository import DisaggregatedOptions, fill_disaggregated_repository
    from dhisparse.serving.repository import RepositorySpec

    overrides = {"kv_policy": "adaptive", "pool_bytes": POOL_BYTES}
    spec = RepositorySpec(tiny_engine, overrides, metrics_interval_ms=100, auth_key_file=key_file)
    servers = []

    def serve(name: str, options: DisaggregatedOptions) -> ServedEngine:
        config, server, models = start_triton(tmp_path_factory.mktemp(name),
                                              lambda repo: fill_disaggregated_repository(spec, repo, None, options))
        servers.append(server)
        assert set(models) == set(options.models(spec.has_tokenizer))
        return ServedEngine(tiny_engine, overrides, config.http_url, config.grpc_url, config.metrics_url, server)

    try:
        if TOPOLOGY == "one":
            both = serve("triton-disagg", DisaggregatedOptions("both", hold_timeout_s=HOLD_S))
            yield both, both
        else:
            context = serve("triton-context", DisaggregatedOptions("context", hold_timeout_s=HOLD_S))
            generation = serve("triton-generation", DisaggregatedOptions("generation", context.grpc_url))
            yield generation, context
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def disaggregated(deployment):
    return deployment[0]


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


def test_ensemble_over_the_orchestrator_matches_offline(disaggregated, expected, tokenizer):
    _, _, texts = expected
    _, tokens, _ = expected
    token_bytes = TokenBytes(tokenizer)
    client = disaggregated.client("ensemble")
    for prompt, want in zip(PROMPTS, tokens, strict=True):
        # The orchestrator streams one token per response (no speculation here) and does not hold tokens back for
        # whole characters: postprocessing decodes each chunk on its own, a split character becomes U+FFFD.
        per_token = b"".join(token_bytes.decode([t]).decode("utf-8", "replace").encode() for t in want)
        assert b"".join(client.stream(prompt, GenerationOptions(max_tokens=MAX_TOKENS))) == per_token
    whole = texts[0].decode("utf-8", "replace").encode()
    assert client.generate(PROMPTS[0], GenerationOptions(max_tokens=MAX_TOKENS)) == whole
    metrics = disaggregated.client().metrics()
    assert metrics["transfers"] >= len(PROMPTS) + 1 and metrics["transfer_bytes"] > 0
    assert metrics.get("transfers_failed", 0.0) == 0.0
    assert metrics["context_prefill_seconds"] > 0 and metrics["transfer_seconds"] > 0  # the TTFT split


def test_malformed_context_phase_params_give_a_clear_error(disaggregated, expected, key_file):
    """A client cannot reach `generation` (no orchestrator token); a signed request (as the orchestrator would send)
    with malformed params gets an error naming them."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from dhisparse.serving.internal_auth import AUTH_INPUT, GENERATION, InternalAuth, request_subject

    ids, _, _ = expected
    arrays = {"input_ids": np.array([ids[0]], dtype=np.int32), "input_lengths": np.array([[len(ids[0])]], np.int32),
              "request_output_len": np.array([[4]], dtype=np.int32), "streaming": np.array([[True]]),
              "request_type": np.array([[b"generation_only"]], dtype=object),
              "context_phase_params": np.array([[1, 2, 3]], dtype=np.uint8)}
    datatypes = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(object): "BYTES",
                 np.dtype(np.uint8): "UINT8"}

    def inputs(values: dict) -> list:
        out = []
        for name, array in values.items():
            tensor = grpcclient.InferInput(name, list(array.shape), datatypes[array.dtype])
            tensor.set_data_from_numpy(array)
            out.append(tensor)
        return out

    client = disaggregated.client()
    with pytest.raises(GenerationError, match="only its orchestrator"):
        list(client.stream_results("generation", inputs(arrays), ["output_ids"], request_id="client-1"))
    token = InternalAuth.from_key_file(key_file).token(GENERATION, request_subject("signed-1", arrays))
    with pytest.raises(GenerationError, match="context_phase_params"):
        list(client.stream_results("generation", inputs({**arrays, AUTH_INPUT: token}), ["output_ids"],
                                   request_id="signed-1"))


def test_multi_token_stop_sequence_ends_the_generation_phase(disaggregated, expected):
    ids, tokens, _ = expected
    want = tokens[0]
    end = next(i for i in range(3, len(want)) if all(want[j:j + 2] != want[i - 1:i + 1] for j in range(i - 1)))
    stop = want[end - 1 : end + 1]  # a 2-token sequence whose first occurrence ends at position `end`
    values = {"input_ids": ids[0], "input_lengths": len(ids[0]), "request_output_len": MAX_TOKENS,
              "streaming": True, "stop_words_list": [stop, [2, -1]]}
    chunks = list(disaggregated.client().stream_raw("disaggregated_serving_bls", values, "output_ids"))
    assert [int(t) for c in chunks for t in c.reshape(-1)] == want[: end + 1]  # the stop sequence is kept


def _cancel_midway(client, start, attempts: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """Start a long generation (``start()``: a stream of chunks with ``close()``), read three chunks, wait until
    the generation side holds its memory, close the stream, wait for idle; the metrics before and after. On a loaded
    machine the tiny model can finish its tokens before the cancellation travels client -> orchestrator ->
    generation: such a request ran to its end (finished, not aborted), so the attempt says nothing and is repeated."""
    from idle import IDLE, settle

    for _ in range(attempts):
        settle(client)
        before = client.metrics()
        stream = start()
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        deadline = time.monotonic() + 20
        while client.metrics().get("kv_requests_running", 0.0) < 1.0:  # the generation side really holds memory
            assert time.monotonic() < deadline, "the generation request never ran"
            time.sleep(0.05)
        stream.close()
        assert settle(client, timeout_s=60) == IDLE
        after = client.metrics()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("requests_aborted", "requests_finished")}
        if delta["requests_aborted"] == 1.0:
            return before, after
        assert delta == {"requests_aborted": 0.0, "requests_finished": 1.0}, delta  # it ran to its end
    raise AssertionError(f"the cancellation never reached the generation side in {attempts} attempts")


def test_cancelled_orchestrator_stream_frees_the_generation_side(disaggregated, prompt_runs_long):
    from conftest import LONG

    client = disaggregated.client()
    before, after = _cancel_midway(client, lambda: client.stream_token_ids(
        prompt_runs_long, GenerationOptions(max_tokens=LONG), model="disaggregated_serving_bls"))
    # Closing the stream cancels the orchestrator's request; it forwards the cancellation to `generation`.
    assert after["serving_cancelled_requests"] - before.get("serving_cancelled_requests", 0.0) == 1.0
    assert after["generated_tokens"] - before.get("generated_tokens", 0.0) < LONG


def _context_regions(context_server) -> dict[str, float]:
    metrics = context_server.client().metrics()
    return {k: metrics.get(k, 0.0) for k in ("regions_held", "regions_published", "regions_released",
                                             "regions_expired", "regions_cancelled")}


def _wait_regions(context_server, done, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll the context server's region gauges until ``done(regions)`` (a hang guard, far below HOLD_S)."""
    deadline = time.monotonic() + timeout_s
    while not done(regions := _context_regions(context_server)):
        assert time.monotonic() < deadline, f"context regions never settled: {regions}"
        time.sleep(0.05)
    return regions


def test_context_cancel_request_frees_the_region_at_once(deployment, expected, key_file):
    """The control request the orchestrator sends on a cancellation: `cancel_request_id` frees that region now."""
    import numpy as np

    from dhisparse.disagg.context_client import RemoteContext
    from dhisparse.disagg.params import ContextPhaseParams

    _, context_server = deployment
    ids, tokens, _ = expected
    _wait_regions(context_server, lambda r: r["regions_held"] == 0)
    from dhisparse.serving.internal_auth import InternalAuth, read_key_file

    context = RemoteContext(context_server.grpc_url, auth=InternalAuth.from_key_file(key_file))
    try:
        arrays = {"input_ids": np.array([ids[0]], dtype=np.int32),
                  "input_lengths": np.array([[len(ids[0])]], dtype=np.int32),
                  "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
                  "request_type": np.array([[b"context_only"]], dtype=object)}
        first, params = orchestrator_call(context, key_file, arrays, "probe-cancel")
        assert first == tokens[0][0]
        assert ContextPhaseParams.from_bytes(params, read_key_file(key_file)).request_key.endswith("/probe-cancel")
        held = _wait_regions(context_server, lambda r: r["regions_held"] == 1)  # nobody reads it: it stays held
        freed = context.cancel("probe-cancel")  # freed by the control request, synchronously
        assert freed == 1, f"cancel freed {freed} regions; before it: {held}"
        assert context.cancel("probe-cancel") == 0  # nothing left to free
    finally:
        context.close()
    after = _wait_regions(context_server, lambda r: r["regions_held"] == 0)
    assert after["regions_cancelled"] - held["regions_cancelled"] == 1, (held, after)
    assert after["regions_expired"] == held["regions_expired"], (held, after)


def test_cancel_during_the_context_phase_frees_both_sides(deployment, tokenizer, key_file):
    """A client cancels while its context phase runs (queued behind long prefills sent straight to `context`): the
    orchestrator frees its region at once with a `cancel_request_id` control request (not at the 600 s hold
    deadline), nothing expires, the generation side never took the request and returns to idle."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from idle import IDLE, wait_idle

    from dhisparse.disagg.context_client import RemoteContext

    generation_server, context_server = deployment
    before = _wait_regions(context_server, lambda r: r["regions_held"] == 0)
    generation_before = generation_server.client().metrics()
    long_prompt = tokenizer.encode(" ".join(["the slings and arrows of outrageous fortune"] * 40)).ids[:440]
    arrays = {"input_ids": np.array([long_prompt], dtype=np.int32),
              "input_lengths": np.array([[len(long_prompt)]], dtype=np.int32),
              "request_output_len": np.array([[8]], dtype=np.int32)}
    from dhisparse.serving.internal_auth import InternalAuth

    context = RemoteContext(context_server.grpc_url, auth=InternalAuth.from_key_file(key_file))
    blocker = {**arrays, "request_type": np.array([[b"context_only"]], dtype=object)}
    blockers = [threading.Thread(target=orchestrator_call, args=(context, key_file, blocker, f"blocker-{i}"))
                for i in range(BLOCKERS)]
    for thread in blockers:  # long prefills in front of the cancelled request's context phase
        thread.start()
    stats = grpcclient.InferenceServerClient(generation_server.grpc_url)

    def orchestrated() -> int:
        return int(stats.get_inference_statistics("disaggregated_serving_bls").model_stats[0].inference_count)

    started = orchestrated()
    client = grpcclient.InferenceServerClient(generation_server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    inputs = []
    for name, value in {**arrays, "streaming": np.array([[True]])}.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "BOOL" if value.dtype == bool else "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.async_stream_infer("disaggregated_serving_bls", inputs, request_id="cancelled-in-context-phase")
    deadline = time.monotonic() + 30
    while orchestrated() == started:  # the orchestrator has it: its context phase is queued behind the blockers
        assert time.monotonic() < deadline, "the orchestrator never received the request"
        time.sleep(0.005)
    client.stop_stream(cancel_requests=True)
    for thread in blockers:
        thread.join(120)
    published = _wait_regions(context_server, lambda r: r["regions_published"] - before["regions_published"]
                              == BLOCKERS + 1)
    for i in range(BLOCKERS):  # nobody reads the blockers' regions: free them the same way
        assert context.cancel(f"blocker-{i}") == 1
    context.close()
    client.close()
    after = _wait_regions(context_server, lambda r: r["regions_held"] == 0)
    assert after["regions_expired"] == before["regions_expired"]
    assert after["regions_released"] == published["regions_released"] == before["regions_released"]  # never read
    assert after["regions_cancelled"] - before["regions_cancelled"] == BLOCKERS + 1
    assert wait_idle(generation_server.client()) == IDLE
    assert generation_server.client().metrics().get("transfers", 0.0) == generation_before.get("transfers", 0.0)


MISSING = [  # (server: 0 generation / 1 context, model, inputs, what the error must name)
    (0, "ensemble", {"max_tokens": [[4]], "stream": [[True]]}, "text_input is missing"),
    (0, "ensemble", {"text_input": [["To be"]], "stream": [[True]], "temperature": [[0.5]]}, "max_tokens is missing"),
    (0, "disaggregated_serving_bls", {"request_output_len": [[4]], "streaming": [[True]]}, "input_ids is missing"),
    (0, "disaggregated_serving_bls", {"input_ids": [[5, 6]], "streaming": [[True]], "temperature": [[0.5]]},
     "request_output_len"),
    (0, "generation", {"input_ids": [[5, 6]], "request_output_len": [[4]], "streaming": [[True]],
                       "request_type": [["generation_only"]]}, "context_phase_params is missing"),
    (1, "context", {"request_output_len": [[4]], "request_type": [["context_only"]], "temperature": [[0.5]]},
     "input_ids is missing"),
    (1, "context", {"input_ids": [[5, 6]], "request_type": [["context_only"]], "temperature": [[0.5]]},
     "request_output_len"),
]


@pytest.mark.parametrize(("server", "model", "values", "message"), MISSING, ids=[f"{m[1]}-{m[3]}" for m in MISSING])
def test_missing_required_input_on_a_stream_is_named(deployment, key_file, server, model, values, message):
    """Over a gRPC stream with a request id (what Triton 2.51 answered with silence for the ensemble). The internal
    models (`context`, `generation`) are called as their orchestrator calls them, with a valid token, so the check
    reaches the inputs (without one they refuse first: tests/serving/test_security_disagg.py)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from dhisparse.serving.internal_auth import AUTH_INPUT, CONTEXT, GENERATION, InternalAuth, request_subject

    dtypes = {"input_ids": np.int32, "request_output_len": np.int32, "max_tokens": np.int32, "streaming": bool,
              "stream": bool, "temperature": np.float32, "text_input": object, "request_type": object}
    arrays = {name: np.array(value, dtype=dtypes[name]) for name, value in values.items()}
    if model in ("context", "generation"):
        purpose = CONTEXT if model == "context" else GENERATION
        token = InternalAuth.from_key_file(key_file).token(purpose, request_subject("missing-input", arrays))
        arrays[AUTH_INPUT] = token.astype(object)
    inputs = []
    for name, array in arrays.items():
        if array.dtype == object:
            array = np.vectorize(lambda v: v if isinstance(v, bytes) else v.encode(), otypes=[object])(array)
        tensor = grpcclient.InferInput(name, list(array.shape), {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL",
                                                                 np.dtype(np.float32): "FP32",
                                                                 np.dtype(object): "BYTES"}[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with pytest.raises(GenerationError, match=message):
        list(deployment[server].client().stream_results(model, inputs, request_id="missing-input"))


@pytest.fixture(scope="module")
def openai_api(disaggregated):
    """The OpenAI front end `dhisparse-serve --openai-port` runs, here beside the generation server."""
    import openai

    from dhisparse.serving.openai.server import OpenAIOptions, OpenAIServer

    front = OpenAIServer(disaggregated.engine_dir, disaggregated.grpc_url, OpenAIOptions(0, model_name="tiny"),
                         disaggregated.overrides)
    front.start()
    try:
        yield openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=120)
    finally:
        front.stop()


def test_openai_api_over_the_orchestrator(openai_api, expected):
    """Same answers as co-located serving; what the orchestrator does not return (log-probs) is refused by name."""
    import openai

    _, tokens, texts = expected
    for prompt, want, text in zip(PROMPTS, tokens, texts, strict=True):
        reply = openai_api.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == text.decode("utf-8", "replace")
        assert reply.choices[0].finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")
        assert reply.usage.completion_tokens == len(want)
        streamed = openai_api.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True)
        assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    with pytest.raises(openai.BadRequestError, match="not available in this deployment") as refused:
        openai_api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, logprobs=1)
    assert refused.value.body["param"] == "logprobs"


def test_openai_disconnect_frees_the_generation_side(openai_api, disaggregated, prompt_runs_long):
    from conftest import LONG, PROMPT

    client = disaggregated.client()
    before, after = _cancel_midway(client, lambda: openai_api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True))
    assert after["generated_tokens"] - before.get("generated_tokens", 0.0) < LONG
