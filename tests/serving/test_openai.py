"""The official `openai` client against `dhisparse-serve --openai-port` (one real server for the module).

The server runs the tiny engine with a chat template given by `--chat-template`. Every answer is checked against
the offline engine (`LLM.generate` with the same token ids and sampling parameters) and greedy completions against
what the server's own `ensemble` returns for the same prompt. Errors are OpenAI's error object with their status;
a client that disconnects, streaming or not, gets its request aborted and every tier of its memory freed (the same
occupancy check as the gRPC cancellation tests). Speculation and a dead engine get a server of their own, on the demo
target and its trained drafter (`models/demo`), so that drafts are accepted.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
from conftest import KV_POLICY, LONG, POOL_BYTES, PROMPT
from idle import IDLE, occupancy, settle

from dhisparse import SamplingParams
from dhisparse.serving.tokenization import TokenBytes
from dhisparse_client import DHiSparseClient, GenerationOptions

MODEL = "tiny"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["To be, or not to be", "the slings and arrows", "naïve café"]
MAX_TOKENS = 12
EARLY_EOS = "arrows"  # greedy generation from this prompt ends with EOS after 6 tokens
MESSAGES = [{"role": "system", "content": "Speak plainly."}, {"role": "user", "content": "Whether 'tis nobler"}]


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    from dhisparse_client.serve_process import ServeProcess

    work = tmp_path_factory.mktemp("openai")
    (work / "chat.jinja").write_text(TEMPLATE)
    serve = ServeProcess(tiny_engine, {"kv_policy": KV_POLICY, "pool_bytes": POOL_BYTES, "page_rows": 16},
                         log_path=work / "server.log",
                         extra_args=["--openai-port", "0", "--served-model-name", MODEL, "--chat-template",
                                     str(work / "chat.jinja"), "--metrics-interval-ms", "100"])
    endpoints = serve.start()
    assert endpoints.openai_url and endpoints.openai_model == MODEL, serve.output_tail()
    try:
        yield endpoints
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def triton(server) -> DHiSparseClient:
    return DHiSparseClient(server.grpc_url, server.http_url, server.metrics_url, timeout_s=120)


def _offline(llm, ids: list[int], **params):
    return llm.generate([ids], SamplingParams(**params))[0]


def _text(tokenizer, token_ids: list[int]) -> str:
    return TokenBytes(tokenizer).decode(token_ids).decode("utf-8", "replace")


def _chat_ids(tokenizer, messages=MESSAGES) -> list[int]:
    parts = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    return tokenizer.encode(parts + "<|assistant|>", add_special_tokens=False).ids


def test_models_are_listed(api):
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert api.models.retrieve(MODEL).id == MODEL


def test_greedy_completions_equal_the_ensemble_and_the_offline_engine(api, triton, offline_llm, tokenizer):
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        reference = _offline(offline_llm, ids, max_tokens=MAX_TOKENS)
        ensemble = triton.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS)).decode()
        reply = api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == ensemble == _text(tokenizer, reference.token_ids)
        assert reply.choices[0].finish_reason == reference.finish_reason
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(reference.token_ids))
        assert reply.usage.total_tokens == len(ids) + len(reference.token_ids)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0  # shorter than a page: nothing to reuse
        details = reply.usage.completion_tokens_details  # no drafter: nothing proposed
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
        stream = api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)
        assert all(c.usage is None for c in chunks[:-1])


def test_end_of_sequence_finishes_with_stop(api, offline_llm, tokenizer):
    reference = _offline(offline_llm, tokenizer.encode(EARLY_EOS).ids, max_tokens=MAX_TOKENS)
    assert reference.finish_reason == "stop" and len(reference.token_ids) < MAX_TOKENS  # the precondition
    reply = api.completions.create(model=MODEL, prompt=EARLY_EOS, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(reference.token_ids)
    assert reply.choices[0].text == _text(tokenizer, reference.token_ids)


def test_token_id_prompts_and_echo(api, offline_llm, tokenizer):
    ids = tokenizer.encode(PROMPTS[0]).ids
    reference = _offline(offline_llm, ids, max_tokens=MAX_TOKENS)
    reply = api.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == _text(tokenizer, reference.token_ids)
    assert reply.usage.prompt_tokens == len(ids) + 3
    echoed = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + reply.choices[0].text


def test_chat_uses_the_template_streamed_and_not(api, offline_llm, tokenizer):
    ids = _chat_ids(tokenizer)
    reference = _offline(offline_llm, ids, max_tokens=MAX_TOKENS)
    reply = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                        temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == _text(tokenizer, reference.token_ids)
    assert reply.choices[0].finish_reason == reference.finish_reason
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_multi_turn_chat_reuses_the_history_and_answers_exactly(api, triton, offline_llm, tokenizer):
    """Prefix reuse through /v1/chat/completions: each turn sends the whole history; the server reuses the cached
    full pages (16 rows) of the previous turns, says how many prompt tokens in usage.prompt_tokens_details.cached_tokens
    (= the engine's kv_prefix_reused_tokens), and every reply equals the dense reference engine's (no reuse)."""
    messages = [{"role": "system", "content": "Speak plainly. " * 6},
                {"role": "user", "content": "Whether 'tis nobler in the mind to suffer the slings and arrows"}]
    earlier: list[int] = []  # the previous turn's prompt and reply, as the engine stored them
    earlier_prompt = 0
    for turn in range(3):
        ids = _chat_ids(tokenizer, messages)
        reference = _offline(offline_llm, ids, max_tokens=MAX_TOKENS)
        settle(triton)  # /metrics is refreshed every 100 ms: read counters when current
        before = triton.metrics().get("kv_prefix_reused_tokens", 0.0)
        reply = api.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS,
                                            temperature=0)
        assert reply.choices[0].message.content == _text(tokenizer, reference.token_ids)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        settle(triton)
        assert cached % 16 == 0 and cached == triton.metrics()["kv_prefix_reused_tokens"] - before
        if turn:  # at least the previous prompt's full pages that this prompt starts with; at most what it shares
            common = next((i for i, (a, b) in enumerate(zip(earlier, ids, strict=False)) if a != b),
                          min(len(earlier), len(ids)))
            assert 16 <= min(common, earlier_prompt) // 16 * 16 <= cached <= min(common, len(ids) - 1)
        earlier, earlier_prompt = ids + list(reference.token_ids), len(ids)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And turn {turn + 2}: by opposing end them?"}]


def test_two_choices_sample_with_seed_plus_index(api, offline_llm, tokenizer):
    ids = tokenizer.encode(PROMPTS[1]).ids
    temperature = float(np.float32(0.9))  # what the engine receives (FP32 tensors)
    reply = api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.9, seed=7,
                                   n=2)
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=7)
    assert texts == [_text(tokenizer, offline_llm.generate([ids], params.for_sequence(i))[0].token_ids)
                     for i in range(2)]
    assert texts[0] != texts[1]
    chat = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.9, seed=7,
                                       n=2, stream=True)
    streamed = {0: "", 1: ""}
    for chunk in chat:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    chat_ids = _chat_ids(tokenizer)
    assert [streamed[i] for i in range(2)] == [
        _text(tokenizer, offline_llm.generate([chat_ids], params.for_sequence(i))[0].token_ids) for i in range(2)]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_end_the_text_before_them(api, offline_llm, tokenizer, stream):
    ids = tokenizer.encode(PROMPTS[0]).ids
    full = _text(tokenizer, _offline(offline_llm, ids, max_tokens=MAX_TOKENS).token_ids)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    expected = full[: full.index(stop)]
    reply = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                   stop=["never appears \u2603", stop], stream=stream)
    if stream:
        chunks = [c.choices[0] for c in reply]
        assert "".join(c.text for c in chunks) == expected and chunks[-1].finish_reason == "stop"
    else:
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens < MAX_TOKENS
        assert reply.usage.completion_tokens_details is not None  # statistics even though it ended early


def test_log_probabilities(api, offline_llm, tokenizer):
    ids = tokenizer.encode(PROMPTS[2]).ids
    reference = _offline(offline_llm, ids, max_tokens=MAX_TOKENS, logprobs=True)
    reply = api.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert np.allclose(logprobs.token_logprobs, reference.log_probs, atol=1e-5)
    token_bytes = TokenBytes(tokenizer)
    assert logprobs.tokens == [token_bytes.decode([t]).decode("utf-8", "replace") for t in reference.token_ids]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: chosen is top
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    chat_ids = _chat_ids(tokenizer)
    reference = _offline(offline_llm, chat_ids, max_tokens=MAX_TOKENS, logprobs=True)
    reply = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                        logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [token_bytes.decode([t]) for t in reference.token_ids]
    assert np.allclose([e.logprob for e in content], reference.log_probs, atol=1e-5)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
               for e in content)


def test_penalties_logit_bias_and_top_k_match_the_offline_engine(api, offline_llm, tokenizer):
    ids = tokenizer.encode(PROMPTS[0]).ids
    plain = _offline(offline_llm, ids, max_tokens=MAX_TOKENS).token_ids
    cases = [
        (PROMPTS[0], dict(presence_penalty=1.0, frequency_penalty=0.5), dict(presence_penalty=1.0,
                                                                             frequency_penalty=0.5)),
        (PROMPTS[0], dict(logit_bias={str(plain[0]): -100, str(plain[3]): 5}),
         dict(logit_bias=((plain[0], -100.0), (plain[3], 5.0)))),
        (PROMPTS[0], dict(extra_body={"repetition_penalty": 2.0}), dict(repetition_penalty=2.0)),
        (EARLY_EOS, dict(extra_body={"min_tokens": 10}), dict(min_tokens=10)),  # greedy ends with EOS at token 6
    ]
    for prompt, request, params in cases:
        prompt_ids = tokenizer.encode(prompt).ids
        expected = _offline(offline_llm, prompt_ids, max_tokens=MAX_TOKENS, **params)
        assert expected.token_ids != _offline(offline_llm, prompt_ids, max_tokens=MAX_TOKENS).token_ids, params
        reply = api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **request)
        assert reply.choices[0].text == _text(tokenizer, expected.token_ids), params
        assert reply.choices[0].finish_reason == expected.finish_reason
    temperature = float(np.float32(1.3))
    expected = _offline(offline_llm, ids, max_tokens=MAX_TOKENS, temperature=temperature, top_k=3, top_p=0.5,
                        seed=11).token_ids
    reply = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.3, top_p=0.5,
                                   seed=11, extra_body={"top_k": 3})
    assert reply.choices[0].text == _text(tokenizer, expected)


BAD = [  # (api call, request, expected status, error param or message fragment)
    ("completions", dict(model="nope", prompt="x"), 404, "model"),
    ("chat", dict(model="nope", messages=MESSAGES), 404, "model"),
    ("completions", dict(model=MODEL, prompt="x", max_tokens=0), 400, "max_tokens"),
    ("completions", dict(model=MODEL, prompt="x", temperature=5), 400, "temperature"),
    ("completions", dict(model=MODEL, prompt="x", n=1000), 400, "n"),
    ("completions", dict(model=MODEL, prompt="x", logit_bias={"100000": 1}), 400, "logit_bias"),
    ("completions", dict(model=MODEL, prompt="x", suffix="y"), 400, "suffix"),
    ("completions", dict(model=MODEL, prompt="x", max_tokens=600), 400, "exceeds"),  # refused by the engine
    ("completions", dict(model=MODEL, prompt="x", max_tokens=600, stream=True), 400, "exceeds"),
    ("completions", dict(model=MODEL, prompt="", max_tokens=4), 400, "prompt"),
    ("chat", dict(model=MODEL, messages=[]), 400, "messages"),
    ("chat", dict(model=MODEL, messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("chat", dict(model=MODEL, messages=MESSAGES, top_logprobs=2), 400, "top_logprobs"),
    ("chat", dict(model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools"),
    ("chat", dict(model=MODEL, messages=MESSAGES, stream_options={"include_usage": True}), 400, "stream_options"),
]


@pytest.mark.parametrize(("call", "request_", "status", "what"), BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_errors_are_openai_errors_with_their_status(api, call, request_, status, what):
    create = api.completions.create if call == "completions" else api.chat.completions.create
    with pytest.raises(openai.APIStatusError) as caught:
        result = create(**request_)
        list(result) if request_.get("stream") else None
    error = caught.value
    assert error.status_code == status, error.body
    assert error.body["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error.body["param"] == what or what in error.body["message"], error.body
    assert api.completions.create(model=MODEL, prompt="To be", max_tokens=2).choices  # still serving


def test_unknown_model_route_is_404(server):
    reply = httpx2.get(f"{server.openai_url}/models/nope", timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def _holding(triton) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while (now := occupancy(triton.metrics())).get("kv_requests_running", 0.0) < 1.0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    return now


@pytest.mark.parametrize("kind", ["completions-stream", "chat-stream", "completions"])
def test_disconnected_client_frees_every_tier(server, api, triton, prompt_runs_long, kind):
    settle(triton)
    before = triton.metrics()
    if kind == "completions":  # non-streaming: the client gives up waiting and closes its connection
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}).encode()
        host, port = server.openai_url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            holding = _holding(triton)
        assert holding["kv_required_bytes"] > 0 and holding["kv_host_pages_used"] > 0  # closed while holding memory
    else:
        if kind == "chat-stream":
            stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=LONG, temperature=0, stream=True)
        else:
            stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True)
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        holding = _holding(triton)
        assert holding["kv_required_bytes"] > 0 and holding["kv_host_pages_used"] > 0  # every tier in use
        stream.close()  # drops the connection
    assert settle(triton, timeout_s=60) == IDLE
    after = triton.metrics()
    assert after["requests_aborted"] - before.get("requests_aborted", 0.0) == 1.0
    assert after["serving_cancelled_requests"] - before.get("serving_cancelled_requests", 0.0) == 1.0
    assert after["generated_tokens"] - before.get("generated_tokens", 0.0) < LONG  # stopped well before the end
    assert api.completions.create(model=MODEL, prompt="To be", max_tokens=2).choices


DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def speculative_engine(tmp_path_factory) -> Path:
    """The demo target packed with its trained DFlash2 drafter (`models/demo`): its drafts are often accepted (a
    random-init drafter's never are, which would leave the acceptance statistics at zero)."""
    from dhisparse_builder.build import BuildOptions, build_engine

    return build_engine(BuildOptions(DEMO / "target", tmp_path_factory.mktemp("speculative") / "engine", {},
                                     drafters=(DEMO / "dflash2",)), progress=lambda done, total: None)


def _llmapi_statistics(client: DHiSparseClient, ids: list[int]) -> dict[str, float]:
    """The `llmapi` model's per-response statistics of `dhisparse` for a greedy request of `ids`: its last response."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    values = {"input_ids": np.array([ids], dtype=np.int32), "request_output_len": np.array([[MAX_TOKENS]], np.int32),
              "return_perf_metrics": np.array([[True]]), "streaming": np.array([[True]])}
    tensors = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    last = list(client.stream_results("dhisparse", tensors))[-1]
    return {name: last[name][0][0].item() for name in ("acceptance_rate", "total_accepted_draft_tokens",
                                                       "total_draft_tokens")}


def test_speculative_usage_and_statistics_then_dead_engine_is_503(speculative_engine, tmp_path):
    """With a drafter: greedy text still equals the engine's without one; usage carries the drafts (accepted +
    rejected = proposed, accepted > 0), and so do the `llmapi` statistics of the `dhisparse` model
    (total_accepted_draft_tokens, total_draft_tokens, acceptance_rate = their ratio), each equal to what the engine
    counted for that request. An engine that stops after a fault it cannot recover from: the request whose step failed
    gets a 500 naming the fault, every request after it a 503 (the official client raises InternalServerError for
    both) until dhisparse-serve, seeing the engine's model unloaded, stops and exits with code 3."""
    from dhisparse import LLM
    from dhisparse.serving.tokenization import load_tokenizer
    from dhisparse_client.serve_process import ServeProcess

    tokenizer = load_tokenizer(speculative_engine)
    offline_llm = LLM(speculative_engine, kv_policy="dense")  # no drafter: the tokens speculation must keep
    serve = ServeProcess(speculative_engine, {"kv_policy": KV_POLICY, "pool_bytes": 1 << 22, "page_rows": 16,
                                              "speculative": "dflash2", "num_draft_tokens": 3,
                                              "fault_injection": "break_invariants@40"},
                         log_path=tmp_path / "server.log",
                         extra_args=["--openai-port", "0", "--served-model-name", MODEL,
                                     "--metrics-interval-ms", "100"])
    endpoints = serve.start()
    try:
        api = openai.OpenAI(base_url=endpoints.openai_url, api_key="unused", max_retries=0, timeout=120)
        ids = tokenizer.encode(PROMPTS[0]).ids
        reference = _offline(offline_llm, ids, max_tokens=MAX_TOKENS)
        reply = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == _text(tokenizer, reference.token_ids)  # speculation changes no token
        details = reply.usage.completion_tokens_details
        client = DHiSparseClient(endpoints.grpc_url, endpoints.http_url, endpoints.metrics_url)
        settle(client)
        metrics = client.metrics()
        proposed = details.accepted_prediction_tokens + details.rejected_prediction_tokens
        assert proposed > 0 and proposed == metrics["draft_tokens_proposed"]  # this request's, as the engine counts
        assert 0 < details.accepted_prediction_tokens == metrics["draft_tokens_accepted"]

        statistics = _llmapi_statistics(client, tokenizer.encode(PROMPTS[1]).ids)
        settle(client)
        after = client.metrics()
        accepted, drafted = statistics["total_accepted_draft_tokens"], statistics["total_draft_tokens"]
        assert (accepted, drafted) == (after["draft_tokens_accepted"] - metrics["draft_tokens_accepted"],
                                       after["draft_tokens_proposed"] - metrics["draft_tokens_proposed"])
        assert 0 < accepted <= drafted and statistics["acceptance_rate"] == pytest.approx(accepted / drafted)

        with pytest.raises(openai.InternalServerError) as caught:  # min_tokens: no EOS before the fault's step
            api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0,
                                   extra_body={"min_tokens": 200})
        assert caught.value.status_code == 500 and "injected fault at break_invariants" in caught.value.message
        statuses = []
        for _ in range(20):  # until dhisparse-serve has stopped (it polls the model's readiness every 0.5 s)
            try:
                api.completions.create(model=MODEL, prompt="To be", max_tokens=4, stream=bool(len(statuses) % 2))
                pytest.fail("a request to a dead engine succeeded")
            except openai.InternalServerError as error:
                assert error.status_code == 503 and error.body["type"] == "service_unavailable", error.body
                statuses.append(503)
            except openai.APIConnectionError:
                break  # everything is stopped
        assert statuses, "no request reached the server between the engine's death and its exit"
        assert serve.wait(timeout_s=60) == 3, serve.output_tail()
    finally:
        serve.stop()
