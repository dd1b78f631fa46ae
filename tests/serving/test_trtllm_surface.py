"""tensorrtllm_backend's clients, unchanged, against our ensemble: the whole input/output surface.

`e2e_client_inputs` sends exactly what tensorrtllm_backend's `inflight_batcher_llm/client/end_to_end_grpc_client.py`
sends with its defaults (text_input, max_tokens, stream, beam_width, temperature, num_return_sequences,
exclude_input_in_output = false; batched by stacking rows as its --batch-inputs does); that client then expects
the prompt followed by the generated text when not streaming, and the generated text when streaming.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from dhisparse import SamplingParams
from dhisparse.serving.tokenization import TokenBytes
from dhisparse_client import GenerationError

PROMPTS = ["To be, or not to be", "the slings and arrows", "naïve café"]
OUTPUT_LEN = 12


def _tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def e2e_client_inputs(prompt: str, streaming: bool, temperature: float = 0.0) -> dict[str, np.ndarray]:
    """The end-to-end client's `prepare_inputs` with its defaults (its --temperature set for exactness)."""
    return {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones((1, 1), dtype=np.int32) * OUTPUT_LEN,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
    }


def _text(raw: bytes) -> bytes:
    """What text_output holds for these bytes: valid UTF-8 (a replacing decoder's U+FFFD for invalid bytes)."""
    return raw.decode("utf-8", "replace").encode()


def _batched(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([row[key] for row in rows], axis=0) for key in rows[0]}


def _run(served, inputs: dict[str, np.ndarray], outputs: list[str], model: str = "ensemble") -> list[dict]:
    tensors = [_tensor(name, value) for name, value in inputs.items()]
    return list(served.client().stream_results(model, tensors, outputs))


@pytest.fixture(scope="module")
def offline(offline_llm, tokenizer):
    """prompt -> (token ids, greedy output ids, output text bytes)."""
    token_bytes = TokenBytes(tokenizer)
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        result = offline_llm.generate([ids], SamplingParams(max_tokens=OUTPUT_LEN, logprobs=True))[0]
        out[prompt] = (ids, result, token_bytes.decode(result.token_ids))
    return out


@pytest.mark.parametrize("model", ["ensemble", "dhisparse_bls"])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_end_to_end_client_defaults_give_the_offline_text(served, offline, streaming, batched, model):
    rows = [e2e_client_inputs(p, streaming) for p in PROMPTS]
    requests = [_batched(rows)] if batched else rows
    outputs = ["text_output", "batch_index"] if batched else ["text_output"]
    texts: dict[int, bytes] = {}
    for inputs in requests:
        offset = len(texts)
        for response in _run(served, inputs, outputs, model):
            index = offset + (int(response["batch_index"][0][0]) if batched else 0)
            chunk = bytes(response["text_output"].reshape(-1)[0])
            texts[index] = texts.get(index, b"") + chunk if streaming else chunk
    for i, prompt in enumerate(PROMPTS):
        generated = offline[prompt][2]
        expected = generated if streaming else prompt.encode() + generated
        # text_output is valid UTF-8: invalid bytes of the random model become U+FFFD (streamed chunks are whole
        # characters, so they concatenate to the whole text's decoding)
        assert texts[i] == expected.decode("utf-8", "replace").encode()


@pytest.mark.parametrize("model", ["ensemble", "dhisparse_bls"])
def test_three_return_sequences_are_seeded_reproducible_and_distinct(served, offline_llm, tokenizer, model):
    inputs = e2e_client_inputs(PROMPTS[0], streaming=True, temperature=1.0)
    inputs["num_return_sequences"] = np.array([[3]], dtype=np.int32)
    inputs["random_seed"] = np.array([[1234]], dtype=np.uint64)
    inputs["return_log_probs"] = np.array([[True]], dtype=bool)

    def run() -> dict[int, bytes]:
        texts: dict[int, bytes] = {}
        for response in _run(served, inputs, ["text_output", "sequence_index", "output_log_probs"], model):
            index = int(response["sequence_index"][0][0])
            texts[index] = texts.get(index, b"") + bytes(response["text_output"].reshape(-1)[0])
        return texts

    first, second = run(), run()
    assert sorted(first) == [0, 1, 2] and first == second
    assert len(set(first.values())) == 3
    ids = tokenizer.encode(PROMPTS[0]).ids
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=1.0, seed=1234)
    token_bytes = TokenBytes(tokenizer)
    for index, text in first.items():
        expected = token_bytes.decode(offline_llm.generate([ids], params.for_sequence(index))[0].token_ids)
        assert text == expected.decode("utf-8", "replace").encode()


def test_log_probs_equal_the_offline_engine(served, offline):
    prompt = PROMPTS[1]
    inputs = e2e_client_inputs(prompt, streaming=False)
    inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    (response,) = _run(served, inputs, ["text_output", "cum_log_probs", "output_log_probs"])
    expected = offline[prompt][1].log_probs
    assert response["output_log_probs"].shape == (1, 1, len(expected))
    assert np.allclose(response["output_log_probs"].reshape(-1), expected, atol=1e-5)
    assert response["cum_log_probs"].reshape(-1)[0] == pytest.approx(sum(expected), abs=1e-4)


