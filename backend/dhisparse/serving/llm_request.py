"""Translate the `dhisparse` model's input tensors (tensorrtllm_backend's `tensorrt_llm` names) into requests.

Every tensor carries Triton's batch dimension first: a request holds B prompts (row b of every tensor belongs to
prompt b) and becomes B `LLMRequest`s, each answered with `batch_index = b`. Every input of TensorRT-LLM's model
is declared; each is either honoured or, when it asks for something this engine does not do, refused with the
reason — never for merely being present with its neutral value. Defaults (= absent) in brackets.

- input_ids [L] / input_lengths [1] int32: the prompt; ids past input_lengths are padding (required / L).
- request_output_len [1] int32: max_tokens (required).
- end_id [1] int32: extra token that ends generation (-1: the model's EOS); pad_id: padding of input_ids.
- stop_words_list / bad_words_list [2, W] int32: tensorrtllm word lists of stop / banned token sequences.
- embedding_bias [V] fp32: added to the logits ([0]: none).
- temperature, runtime_top_k, runtime_top_p [1]: 0 = greedy / 0 = off / 1 (top_p 0 with top_k 0: greedy).
  runtime_top_p_decay is refused unless 1 (no top-p decay; _min and _reset_ids only matter with decay).
- repetition_penalty, presence_penalty, frequency_penalty [1] fp32: 1 / 0 / 0 (see SamplingParams).
- min_length (alias min_tokens) [1] int32: the output is at least this long, its ending token included: EOS and
  stop tokens are banned before (1).
- random_seed (alias seed) [1] uint64: random stream (default: derived from the request id).
- num_return_sequences [1] int32: n independent samples, `sequence_index` 0 … n-1 (1).
- exclude_input_in_output [1] bool: false: non-streaming output_ids start with the prompt (the model parameter
  of that name, true by default).
- return_log_probs, return_context_logits, return_generation_logits, return_perf_metrics,
  return_num_input_tokens, return_num_output_tokens [1] bool: extra outputs (false).
- return_finish_reason [1] bool (tensorrtllm_backend's `llmapi` model): a `finish_reason` output (false).
- return_final_perf_metrics [1] bool: the perf-metric outputs on each sequence's last response only (false): what a
  client that reads a request's totals needs (the OpenAI API's usage), without 13 more tensors on every streamed
  response (measured: +17 % latency for 32-token answers on a CPU machine).
- num_top_log_probs [1] int32: K most likely tokens with their log-probabilities at every generated position,
  outputs `top_token_ids` / `top_log_probs` (0 = none; at most 20, as OpenAI's `top_logprobs`).
- streaming [1] bool: one response per engine step (false).
- stream_whole_characters [1] bool: streamed responses end at UTF-8 character boundaries of the detokenized text:
  a token whose bytes leave a character incomplete waits for the tokens that complete it (false; the ensemble's
  preprocessing sets it, so that its per-chunk detokenisation gives whole characters). Needs the engine's tokenizer.
- beam_width [1] int32: refused unless 1 (len_penalty, early_stopping, beam_search_diversity_rate only matter
  for beam search and are accepted).
- draft_input_ids, draft_logits, draft_acceptance_threshold: refused when given (drafts come from the engine's
  own drafter).
- prompt_embedding_table, prompt_vocab_size, prompt_table_extra_ids: refused when non-empty / non-zero.
- lora_task_id, lora_weights, lora_config: refused when non-zero / non-empty (no LoRA).
- guided_decoding_guide_type, guided_decoding_guide [1] bytes: refused when non-empty (no guided decoding).
- decoder_input_ids, decoder_input_lengths: refused when non-empty / non-zero (decoder-only engine).
- stop [1] bool: true stops the open request with this Triton request id, only where the deployment allows it
  (`dhisparse-serve --allow-stop-by-request-id`; refused by default: any client could name another's id).
- cancel_request_id [1] bytes: control request of `dhisparse_bls`: cancel the open request with this id; it must
  carry the deployment's internal token (`dhisparse_auth`, see `internal_auth.py`), so clients cannot send it.

Outputs are built by `dhisparse.serving.llm_outputs`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dhisparse.errors import InvalidRequestError
from dhisparse.sampling.params import SamplingParams
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.tokenization import split_word_list

LLM_INPUTS = (
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list", "bad_words_list",
    "embedding_bias", "temperature", "runtime_top_k", "runtime_top_p", "runtime_top_p_min", "runtime_top_p_decay",
    "runtime_top_p_reset_ids", "random_seed", "seed", "streaming", "beam_width", "len_penalty", "early_stopping",
    "beam_search_diversity_rate", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_length",
    "min_tokens", "num_return_sequences", "exclude_input_in_output", "return_log_probs", "return_context_logits",
    "return_generation_logits", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
    "return_finish_reason", "return_final_perf_metrics", "num_top_log_probs", "stream_whole_characters",
    "draft_input_ids", "draft_logits",
    "draft_acceptance_threshold", "prompt_embedding_table", "prompt_vocab_size",
    "prompt_table_extra_ids", "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
    "guided_decoding_guide", "decoder_input_ids", "decoder_input_lengths", "stop", "cancel_request_id",
)
# What the engine models read: the client inputs plus the internal token of control requests (internal_auth.py).
CONTROLLED_INPUTS = (*LLM_INPUTS, "dhisparse_auth")
MAX_TOP_LOG_PROBS = 20  # num_top_log_probs' limit (OpenAI's top_logprobs allows 0..20)
# Scalar inputs whose only supported value is a neutral one: name -> (check, what is refused).
_NEUTRAL_SCALARS = {
    "beam_width": (lambda v: v == 1, "beam_width must be 1: beam search is not supported"),
    "runtime_top_p_decay": (lambda v: v == 1.0, "runtime_top_p_decay must be 1.0: top-p decay is not supported"),
    "prompt_vocab_size": (lambda v: v == 0, "prompt_vocab_size must be 0: prompt-embedding tables are not supported"),
    "lora_task_id": (lambda v: v == 0, "lora_task_id must be 0: LoRA adapters are not supported"),
}
# Tensor inputs refused when they hold anything (a non-empty tensor, a non-empty string or a non-zero value).
_EMPTY_ONLY = {
    "draft_input_ids": "external draft tokens are not supported (the engine drafts with its own drafter)",
    "draft_logits": "external draft logits are not supported (the engine drafts with its own drafter)",
    "prompt_embedding_table": "prompt-embedding tables (p-tuning) are not supported",
    "prompt_table_extra_ids": "prompt-embedding tables (p-tuning) are not supported",
    "lora_weights": "LoRA adapters are not supported",
    "lora_config": "LoRA adapters are not supported",
    "guided_decoding_guide_type": "guided decoding is not supported",
    "guided_decoding_guide": "guided decoding is not supported",
    "decoder_input_ids": "encoder-decoder models are not supported (decoder_input_ids)",
}


@dataclass(frozen=True)
class OutputOptions:
    """Which optional outputs a request asked for (tensorrtllm_backend's `return_*` inputs)."""

    log_probs: bool = False
    context_logits: bool = False
    generation_logits: bool = False
    perf_metrics: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    finish_reason: bool = False
    final_perf_metrics: bool = False  # perf metrics on the last response only
    top_log_probs: int = 0  # K of num_top_log_probs (0 = none)


@dataclass(frozen=True)
class LLMRequest:
    """One prompt of a Triton request, for the engine loop.

    Attributes:
        prompt_token_ids: prompt, int token ids.
        params: validated sampling parameters of sequence 0 (single-token stop words are in `stop_token_ids`;
            sequence i uses `params.for_sequence(i)`).
        streaming: send each engine update as it comes instead of one response at the end.
        stop_sequences: multi-token stop sequences, matched by the serving layer (`StopSequenceMatcher`).
        num_return_sequences: independent samples of this prompt.
        exclude_input_in_output: non-streaming output_ids hold only generated tokens (else prompt first).
        outputs: optional outputs asked for.
        batch_index: row of this prompt in its Triton request.
        whole_characters: streamed responses end at UTF-8 character boundaries (`stream_whole_characters`).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    streaming: bool
    stop_sequences: tuple[tuple[int, ...], ...]
    num_return_sequences: int = 1
    exclude_input_in_output: bool = True
    outputs: OutputOptions = OutputOptions()
    batch_index: int = 0
    whole_characters: bool = False


def _batch_size(inputs: Mapping[str, np.ndarray]) -> int:
    sizes = {name: np.asarray(v).shape[0] for name, v in inputs.items() if np.asarray(v).ndim >= 1}
    batch = sizes.get("input_ids", 1)
    wrong = {name: size for name, size in sizes.items() if size != batch}
    if wrong:
        raise InvalidRequestError(f"inputs disagree on the batch size: input_ids has {batch}, {wrong}")
    return batch


def _row(inputs: Mapping[str, np.ndarray], name: str, row: int) -> np.ndarray:
    array = np.asarray(inputs[name])
    return array[row] if array.ndim >= 1 else array


def _scalar(inputs: Mapping[str, np.ndarray], name: str, default: object, row: int = 0) -> object:
    if name not in inputs:
        return default
    values = _row(inputs, name, row).reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one value per prompt, got {values.size}")
    value = values[0]
    return value.decode() if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}")
    return float(value)


def _alias(inputs: Mapping[str, np.ndarray], names: tuple[str, str], default: object, row: int) -> object:
    """The value of an input known under two names (tensorrtllm_backend renamed some); both given must agree."""
    values = [_scalar(inputs, name, None, row) for name in names]
    given = [v for v in values if v is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise InvalidRequestError(f"{names[0]} ({given[0]}) and {names[1]} ({given[1]}) disagree: send one of them")
    return given[0] if given else default


def _refuse_unsupported(inputs: Mapping[str, np.ndarray], row: int) -> None:
    for name, (ok, message) in _NEUTRAL_SCALARS.items():
        value = _scalar(inputs, name, None, row)
        if value is not None and not ok(value):
            raise InvalidRequestError(f"{message}, got {value}")
    for name, reason in _EMPTY_ONLY.items():
        if name in inputs:
            values = _row(inputs, name, row).reshape(-1).tolist()
            if any(v not in (b"", "", 0) for v in values):
                raise InvalidRequestError(f"{name}: {reason}; leave it empty")
    if "decoder_input_lengths" in inputs and int(_scalar(inputs, "decoder_input_lengths", 0, row)) != 0:
        raise InvalidRequestError("decoder_input_lengths: encoder-decoder models are not supported; leave it 0")
    for name in ("len_penalty", "beam_search_diversity_rate", "draft_acceptance_threshold", "runtime_top_p_min"):
        if name in inputs:
            _finite(name, float(_scalar(inputs, name, 0.0, row)))


def _logit_bias(inputs: Mapping[str, np.ndarray], row: int, limits: RequestLimits) -> tuple[tuple[int, float], ...]:
    if "embedding_bias" not in inputs:
        return ()
    bias = _row(inputs, "embedding_bias", row).reshape(-1)
    limits.check_bias_size(bias.size)
    bias = bias.astype(np.float64)
    if not np.isfinite(bias).all():
        raise InvalidRequestError("embedding_bias must be finite")
    ids = np.flatnonzero(bias)
    return tuple((int(i), float(bias[i])) for i in ids)


def check_limits(inputs: Mapping[str, np.ndarray], limits: RequestLimits) -> None:
    """The per-request limits that can be checked on the raw tensors (bytes, batch, sequences, prompt and word-list
    sizes), before anything is converted or started; raises LimitExceededError naming the limit."""
    limits.check_request_bytes(inputs)
    batch = _batch_size(inputs)
    sequences = np.asarray(inputs.get("num_return_sequences", np.ones(1, dtype=np.int32))).reshape(-1)
    limits.check_batch(batch, int(sequences.max()) if sequences.size and sequences.dtype != object else 1)
    if "input_ids" in inputs:
        ids = np.asarray(inputs["input_ids"])
        limits.check_prompt_tokens(ids.size // max(batch, 1), "input_ids")
    for name in ("stop_words_list", "bad_words_list"):
        if name in inputs:
            array = np.asarray(inputs[name])
            limits.check_word_list_width(name, array.shape[-1] if array.ndim else 0)


def parse_llm_requests(inputs: Mapping[str, np.ndarray], exclude_input_default: bool = True,
                       limits: RequestLimits | None = None) -> list[LLMRequest]:
    """Validate and translate one Triton request (B prompts) into B requests; raise InvalidRequestError saying
    what is wrong (nothing is started then). `exclude_input_default` is the model's `exclude_input_in_output`;
    `limits` (default: `RequestLimits()`) are checked first (`check_limits`)."""
    limits = limits or RequestLimits()
    check_limits(inputs, limits)
    if "input_ids" not in inputs:
        raise InvalidRequestError("input_ids is missing: send the prompt's token ids")
    if "request_output_len" not in inputs:
        raise InvalidRequestError("request_output_len (max_tokens) is missing")
    return [_parse_row(inputs, row, exclude_input_default, limits) for row in range(_batch_size(inputs))]


def _parse_row(inputs: Mapping[str, np.ndarray], row: int, exclude_input_default: bool,
               limits: RequestLimits) -> LLMRequest:
    ids = _row(inputs, "input_ids", row).reshape(-1)
    length = int(_scalar(inputs, "input_lengths", ids.size, row))
    if not 0 <= length <= ids.size:
        raise InvalidRequestError(f"input_lengths {length} is outside [0, {ids.size}] (the input_ids length)")
    prompt = [int(t) for t in ids[:length]]
    if not prompt:
        raise InvalidRequestError("the prompt is empty: send at least one token")
    _refuse_unsupported(inputs, row)

    stop_words = split_word_list(_row(inputs, "stop_words_list", row)) if "stop_words_list" in inputs else []
    bad_words = split_word_list(_row(inputs, "bad_words_list", row)) if "bad_words_list" in inputs else []
    limits.check_word_tokens("stop_words_list", stop_words)
    limits.check_word_tokens("bad_words_list", bad_words)
    stop_token_ids = [word[0] for word in stop_words if len(word) == 1]
    end_id = int(_scalar(inputs, "end_id", -1, row))
    if end_id >= 0:
        stop_token_ids.append(end_id)
    elif end_id != -1:
        raise InvalidRequestError(f"end_id must be a token id or -1 (model default), got {end_id}")

    temperature = _finite("temperature", float(_scalar(inputs, "temperature", 0.0, row)))
    top_k = int(_scalar(inputs, "runtime_top_k", 0, row))
    top_p = _finite("top_p", float(_scalar(inputs, "runtime_top_p", 1.0, row)))
    if not 0.0 <= top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in [0, 1] (0 = off), got {top_p}")
    if top_p == 0.0:
        if top_k == 0 and "runtime_top_k" in inputs:
            temperature = 0.0  # TensorRT-LLM: top_k = top_p = 0 selects greedy decoding
        top_p = 1.0
    seed = _alias(inputs, ("random_seed", "seed"), None, row)
    num_sequences = int(_scalar(inputs, "num_return_sequences", 1, row))
    if num_sequences < 1:
        raise InvalidRequestError(f"num_return_sequences must be >= 1, got {num_sequences}")
    top = int(_scalar(inputs, "num_top_log_probs", 0, row))
    if not 0 <= top <= MAX_TOP_LOG_PROBS:
        raise InvalidRequestError(f"num_top_log_probs must be in [0, {MAX_TOP_LOG_PROBS}], got {top}")
    outputs = OutputOptions(**{field: bool(_scalar(inputs, f"return_{field}", False, row))
                               for field in OutputOptions.__dataclass_fields__ if field != "top_log_probs"},
                            top_log_probs=top)
    params = SamplingParams(
        max_tokens=int(_scalar(inputs, "request_output_len", 0, row)), temperature=temperature, top_k=top_k,
        top_p=top_p, seed=None if seed is None else int(seed), stop_token_ids=tuple(stop_token_ids),
        repetition_penalty=_finite("repetition_penalty", float(_scalar(inputs, "repetition_penalty", 1.0, row))),
        presence_penalty=_finite("presence_penalty", float(_scalar(inputs, "presence_penalty", 0.0, row))),
        frequency_penalty=_finite("frequency_penalty", float(_scalar(inputs, "frequency_penalty", 0.0, row))),
        # min_length counts the ending token too (TensorRT-LLM's default 1 is neutral): EOS may come as token
        # min_length at the earliest, i.e. after min_length - 1 generated tokens.
        min_tokens=max(int(_alias(inputs, ("min_length", "min_tokens"), 1, row)) - 1, 0), bad_words=tuple(bad_words),
        logit_bias=_logit_bias(inputs, row, limits), logprobs=outputs.log_probs,
        generation_logits=outputs.generation_logits or top > 0, context_logits=outputs.context_logits,
        perf_metrics=outputs.perf_metrics,
    )
    return LLMRequest(
        prompt_token_ids=prompt, params=params, streaming=bool(_scalar(inputs, "streaming", False, row)),
        stop_sequences=tuple(word for word in stop_words if len(word) > 1), num_return_sequences=num_sequences,
        exclude_input_in_output=bool(_scalar(inputs, "exclude_input_in_output", exclude_input_default, row)),
        outputs=outputs, batch_index=row,
        whole_characters=bool(_scalar(inputs, "stream_whole_characters", False, row)),
    )


def parse_llm_request(inputs: Mapping[str, np.ndarray], limits: RequestLimits | None = None) -> LLMRequest:
    """The single request of a batch-1 Triton request (see `parse_llm_requests`)."""
    requests = parse_llm_requests(inputs, limits=limits)
    if len(requests) != 1:
        raise InvalidRequestError(f"expected one prompt, got {len(requests)}")
    return requests[0]


def cancel_target(inputs: Mapping[str, np.ndarray]) -> str | None:
    """The request id a control request (`cancel_request_id`) asks to cancel, or None for a normal request."""
    if "cancel_request_id" not in inputs:
        return None
    value = np.asarray(inputs["cancel_request_id"]).reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def stop_requested(inputs: Mapping[str, np.ndarray]) -> bool:
    """Whether this is a `stop = true` request (TensorRT-LLM: stop the open request with the same request id)."""
    return "stop" in inputs and bool(np.asarray(inputs["stop"]).reshape(-1).any())


def output_arrays(token_ids: list[int]) -> dict[str, np.ndarray]:
    """`output_ids` [1, 1, T] int32 and `sequence_length` [1, 1] int32 for `token_ids` (the two outputs every
    response carries; the disaggregated models send only these)."""
    return {
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.asarray([[len(token_ids)]], dtype=np.int32),
    }
