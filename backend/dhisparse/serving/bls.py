"""The `dhisparse_bls` model: the ensemble's interface, orchestrated in Python (business-logic scripting).

Same inputs and output as the `ensemble` (tensorrtllm_backend names), with two things the ensemble
cannot give on Triton 2.51:

* **Cancellation reaches the engine.** Triton checks an ensemble's cancellation only between steps,
  so a cancelled ensemble stream keeps generating. Here each request's thread polls its own
  `is_cancelled()` and sends the `dhisparse` model a control request (`cancel = true` with the same
  request id), which aborts the engine request and frees its KV memory.
* **Streamed chunks are whole characters.** Token bytes go through an incremental UTF-8 decoder, so a
  chunk never ends inside a multi-byte character (the ensemble's stateless postprocessing can).

Tokenisation runs in-process with the same functions as the `preprocessing` model.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from dhisparse.errors import InvalidRequestError
from dhisparse.serving.internal_auth import AUTH_INPUT, CANCEL, InternalAuth
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.llm_outputs import PERF_METRIC_OUTPUTS
from dhisparse.serving.text_processing import preprocess
from dhisparse.serving.tokenization import TextDecoder, TokenBytes
from dhisparse.serving.triton_tensors import STUB_LOCK, error_response, request_arrays, response

# The ensemble's inputs (model_repository/ensemble/config.pbtxt), all of them.
ENSEMBLE_INPUTS = (
    "text_input", "decoder_text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words",
    "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
    "repetition_penalty", "min_length", "min_tokens", "presence_penalty", "frequency_penalty", "random_seed", "seed",
    "return_log_probs", "return_context_logits", "return_generation_logits", "return_perf_metrics",
    "return_num_input_tokens", "return_num_output_tokens", "return_finish_reason", "beam_width", "stream",
    "prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size", "embedding_bias_words",
    "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
    "guided_decoding_guide",
)
# Ensemble input -> preprocessing input.
_PREPROCESSED = {
    "text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
    "stop_words": "STOP_WORDS_DICT", "bad_words": "BAD_WORDS_DICT", "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
    "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS", "end_id": "END_ID", "pad_id": "PAD_ID",
    "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}
# Ensemble input -> dhisparse input, for the ones passed through unchanged (as the ensemble maps them).
_PASS_THROUGH = {
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "length_penalty": "len_penalty", "stream": "streaming",
    **{name: name for name in ENSEMBLE_INPUTS if name not in _PREPROCESSED and name not in (
        "top_k", "top_p", "length_penalty", "stream")},
}
# The dhisparse model's outputs (llm_outputs.py); output_ids / sequence_length become text_output here.
LLM_OUTPUTS = (
    "output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits", "generation_logits",
    "batch_index", "sequence_index", *PERF_METRIC_OUTPUTS, "num_input_tokens", "num_output_tokens", "finish_reason",
)


def llm_inputs(tokenizer: Tokenizer, inputs: dict[str, np.ndarray], add_special_tokens: bool,
               limits: RequestLimits | None = None) -> dict[str, np.ndarray]:
    """Ensemble-style inputs -> the `dhisparse` model's inputs (tokenising as `preprocessing` does, after the
    per-request limits are checked: `RequestLimits`)."""
    limits = limits or RequestLimits()
    limits.check_request_bytes(inputs)
    if "max_tokens" not in inputs:
        raise InvalidRequestError("max_tokens is missing")
    if "num_return_sequences" in inputs:
        sequences = np.asarray(inputs["num_return_sequences"]).reshape(-1)
        queries = np.asarray(inputs.get("text_input", np.empty((1, 1), dtype=object)))
        if sequences.size and sequences.dtype != object:
            limits.check_batch(queries.shape[0] if queries.ndim else 1, int(sequences.max()))
    renamed = {key: inputs[name] for name, key in _PREPROCESSED.items() if name in inputs}
    pre = preprocess(tokenizer, renamed, add_special_tokens, limits)
    out = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
           "request_output_len": pre["REQUEST_OUTPUT_LEN"], "stop_words_list": pre["STOP_WORDS_IDS"],
           "bad_words_list": pre["BAD_WORDS_IDS"], "embedding_bias": pre["EMBEDDING_BIAS"],
           "end_id": pre["OUT_END_ID"], "pad_id": pre["OUT_PAD_ID"]}
    for source, target in _PASS_THROUGH.items():
        if source in inputs:
            out[target] = inputs[source]
    return out


class BLSService:
    """Runs each `dhisparse_bls` request on its own thread (execute must not block other requests).

    Args:
        pb: the `triton_python_backend_utils` module.
        tokenizer / token_bytes: the engine's tokenizer and its byte table.
        llm_model: name of the decoupled LLM model to call.
        add_special_tokens: as for `preprocessing`.
    """

    def __init__(self, pb: Any, tokenizer: Tokenizer, token_bytes: TokenBytes, llm_model: str = "dhisparse",
                 add_special_tokens: bool = True, limits: RequestLimits | None = None,
                 auth: InternalAuth | None = None) -> None:
        self._pb, self._tokenizer, self._token_bytes = pb, tokenizer, token_bytes
        self._llm_model, self._add_special_tokens = llm_model, add_special_tokens
        self._limits = limits or RequestLimits()
        self._auth = auth  # signs the cancel control requests the `dhisparse` model accepts only from us
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.cancel_poll_s = 0.1  # how often a request's cancellation is polled while no response arrives

    def start(self, request: Any) -> None:
        """Read the request's tensors now (they live only during execute) and respond from a thread."""
        sender = request.get_response_sender()
        try:
            with STUB_LOCK:
                inputs = request_arrays(self._pb, request, ENSEMBLE_INPUTS)
        except Exception as error:
            sender.send(error_response(self._pb, error), flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        threading.Thread(target=self._run, args=(inputs, sender), daemon=True).start()

    def _watch_cancellation(self, sender: _GuardedSender, request_id: str) -> None:
        """Poll the client's cancellation while no response arrives (waiting for admission, prefill) and pass it
        on to the engine."""
        while not sender.finished.wait(self.cancel_poll_s):
            if sender.claim_cancellation():
                self._cancel(request_id)
                return

    def _llm_request(self, arrays: dict[str, np.ndarray], request_id: str) -> Any:
        tensors = [self._pb.Tensor(name, value) for name, value in arrays.items()]
        return self._pb.InferenceRequest(model_name=self._llm_model, inputs=tensors, request_id=request_id,
                                         requested_output_names=list(LLM_OUTPUTS))

    def _cancel(self, request_id: str) -> None:
        # Its own request id: a control request sharing the target's id stalls the target's BLS stream.
        target = np.array([[request_id.encode()]], dtype=object)
        arrays = {"cancel_request_id": target}
        if self._auth is not None:
            arrays[AUTH_INPUT] = self._auth.token(CANCEL, request_id)
        control = self._llm_request(arrays, f"{request_id}-cancel")
        for _ in control.exec(decoupled=True):
            pass

    def _run(self, inputs: dict[str, np.ndarray], triton_sender: Any) -> None:
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = _GuardedSender(triton_sender, final)
        try:
            arrays = llm_inputs(self._tokenizer, inputs, self._add_special_tokens, self._limits)
        except Exception as error:
            sender.send(error_response(self._pb, error), flags=final)
            return
        streaming = bool(arrays.get("streaming", np.array([[False]])).reshape(-1)[0])
        sequences = int(arrays["input_ids"].shape[0]) * int(
            np.asarray(arrays.get("num_return_sequences", np.array([[1]]))).reshape(-1)[0])
        request_id = f"bls-{self._prefix}-{next(self._ids)}"
        decoders: dict[tuple[int, int], TextDecoder] = {}
        pending: dict[tuple[int, int], tuple[list[str], dict[str, np.ndarray]]] = {}  # non-streaming, one sequence
        threading.Thread(target=self._watch_cancellation, args=(sender, request_id), daemon=True).start()
        try:
            for inner in self._llm_request(arrays, request_id).exec(decoupled=True):
                with STUB_LOCK:  # one thread at a time builds and sends (see triton_tensors.STUB_LOCK)
                    if inner.has_error():
                        if not sender.cancelled:
                            sender.send(error_response(self._pb, RuntimeError(inner.error().message())), flags=final)
                            return
                        continue
                    if sender.claim_cancellation():
                        self._cancel(request_id)
                    output = self._pb.get_output_tensor_by_name(inner, "output_ids")
                    if sender.cancelled or output is None:
                        continue
                    extras = {name: tensor.as_numpy() for name in LLM_OUTPUTS[2:]
                              if (tensor := self._pb.get_output_tensor_by_name(inner, name)) is not None}
                    key = (int(extras["batch_index"].reshape(-1)[0]), int(extras["sequence_index"].reshape(-1)[0]))
                    decoder = decoders.setdefault(key, TextDecoder(self._token_bytes))
                    length = int(self._pb.get_output_tensor_by_name(inner, "sequence_length").as_numpy().reshape(-1)[0])
                    chunk = decoder.feed(output.as_numpy().reshape(-1)[:length])
                    if streaming:
                        if chunk or len(extras) > 2:
                            sender.send(response(self._pb, {"text_output": _text(chunk), **extras}))
                    else:
                        text, _ = pending.setdefault(key, ([], {}))
                        text.append(chunk)
                        pending[key] = (text, extras)
            if sender.cancelled:
                sender.send(error_response(self._pb, self._pb.TritonError(
                    "request cancelled by the client", self._pb.TritonError.CANCELLED)), flags=final)
                return
            with STUB_LOCK:
                self._finish(sender, streaming, sequences, decoders, pending)
        except Exception as error:
            if not sender.finished.is_set():
                sender.send(error_response(self._pb, RuntimeError(f"request failed: {error}")), flags=final)
        finally:
            sender.finished.set()  # stops the cancellation watcher

    def _finish(self, sender: Any, streaming: bool, sequences: int, decoders: dict[tuple[int, int], TextDecoder],
                pending: dict[tuple[int, int], tuple[list[str], dict[str, np.ndarray]]]) -> None:
        """Send what is held back: streaming, each sequence's incomplete character; otherwise each sequence's whole
        text. A single sequence's last response carries the final flag (one response for a non-streaming
        request, as before); several sequences end with a flags-only final response."""
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        bodies = []
        for key, decoder in sorted(decoders.items()):
            tail = decoder.flush()
            if streaming:
                if tail:
                    bodies.append({"text_output": _text(tail), "batch_index": _index(key[0]),
                                   "sequence_index": _index(key[1])})
            else:
                text, extras = pending[key]
                bodies.append({**extras, "text_output": _text("".join(text) + tail)})
        if sequences == 1 and bodies:
            sender.send(response(self._pb, bodies[0]), flags=final)
            return
        for body in bodies:
            sender.send(response(self._pb, body))
        sender.send(flags=final)


class _GuardedSender:
    """A response sender that serialises the final response with ``is_cancelled`` polls: ``is_cancelled`` on a
    sender whose final response has gone crashes Triton 2.51. ``claim_cancellation`` is true once, for whichever
    thread (the request's, or its watcher) first sees the client's cancellation."""

    def __init__(self, sender: Any, final_flag: int) -> None:
        self._sender, self._final_flag = sender, final_flag
        self._lock = threading.Lock()
        self.finished = threading.Event()
        self.cancelled = False

    def send(self, response: Any = None, flags: int = 0) -> None:
        with STUB_LOCK, self._lock:
            if flags & self._final_flag:
                self.finished.set()
            if response is None:
                self._sender.send(flags=flags)
            else:
                self._sender.send(response, flags=flags)

    def claim_cancellation(self) -> bool:
        with STUB_LOCK, self._lock:
            if self.cancelled or self.finished.is_set() or not self._sender.is_cancelled():
                return False
            self.cancelled = True
            return True


def _text(text: str) -> np.ndarray:
    """`text_output` as tensorrtllm_backend's BLS returns it: one string per sequence, 1-D."""
    return np.array([text.encode()], dtype=object)


def _index(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)