def test_perf_metrics_context_and_generation_logits(served, offline, offline_llm):
    prompt = PROMPTS[2]
    inputs = e2e_client_inputs(prompt, streaming=True)
    for name in ("return_perf_metrics", "return_context_logits", "return_generation_logits",
                 "return_num_input_tokens", "return_num_output_tokens"):
        inputs[name] = np.array([[True]], dtype=bool)
    responses = _run(served, inputs, None)
    ids, result, _ = offline[prompt]
    for response in responses:  # the end-to-end client reads every perf metric from every response
        for name in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                     "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                     "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
            assert response[name].shape == (1, 1), name
    last = responses[-1]
    times = [int(last[n][0][0]) for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                          "last_token_time_ns")]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3]
    assert last["kv_cache_alloc_total_blocks"][0][0] == last["kv_cache_alloc_new_blocks"][0][0] >= 1
    assert last["kv_cache_reused_blocks"][0][0] == 0 and last["total_draft_tokens"][0][0] == 0
    assert int(last["num_input_tokens"][0][0]) == len(ids)
    assert int(last["num_output_tokens"][0][0]) == len(result.token_ids)
    context = [r["context_logits"] for r in responses if "context_logits" in r]
    assert len(context) == 1 and context[0].shape == (1, len(ids), offline_llm.vocab_size)
    reference = offline_llm.engine.model.prefill(ids, all_logits=True).all_logits
    assert np.allclose(context[0][0], reference.numpy(), atol=1e-4)
    generation = np.concatenate([r["generation_logits"][0, 0] for r in responses], axis=0)
    assert generation.shape == (len(result.token_ids), offline_llm.vocab_size)
    assert generation.argmax(axis=-1).tolist() == result.token_ids


def test_penalties_bad_words_min_length_and_bias_match_offline(served, offline_llm, tokenizer):
    prompt = PROMPTS[0]
    ids = tokenizer.encode(prompt).ids
    token_bytes = TokenBytes(tokenizer)
    plain = offline_llm.generate([ids], SamplingParams(max_tokens=OUTPUT_LEN))[0].token_ids
    # words of the plain output that encode back to their own single token: banning them must change the output
    words = [token_bytes.decode([t]).decode("utf-8", "ignore") for t in plain]
    words = list(dict.fromkeys(w for w, t in zip(words, plain, strict=True)
                               if w and tokenizer.encode(w, add_special_tokens=False).ids == [t]))
    assert len(words) >= 2
    cases = [
        ({"repetition_penalty": np.array([[1.6]], dtype=np.float32)}, dict(repetition_penalty=float(np.float32(1.6)))),
        ({"presence_penalty": np.array([[1.0]], dtype=np.float32),
          "frequency_penalty": np.array([[0.5]], dtype=np.float32)}, dict(presence_penalty=1.0, frequency_penalty=0.5)),
        ({"bad_words": np.array([words[:2]], dtype=object)},
         dict(bad_words=tuple(tuple(tokenizer.encode(w, add_special_tokens=False).ids) for w in words[:2]))),
        ({"end_id": np.array([[plain[2]]], dtype=np.int32), "min_length": np.array([[8]], dtype=np.int32)},
         dict(stop_token_ids=(plain[2],), min_tokens=7)),
        ({"embedding_bias_words": np.array([words[:2]], dtype=object),
          "embedding_bias_weights": np.array([[-30.0, 2.0]], dtype=np.float32)},
         dict(logit_bias={tokenizer.encode(words[0], add_special_tokens=False).ids[0]: -30.0,
                          tokenizer.encode(words[1], add_special_tokens=False).ids[0]: 2.0})),
    ]
    for extra, params in cases:
        inputs = {**e2e_client_inputs(prompt, streaming=False), **extra}
        inputs["exclude_input_in_output"] = np.array([[True]], dtype=bool)
        (response,) = _run(served, inputs, ["text_output"])
        expected = offline_llm.generate([ids], SamplingParams(max_tokens=OUTPUT_LEN, **params))[0].token_ids
        assert expected != plain, params
        assert bytes(response["text_output"].reshape(-1)[0]) == _text(token_bytes.decode(expected)), params


