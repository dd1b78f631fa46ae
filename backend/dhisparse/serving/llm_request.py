"""Translate the `dhisparse` model's input tensors (tensorrtllm_backend's `tensorrt_llm` names) into a request.

Every tensor carries Triton's batch dimension first; a request holds exactly one prompt, so it is 1.

| input                | shape / dtype     | meaning (default when absent)                                  |
| -------------------- | ----------------- | -------------------------------------------------------------- |
| input_ids            | [1, L] int32      | prompt token ids (required)                                    |
| input_lengths        | [1, 1] int32      | prompt length; ids beyond it are padding (L)                   |
| request_output_len   | [1, 1] int32      | max_tokens (required)                                          |
| end_id               | [1, 1] int32      | extra token that ends generation (-1: only the model's EOS)    |
| pad_id               | [1, 1] int32      | accepted and ignored (padding is cut by input_lengths)         |
| stop_words_list      | [1, 2, W] int32   | stop sequences in tensorrtllm's word-list format (none)        |
| bad_words_list       | [1, 2, W] int32   | must be empty: not supported                                   |
| temperature          | [1, 1] fp32       | 0 = greedy (0)                                                 |
| runtime_top_k        | [1, 1] int32      | 0 = off (0)                                                    |
| runtime_top_p        | [1, 1] fp32       | in [0, 1]; 0 = off, and top_k = top_p = 0 means greedy as in   |
|                      |                   | TensorRT-LLM (1)                                               |
| random_seed          | [1, 1] uint64     | per-request random stream (derived from the request id)        |
| streaming            | [1, 1] bool       | one response per engine step instead of one at the end (false) |
| beam_width           | [1, 1] int32      | must be 1                                                      |
| len_penalty          | [1, 1] fp32       | accepted (only matters for beam search)                        |
| repetition_penalty   | [1, 1] fp32       | must be 1                                                      |
| presence_penalty, frequency_penalty | fp32 | must be 0                                                      |
| min_length           | [1, 1] int32      | must be <= 1                                                   |
| return_log_probs, return_context_logits, return_generation_logits | bool | must be false       |
| cancel_request_id    | [1, 1] bytes      | control request: cancel the open request with this request id  |

Outputs: `output_ids` [1, 1, T] int32 (generated tokens only; in streaming mode the new ones) and
`sequence_length` [1, 1] int32 = T.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dhisparse.engine.sampling import SamplingParams
from dhisparse.errors import InvalidRequestError
from dhisparse.serving.tokenization import split_word_list

LLM_INPUTS = (
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list", "bad_words_list",
    "temperature", "runtime_top_k", "runtime_top_p", "random_seed", "streaming", "beam_width", "len_penalty",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_length", "return_log_probs",
    "return_context_logits", "return_generation_logits", "cancel_request_id",
)
# Inputs whose only supported value is a neutral one: name -> (check, message).
_NEUTRAL = {
    "beam_width": (lambda v: v == 1, "beam_width must be 1 (beam search is not supported)"),
    "repetition_penalty": (lambda v: v == 1.0, "repetition_penalty must be 1.0 (penalties are not supported)"),
    "presence_penalty": (lambda v: v == 0.0, "presence_penalty must be 0.0 (penalties are not supported)"),
    "frequency_penalty": (lambda v: v == 0.0, "frequency_penalty must be 0.0 (penalties are not supported)"),
    "min_length": (lambda v: v <= 1, "min_length must be <= 1 (minimum lengths are not supported)"),
    "return_log_probs": (lambda v: not v, "return_log_probs is not supported"),
    "return_context_logits": (lambda v: not v, "return_context_logits is not supported"),
    "return_generation_logits": (lambda v: not v, "return_generation_logits is not supported"),
}


@dataclass(frozen=True)
class LLMRequest:
    """One request for the engine loop.

    Attributes:
        prompt_token_ids: prompt, int token ids.
        params: validated sampling parameters (single-token stop words are in `stop_token_ids`).
        streaming: send each engine update as it comes instead of one response at the end.
        stop_sequences: multi-token stop sequences, matched by the serving layer (`StopSequenceMatcher`).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    streaming: bool
    stop_sequences: tuple[tuple[int, ...], ...]


