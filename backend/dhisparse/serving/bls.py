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

import codecs
import itertools
import threading
import uuid
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from dhisparse.errors import InvalidRequestError
from dhisparse.serving.text_processing import preprocess
from dhisparse.serving.tokenization import TokenBytes
from dhisparse.serving.triton_tensors import error_response, request_arrays, response

ENSEMBLE_INPUTS = (
    "text_input", "max_tokens", "bad_words", "stop_words", "end_id", "pad_id", "top_k", "top_p", "temperature",
    "length_penalty", "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty", "random_seed",
    "return_log_probs", "return_context_logits", "return_generation_logits", "beam_width", "stream",
)
# Ensemble input -> dhisparse input, for the ones passed through unchanged.
_PASS_THROUGH = {
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature", "length_penalty": "len_penalty",
    "repetition_penalty": "repetition_penalty", "min_length": "min_length", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "random_seed": "random_seed", "return_log_probs": "return_log_probs",
    "return_context_logits": "return_context_logits", "return_generation_logits": "return_generation_logits",
    "beam_width": "beam_width", "stream": "streaming",
}


def llm_inputs(tokenizer: Tokenizer, inputs: dict[str, np.ndarray], add_special_tokens: bool) -> dict[str, np.ndarray]:
    """Ensemble-style inputs -> the `dhisparse` model's inputs (tokenising as `preprocessing` does)."""
    if "max_tokens" not in inputs:
        raise InvalidRequestError("max_tokens is missing")
    renamed = {"QUERY": inputs.get("text_input"), "REQUEST_OUTPUT_LEN": inputs["max_tokens"],
               "STOP_WORDS_DICT": inputs.get("stop_words"), "BAD_WORDS_DICT": inputs.get("bad_words"),
               "END_ID": inputs.get("end_id"), "PAD_ID": inputs.get("pad_id")}
    pre = preprocess(tokenizer, {k: v for k, v in renamed.items() if v is not None}, add_special_tokens)
    out = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
           "request_output_len": pre["REQUEST_OUTPUT_LEN"], "stop_words_list": pre["STOP_WORDS_IDS"],
           "bad_words_list": pre["BAD_WORDS_IDS"], "end_id": pre["OUT_END_ID"], "pad_id": pre["OUT_PAD_ID"]}
    for source, target in _PASS_THROUGH.items():
        if source in inputs:
            out[target] = inputs[source]
    return out


class TextDecoder:
    """Token ids -> text in whole characters, across chunks (holds back an incomplete UTF-8 tail)."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int] | np.ndarray) -> str:
        """Text completed by these tokens (may be empty)."""
        return self._utf8.decode(self._token_bytes.decode(token_ids))

    def flush(self) -> str:
        """Whatever is held back (a truncated character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class BLSService:
    """Runs each `dhisparse_bls` request on its own thread (execute must not block other requests).

    Args:
        pb: the `triton_python_backend_utils` module.
        tokenizer / token_bytes: the engine's tokenizer and its byte table.
        llm_model: name of the decoupled LLM model to call.
        add_special_tokens: as for `preprocessing`.
    """

    def __init__(self, pb: Any, tokenizer: Tokenizer, token_bytes: TokenBytes, llm_model: str = "dhisparse",
                 add_special_tokens: bool = True) -> None:
        self._pb, self._tokenizer, self._token_bytes = pb, tokenizer, token_bytes
        self._llm_model, self._add_special_tokens = llm_model, add_special_tokens
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.cancel_poll_s = 0.1  # how often a request's cancellation is polled while no token arrives

    def start(self, request: Any) -> None:
        """Read the request's tensors now (they live only during execute) and respond from a thread."""
        sender = request.get_response_sender()
        try:
            inputs = request_arrays(self._pb, request, ENSEMBLE_INPUTS)
        except Exception as error:
            sender.send(error_response(self._pb, error), flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        threading.Thread(target=self._run, args=(inputs, sender), daemon=True).start()

    def _watch_cancellation(self, sender: Any, request_id: str, finished: threading.Event,
                            cancelled: threading.Event, lock: threading.Lock) -> None:
        """Poll the client's cancellation while no token arrives (waiting for admission, prefill) and pass it
        on to the engine. ``lock`` is held by the final send: ``is_cancelled`` after it crashes Triton 2.51."""
        while not finished.wait(self.cancel_poll_s):
            with lock:
                if finished.is_set() or cancelled.is_set() or not sender.is_cancelled():
                    continue
                cancelled.set()
            self._cancel(request_id)
            return

    def _llm_request(self, arrays: dict[str, np.ndarray], request_id: str) -> Any:
        tensors = [self._pb.Tensor(name, value) for name, value in arrays.items()]
        return self._pb.InferenceRequest(model_name=self._llm_model, inputs=tensors, request_id=request_id,
                                         requested_output_names=["output_ids", "sequence_length"])

    def _cancel(self, request_id: str) -> None:
        # Its own request id: a control request sharing the target's id stalls the target's BLS stream.
        target = np.array([[request_id.encode()]], dtype=object)
        control = self._llm_request({"cancel_request_id": target}, f"{request_id}-cancel")
        for _ in control.exec(decoupled=True):
            pass

    def _run(self, inputs: dict[str, np.ndarray], sender: Any) -> None:
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            arrays = llm_inputs(self._tokenizer, inputs, self._add_special_tokens)
        except Exception as error:
            sender.send(error_response(self._pb, error), flags=final)
            return
        streaming = bool(arrays.get("streaming", np.array([[False]])).reshape(-1)[0])
        request_id = f"bls-{self._prefix}-{next(self._ids)}"
        finished, cancelled, lock = threading.Event(), threading.Event(), threading.Lock()
        threading.Thread(target=self._watch_cancellation, args=(sender, request_id, finished, cancelled, lock),
                         daemon=True).start()

        def send_final(payload: Any) -> None:
            with lock:
                finished.set()
                if payload is None:
                    sender.send(flags=final)
                else:
                    sender.send(payload, flags=final)

        decoder, text = TextDecoder(self._token_bytes), []
        try:
            for inner in self._llm_request(arrays, request_id).exec(decoupled=True):
                if inner.has_error():
                    if not cancelled.is_set():
                        send_final(error_response(self._pb, RuntimeError(inner.error().message())))
                        return
                    continue
                if not cancelled.is_set():
                    with lock:
                        newly = sender.is_cancelled()
                    if newly:
                        cancelled.set()
                        self._cancel(request_id)
                output = self._pb.get_output_tensor_by_name(inner, "output_ids")
                if cancelled.is_set() or output is None:
                    continue
                length = int(self._pb.get_output_tensor_by_name(inner, "sequence_length").as_numpy().reshape(-1)[0])
                chunk = decoder.feed(output.as_numpy().reshape(-1)[:length])
                if streaming and chunk:
                    sender.send(response(self._pb, {"text_output": np.array([[chunk.encode()]], dtype=object)}))
                else:
                    text.append(chunk)
            if cancelled.is_set():
                send_final(error_response(self._pb, self._pb.TritonError(
                    "request cancelled by the client", self._pb.TritonError.CANCELLED)))
                return
            text.append(decoder.flush())
            body = "".join(text)
            if streaming and not body:
                send_final(None)
            else:
                send_final(response(self._pb, {"text_output": np.array([[body.encode()]], dtype=object)}))
        except Exception as error:
            if not finished.is_set():
                send_final(error_response(self._pb, RuntimeError(f"request failed: {error}")))