NEUTRAL = {
    "decoder_text_input": np.array([[""]], dtype=object), "length_penalty": np.array([[1.0]], dtype=np.float32),
    "min_length": np.array([[1]], dtype=np.int32), "repetition_penalty": np.array([[1.0]], dtype=np.float32),
    "presence_penalty": np.array([[0.0]], dtype=np.float32), "frequency_penalty": np.array([[0.0]], dtype=np.float32),
    "top_k": np.array([[0]], dtype=np.int32), "top_p": np.array([[1.0]], dtype=np.float32),
    "prompt_vocab_size": np.array([[0]], dtype=np.int32), "prompt_table_extra_id": np.array([[0]], dtype=np.uint64),
    "lora_task_id": np.array([[0]], dtype=np.uint64), "guided_decoding_guide_type": np.array([[""]], dtype=object),
    "guided_decoding_guide": np.array([[""]], dtype=object), "bad_words": np.array([[""]], dtype=object),
    "return_log_probs": np.array([[False]], dtype=bool), "return_perf_metrics": np.array([[False]], dtype=bool),
    "return_context_logits": np.array([[False]], dtype=bool),
    "return_generation_logits": np.array([[False]], dtype=bool),
}


def test_every_input_at_its_neutral_value_is_accepted(served, offline):
    prompt = PROMPTS[0]
    (response,) = _run(served, {**e2e_client_inputs(prompt, streaming=False), **NEUTRAL}, ["text_output"])
    assert bytes(response["text_output"].reshape(-1)[0]) == _text(prompt.encode() + offline[prompt][2])


REFUSED = [
    ("beam_width", np.array([[2]], dtype=np.int32), "beam search is not supported"),
    ("lora_task_id", np.array([[7]], dtype=np.uint64), "LoRA adapters are not supported"),
    ("lora_weights", np.ones((1, 2, 4), dtype=np.float16), "lora_weights: LoRA adapters are not supported"),
    ("prompt_embedding_table", np.ones((1, 2, 4), dtype=np.float16), "prompt-embedding tables"),
    ("prompt_vocab_size", np.array([[4]], dtype=np.int32), "prompt_vocab_size must be 0"),
    ("prompt_table_extra_id", np.array([[3]], dtype=np.uint64), "prompt_table_extra_id is not supported"),
    ("guided_decoding_guide_type", np.array([["json"]], dtype=object), "guided decoding is not supported"),
    ("decoder_text_input", np.array([["bonjour"]], dtype=object), "decoder_text_input is not supported"),
]


@pytest.mark.parametrize(("name", "value", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_input_is_refused_with_its_reason_and_server_keeps_serving(served, offline, name, value,
                                                                              message):
    with pytest.raises(GenerationError) as error:
        _run(served, {**e2e_client_inputs(PROMPTS[0], streaming=True), name: value}, ["text_output"])
    assert message in str(error.value)
    assert _run(served, e2e_client_inputs(PROMPTS[0], streaming=False), ["text_output"])


def test_llm_model_directly_batched_with_sequences(served, offline_llm, tokenizer):
    """The `dhisparse` model with tensorrt_llm's names: two padded prompts in one request, two samples each,
    prompt ids first (exclude_input_in_output = false), log probs per sequence."""
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:2]]
    width = max(len(p) for p in prompts)
    inputs = {
        "input_ids": np.array([p + [0] * (width - len(p)) for p in prompts], dtype=np.int32),
        "input_lengths": np.array([[len(p)] for p in prompts], dtype=np.int32),
        "request_output_len": np.full((2, 1), 6, dtype=np.int32),
        "temperature": np.full((2, 1), 0.9, dtype=np.float32),
        "random_seed": np.array([[5], [9]], dtype=np.uint64),
        "num_return_sequences": np.full((2, 1), 2, dtype=np.int32),
        "exclude_input_in_output": np.zeros((2, 1), dtype=bool),
        "return_log_probs": np.ones((2, 1), dtype=bool),
    }
    seen = {}
    for response in _run(served, inputs, None, model="dhisparse"):
        key = (int(response["batch_index"][0][0]), int(response["sequence_index"][0][0]))
        seen[key] = response
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (row, index), response in seen.items():
        seed = 5 if row == 0 else 9
        params = SamplingParams(max_tokens=6, temperature=float(np.float32(0.9)), seed=seed, logprobs=True)
        expected = offline_llm.generate([prompts[row]], params.for_sequence(index))[0]
        ids = response["output_ids"].reshape(-1).tolist()
        assert ids == prompts[row] + expected.token_ids
        assert int(response["sequence_length"][0][0]) == len(ids)
        assert np.allclose(response["output_log_probs"].reshape(-1), expected.log_probs, atol=1e-5)


def test_client_cli_prints_every_sequence_with_log_probs_and_perf_metrics(served, capsys):
    from dhisparse_client.cli import main

    code = main(["--url", served.grpc_url, "--http-url", served.http_url, "--prompt", PROMPTS[0], "--max-tokens", "4",
                 "--temperature", "1.0", "--seed", "3", "-n", "2", "--return-log-probs", "--return-perf-metrics",
                 "--repetition-penalty", "1.2", "--bad-word", "e", "--embedding-bias", "s=1.5", "--min-length", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "[sequence 0]" in captured.out and "[sequence 1]" in captured.out
    assert "output_log_probs = [" in captured.err and "first_token_time_ns" in captured.err