def _one(inputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    array = np.asarray(inputs[name])
    if array.ndim < 1 or array.shape[0] != 1:
        raise InvalidRequestError(f"{name}: one prompt per request (batch size 1), got shape {list(array.shape)}")
    return array[0]


def _scalar(inputs: Mapping[str, np.ndarray], name: str, default: object) -> object:
    if name not in inputs:
        return default
    row = _one(inputs, name).reshape(-1)
    if row.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one value, got {row.size}")
    return row[0].item()


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}")
    return float(value)


def parse_llm_request(inputs: Mapping[str, np.ndarray]) -> LLMRequest:
    """Validate and translate one request's input tensors; raise InvalidRequestError saying what is wrong."""
    if "input_ids" not in inputs:
        raise InvalidRequestError("input_ids is missing: send the prompt's token ids")
    if "request_output_len" not in inputs:
        raise InvalidRequestError("request_output_len (max_tokens) is missing")
    ids = _one(inputs, "input_ids").reshape(-1)
    length = int(_scalar(inputs, "input_lengths", ids.size))
    if not 0 <= length <= ids.size:
        raise InvalidRequestError(f"input_lengths {length} is outside [0, {ids.size}] (the input_ids length)")
    prompt = [int(t) for t in ids[:length]]
    if not prompt:
        raise InvalidRequestError("the prompt is empty: send at least one token")

    for name, (ok, message) in _NEUTRAL.items():
        value = _scalar(inputs, name, None)
        if value is not None and not ok(value):
            raise InvalidRequestError(f"{message}, got {value}")
    if "len_penalty" in inputs:
        _finite("len_penalty", float(_scalar(inputs, "len_penalty", 1.0)))
    if "bad_words_list" in inputs and split_word_list(_one(inputs, "bad_words_list")):
        raise InvalidRequestError("bad_words is not supported by this engine; send an empty list or none")

    stop_words = split_word_list(_one(inputs, "stop_words_list")) if "stop_words_list" in inputs else []
    stop_token_ids = [word[0] for word in stop_words if len(word) == 1]
    end_id = int(_scalar(inputs, "end_id", -1))
    if end_id >= 0:
        stop_token_ids.append(end_id)
    elif end_id != -1:
        raise InvalidRequestError(f"end_id must be a token id or -1 (model default), got {end_id}")

    temperature = _finite("temperature", float(_scalar(inputs, "temperature", 0.0)))
    top_k = int(_scalar(inputs, "runtime_top_k", 0))
    top_p = _finite("top_p", float(_scalar(inputs, "runtime_top_p", 1.0)))
    if not 0.0 <= top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in [0, 1] (0 = off), got {top_p}")
    if top_p == 0.0:
        if top_k == 0 and "runtime_top_k" in inputs:
            temperature = 0.0  # TensorRT-LLM: top_k = top_p = 0 selects greedy decoding
        top_p = 1.0
    seed = _scalar(inputs, "random_seed", None)
    params = SamplingParams(
        max_tokens=int(_scalar(inputs, "request_output_len", 0)), temperature=temperature, top_k=top_k,
        top_p=top_p, seed=None if seed is None else int(seed), stop_token_ids=tuple(stop_token_ids),
    )
    return LLMRequest(
        prompt_token_ids=prompt, params=params, streaming=bool(_scalar(inputs, "streaming", False)),
        stop_sequences=tuple(word for word in stop_words if len(word) > 1),
    )


def cancel_target(inputs: Mapping[str, np.ndarray]) -> str | None:
    """The request id a control request (`cancel_request_id`) asks to cancel, or None for a normal request."""
    if "cancel_request_id" not in inputs:
        return None
    value = np.asarray(inputs["cancel_request_id"]).reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def output_arrays(token_ids: list[int]) -> dict[str, np.ndarray]:
    """`output_ids` [1, 1, T] int32 and `sequence_length` [1, 1] int32 for `token_ids`."""
    return {
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.asarray([[len(token_ids)]], dtype=np.int32),
    }
