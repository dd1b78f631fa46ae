"""Every bad input gets a clear error from the real server, and the next request succeeds."""

from __future__ import annotations

import pytest
from conftest import MAX_MODEL_LEN

from dhisparse_client import GenerationError, GenerationOptions

GOOD = {"text_input": "To be", "max_tokens": 2, "stream": True}
# (model, inputs, expected message fragment). Values are python values; see DHiSparseClient.stream_raw.
CASES = [
    ("ensemble", {"max_tokens": 4}, "text_input"),
    ("ensemble", {"text_input": "", "max_tokens": 4}, "text_input is empty"),
    ("ensemble", {"text_input": ["a", "b"], "max_tokens": 4}, "text_input"),  # Triton: shape [1, 2] is not [1]
    ("ensemble", {"text_input": "x" * (MAX_MODEL_LEN + 10), "max_tokens": 4}, "limit max_prompt_tokens"),
    ("ensemble", {"text_input": "To be", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("ensemble", {"text_input": "To be", "max_tokens": -3}, "max_tokens must be an integer >= 1"),
    ("ensemble", {"text_input": "To be", "max_tokens": MAX_MODEL_LEN + 1}, "exceeds the engine limit"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "temperature": -0.5}, "temperature must be"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "top_p": 1.5}, "top_p must be in [0, 1]"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "top_k": -1}, "top_k must be"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "temperature": float("nan")}, "temperature must be finite"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "beam_width": 2}, "beam_width must be 1"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "num_return_sequences": 0}, "num_return_sequences must be"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "embedding_bias_words": ["a", "b"],
                  "embedding_bias_weights": [1.0]}, "one weight per word"),
    ("ensemble", {"text_input": "To be", "max_tokens": 4, "random_seed": 1, "seed": 2}, "disagree"),
    ("dhisparse_bls", {"text_input": "", "max_tokens": 4}, "text_input is empty"),
    ("dhisparse_bls", {"text_input": "To be", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("dhisparse", {"input_ids": [5, 100000, 7], "request_output_len": 4}, "outside the vocabulary"),
    ("dhisparse", {"input_ids": [5, -1], "request_output_len": 4}, "outside the vocabulary"),
    ("dhisparse", {"request_output_len": 4}, "input_ids is missing"),
    # Missing required inputs, every model: the error names the input. With two or more other inputs Triton 2.51's
    # own input count check passes, and a missing required ensemble input used to get an empty final response.
    ("ensemble", {"text_input": "To be"}, "max_tokens"),
    ("ensemble", {"max_tokens": 4, "stream": True}, "text_input is missing"),
    ("ensemble", {"text_input": "To be", "stream": True, "temperature": 0.5}, "max_tokens is missing"),
    ("ensemble", {"stream": True, "temperature": 0.5}, "text_input is missing"),
    ("ensemble", {"stream": False, "return_log_probs": True, "top_k": 2}, "text_input is missing"),
    ("dhisparse_bls", {"max_tokens": 4, "stream": True}, "text_input is missing"),
    ("dhisparse_bls", {"text_input": "To be", "stream": True, "temperature": 0.5}, "max_tokens is missing"),
    ("dhisparse", {"request_output_len": 4, "streaming": True}, "input_ids is missing"),
    ("dhisparse", {"input_ids": [5, 6], "streaming": True, "temperature": 0.5}, "request_output_len"),
    ("dhisparse_bls", {"max_tokens": 4}, "text_input"),
    ("dhisparse_bls", {"text_input": "To be"}, "max_tokens"),
    ("dhisparse", {"input_ids": [5, 6]}, "request_output_len"),
    ("dhisparse", {"input_ids": [5, 6], "input_lengths": 9, "request_output_len": 4}, "input_lengths 9"),
    ("dhisparse", {"input_ids": [5, 6], "request_output_len": 4, "embedding_bias": [0.0] * 400 + [1.0]},
     "the vocabulary has 320 tokens"),
]


def _good_request_succeeds(served) -> None:
    chunks = list(served.client().stream_raw("ensemble", GOOD, "text_output"))
    assert chunks


@pytest.mark.parametrize(("model", "inputs", "message"), CASES, ids=[f"{m}-{msg}" for m, _, msg in CASES])
def test_bad_input_is_refused_clearly_and_server_keeps_serving(served, model, inputs, message):
    output = "output_ids" if model == "dhisparse" else "text_output"
    with pytest.raises(GenerationError, match=None) as error:
        list(served.client().stream_raw(model, inputs, output))
    assert message in str(error.value)
    _good_request_succeeds(served)


def test_wrong_dtype_and_unknown_input_are_refused_by_triton(served):
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = served.client()
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"To be"]], dtype=object))
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "FP32")  # config says INT32
    max_tokens.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    with pytest.raises(GenerationError, match="max_tokens") as error:
        list(client.stream_inputs("ensemble", [text, max_tokens], "text_output"))
    assert "INT32" in str(error.value)
    _good_request_succeeds(served)
    unknown = grpcclient.InferInput("no_such_input", [1, 1], "INT32")
    unknown.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    with pytest.raises(GenerationError, match="no_such_input"):
        list(client.stream_inputs("ensemble", [text, unknown], "text_output"))
    _good_request_succeeds(served)


@pytest.mark.parametrize("model", ["ensemble", "dhisparse_bls"])
@pytest.mark.parametrize(("body", "missing"),
                         [({"max_tokens": 4}, "text_input"), ({"text_input": "To be"}, "max_tokens")])
def test_http_generate_names_a_missing_input(served, model, body, missing):
    with pytest.raises(GenerationError, match=missing):
        served.client()._post(f"/v2/models/{model}/generate", body)
    _good_request_succeeds(served)


def test_http_error_is_clear(served):
    with pytest.raises(GenerationError, match="max_tokens must be an integer >= 1"):
        served.client().generate("To be", GenerationOptions(max_tokens=0))
    assert served.client().generate("To be", GenerationOptions(max_tokens=2))
