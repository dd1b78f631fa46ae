"""Python client for a dhisparse Triton server (the `ensemble`, `dhisparse_bls` or `dhisparse` model).

* `stream` — gRPC bidirectional streaming (`tritonclient.grpc`): yields each text chunk as it arrives.
  Leaving the loop early (or closing the generator) cancels the request on the server.
* `generate` — plain HTTP, non-streaming. The ensemble is decoupled (its LLM step is), so Triton answers
  the classic `/infer` with 501; the HTTP generate extension (`POST /v2/models/<model>/generate`, JSON in,
  JSON out) works and is what this uses.
* `stream_token_ids` — token ids straight to the `dhisparse` model (no tokenizer involved).
* `metrics` — the `dhisparse_*` gauges from Triton's Prometheus endpoint.

Text is bytes: Triton strings are raw bytes and the ensemble's streamed chunks may split a UTF-8
character (concatenate them, or decode incrementally as the CLI does).
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

FINAL_FLAG = "triton_final_response"


class GenerationError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass(frozen=True)
class GenerationOptions:
    """Per-request generation settings (None: the server's default).

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 = greedy.
        top_k: 0 = off.  top_p: in (0, 1].  seed: random stream of this request.
        stop_words: strings that end generation (the output keeps the stop word).
        end_id: an extra token id that ends generation.
        bad_words: strings that may never be generated.
        repetition_penalty / presence_penalty / frequency_penalty: TensorRT-LLM's penalties (1 / 0 / 0 = off).
        min_length: output length (the ending token included) before EOS or a stop word may end it.
        embedding_bias: word -> weight added to the logits of the word's tokens.
        num_return_sequences: independent samples of the prompt (each response names its `sequence_index`).
        exclude_input_in_output: False: non-streaming text starts with the prompt (the server's default is True).
        return_log_probs / return_perf_metrics / return_context_logits / return_generation_logits: extra outputs.
    """

    max_tokens: int = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_words: tuple[str, ...] = field(default_factory=tuple)
    end_id: int | None = None
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_length: int | None = None
    embedding_bias: dict[str, float] = field(default_factory=dict)
    num_return_sequences: int | None = None
    exclude_input_in_output: bool | None = None
    return_log_probs: bool = False
    return_perf_metrics: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_words", tuple(self.stop_words))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "embedding_bias", dict(self.embedding_bias))

    def ensemble_fields(self) -> dict[str, object]:
        """Ensemble input name -> value for the options that are set."""
        out: dict[str, object] = {"max_tokens": self.max_tokens}
        for name, value in (("temperature", self.temperature), ("top_k", self.top_k), ("top_p", self.top_p),
                            ("random_seed", self.seed), ("end_id", self.end_id),
                            ("repetition_penalty", self.repetition_penalty),
                            ("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty),
                            ("min_length", self.min_length), ("num_return_sequences", self.num_return_sequences),
                            ("exclude_input_in_output", self.exclude_input_in_output)):
            if value is not None:
                out[name] = value
        if self.stop_words:
            out["stop_words"] = list(self.stop_words)
        if self.bad_words:
            out["bad_words"] = list(self.bad_words)
        if self.embedding_bias:
            out["embedding_bias_words"] = list(self.embedding_bias)
            out["embedding_bias_weights"] = list(self.embedding_bias.values())
        for name in ("return_log_probs", "return_perf_metrics", "return_context_logits", "return_generation_logits"):
            if getattr(self, name):
                out[name] = True
        return out


_DTYPES = {"text_input": ("BYTES", object), "stop_words": ("BYTES", object),
           "max_tokens": ("INT32", np.int32),
           "top_k": ("INT32", np.int32), "end_id": ("INT32", np.int32), "temperature": ("FP32", np.float32),
           "top_p": ("FP32", np.float32), "random_seed": ("UINT64", np.uint64), "stream": ("BOOL", bool),
           "input_ids": ("INT32", np.int32), "input_lengths": ("INT32", np.int32),
           "request_output_len": ("INT32", np.int32), "streaming": ("BOOL", bool),
           "runtime_top_k": ("INT32", np.int32), "runtime_top_p": ("FP32", np.float32),
           "bad_words": ("BYTES", object), "pad_id": ("INT32", np.int32), "beam_width": ("INT32", np.int32),
           "min_length": ("INT32", np.int32), "length_penalty": ("FP32", np.float32),
           "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
           "frequency_penalty": ("FP32", np.float32), "return_log_probs": ("BOOL", bool),
           "stop_words_list": ("INT32", np.int32), "bad_words_list": ("INT32", np.int32),
           "cancel_request_id": ("BYTES", object), "num_return_sequences": ("INT32", np.int32),
           "exclude_input_in_output": ("BOOL", bool), "return_perf_metrics": ("BOOL", bool),
           "return_context_logits": ("BOOL", bool), "return_generation_logits": ("BOOL", bool),
           "return_num_input_tokens": ("BOOL", bool), "return_num_output_tokens": ("BOOL", bool),
           "embedding_bias_words": ("BYTES", object), "embedding_bias_weights": ("FP32", np.float32),
           "embedding_bias": ("FP32", np.float32), "min_tokens": ("INT32", np.int32), "seed": ("UINT64", np.uint64),
           "decoder_text_input": ("BYTES", object), "guided_decoding_guide_type": ("BYTES", object),
           "guided_decoding_guide": ("BYTES", object), "lora_task_id": ("UINT64", np.uint64),
           "prompt_vocab_size": ("INT32", np.int32), "prompt_table_extra_id": ("UINT64", np.uint64),
           "lora_config": ("INT32", np.int32), "stop": ("BOOL", bool)}


def _grpc_inputs(values: dict[str, object]) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        datatype, dtype = _DTYPES[name]
        items = value if isinstance(value, list) else [value]
        if dtype is object:
            items = [v.encode() if isinstance(v, str) else v for v in items]
        array = np.array([items], dtype=dtype)  # [batch = 1, n]
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class DHiSparseClient:
    """Client of one server.

    Args:
        grpc_url: `host:port` of the gRPC endpoint.
        http_url: `host:port` of the HTTP endpoint.
        metrics_url: full URL of `/metrics` (default: port 8002 on the gRPC host).
        model: default model for text requests (`ensemble` or `dhisparse_bls`).
        timeout_s: longest wait for any single response.
    """

    def __init__(self, grpc_url: str = "127.0.0.1:8001", http_url: str = "127.0.0.1:8000",
                 metrics_url: str | None = None, model: str = "ensemble", timeout_s: float = 300.0) -> None:
        self.grpc_url, self.http_url, self.model, self.timeout_s = grpc_url, http_url, model, timeout_s
        self.metrics_url = metrics_url or f"http://{grpc_url.rsplit(':', 1)[0]}:8002/metrics"

    # ------------------------------------------------------------------------------------------- gRPC
    def stream_raw(self, model: str, values: dict[str, object], output: str) -> Iterator[np.ndarray]:
        """Stream any request: `values` maps input names to python values (one request, batch 1); yields
        each response's `output` array. Leaving early cancels the request."""
        return self.stream_inputs(model, _grpc_inputs(values), output)

    def stream_inputs(self, model: str, inputs: list, output: str) -> Iterator[np.ndarray]:
        """Like `stream_raw`, with ready-made `tritonclient.grpc.InferInput`s."""
        for arrays in self.stream_results(model, inputs):
            array = arrays.get(output)
            if array is not None and array.size:
                yield array

    def stream_results(self, model: str, inputs: list, outputs: Sequence[str] | None = None,
                       request_id: str = "") -> Iterator[dict[str, np.ndarray]]:
        """Send ready-made `InferInput`s over gRPC streaming; yields every response as `{output name: array}`
        (the `outputs` asked for; all the model has when None) until the final one."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        requested = None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]
        finished = False
        try:
            client.async_stream_infer(model, inputs, outputs=requested, request_id=request_id or uuid.uuid4().hex,
                                      enable_empty_final_response=True)
            while not finished:
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty as empty:
                    raise GenerationError(f"no response from {model} within {self.timeout_s} s") from empty
                if error is not None:
                    finished = True
                    raise GenerationError(error.message() if hasattr(error, "message") else str(error))
                reply = result.get_response()
                finished = reply.parameters[FINAL_FLAG].bool_param
                arrays = {out.name: result.as_numpy(out.name) for out in reply.outputs}
                if arrays:
                    yield arrays
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()

    def stream_options(self, prompt: str, options: GenerationOptions, model: str | None = None,
                       stream: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """A text request with every option of `options`; yields each response's arrays (`text_output`,
        `sequence_index`, `output_log_probs`, perf metrics, … as asked for)."""
        values = {"text_input": prompt, **options.ensemble_fields(), "stream": stream}
        return self.stream_results(model or self.model, _grpc_inputs(values))

    def stream(self, prompt: str, options: GenerationOptions, model: str | None = None) -> Iterator[bytes]:
        """Stream a text request over gRPC; yields UTF-8 byte chunks as they arrive."""
        values = {"text_input": prompt, **options.ensemble_fields(), "stream": True}
        for array in self.stream_raw(model or self.model, values, "text_output"):
            yield bytes(array.reshape(-1)[0])

    def stream_token_ids(self, input_ids: Sequence[int], options: GenerationOptions,
                         model: str = "dhisparse") -> Iterator[list[int]]:
        """Stream token ids from the LLM model itself; yields each response's new token ids."""
        values: dict[str, object] = {"input_ids": list(input_ids), "input_lengths": len(input_ids),
                                     "request_output_len": options.max_tokens, "streaming": True}
        for name, key in (("temperature", "temperature"), ("top_k", "runtime_top_k"), ("top_p", "runtime_top_p"),
                          ("seed", "random_seed"), ("end_id", "end_id")):
            if getattr(options, name) is not None:
                values[key] = getattr(options, name)
        for array in self.stream_raw(model, values, "output_ids"):
            yield [int(t) for t in array.reshape(-1)]

    # ------------------------------------------------------------------------------------------- HTTP
    def _post(self, path: str, body: dict[str, object]) -> bytes:
        request = urllib.request.Request(f"http://{self.http_url}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as error:
            raw = error.read().decode("utf-8", "replace")
            try:
                message = json.loads(raw).get("error", raw)
            except json.JSONDecodeError:
                message = raw
            raise GenerationError(message) from None

    def generate(self, prompt: str, options: GenerationOptions, model: str | None = None) -> bytes:
        """Non-streaming text request over plain HTTP (generate extension); returns the UTF-8 bytes."""
        body = {"text_input": prompt, **options.ensemble_fields(), "stream": False}
        raw = self._post(f"/v2/models/{model or self.model}/generate", body)
        # Triton writes text_output's bytes into the JSON as they are; surrogateescape keeps them exact.
        reply = json.loads(raw.decode("utf-8", "surrogateescape"))
        return reply["text_output"].encode("utf-8", "surrogateescape")

    def is_ready(self) -> bool:
        """True when the server answers its readiness probe."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self, prefix: str = "dhisparse_") -> dict[str, float]:
        """`{metric name without prefix: value}` for the metrics starting with `prefix` (labels dropped)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
                out[name[len(prefix):]] = float(value)
        return out
