"""One generated sequence through Triton: a gRPC stream to the deployment's LLM model, token ids in and out.

The front end talks to the model that runs the engine with tensorrtllm_backend's `tensorrt_llm` tensor names:
`dhisparse` (co-located) or `disaggregated_serving_bls` (prefill/decode disaggregation), whichever the server has.
So every request goes through the same Triton deployment as the `ensemble`'s: same engine, metrics and faults.
Each sequence is its own stream (`tritonclient.grpc.aio`) asking for streamed responses; cancelling the consuming
task (a client that disconnects) or closing the iterator early (a stop string matched) cancels the gRPC call,
which the model sees as `is_cancelled()` and answers by aborting the engine request, freeing every tier.

Inputs the model does not declare are never sent; a parameter that needs one is refused (`require`), and outputs
it does not declare are not asked for (the disaggregated orchestrator returns only tokens: no log-probs, no
finish_reason, which is then inferred from the token count).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from dhisparse.serving.openai.errors import OpenAIError, bad_request, from_triton

LLM_MODELS = ("dhisparse", "disaggregated_serving_bls")  # the first one the server has is used
_OUTPUTS = ("output_ids", "sequence_length", "output_log_probs", "top_token_ids", "top_log_probs", "finish_reason",
            "total_accepted_draft_tokens", "total_draft_tokens", "kv_cache_reused_block")


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate (validated OpenAI parameters, engine units).

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: tokens to generate at most.
        temperature / top_p / top_k: sampling (temperature 0 = greedy; top_k 0 = off).
        seed: random stream (None: the engine derives one from the request id).
        presence_penalty / frequency_penalty / repetition_penalty: TensorRT-LLM's penalties (0 / 0 / 1 = off).
        min_tokens: tokens generated before EOS may end the sequence.
        logit_bias: token id -> value added to its logit.
        logprobs: None = none; 0 = the chosen token's; K > 0 = also the K most likely tokens'.
        stats_every_response: the request's statistics with every response, not only the last (a sequence that
            a stop string may end early is cancelled before its last response).
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    stats_every_response: bool = False


@dataclass
class SequenceChunk:
    """What one streamed response carried: new tokens (with their log-probs and top-K alternatives when asked for),
    the finish reason on the last one (None before, or when the model does not report it), and the request's
    statistics so far (drafts proposed / accepted, prompt pages reused from the prefix cache)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stats: dict[str, int] = field(default_factory=dict)


def _tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


class EngineClient:
    """The deployment's LLM model over Triton gRPC (one `tritonclient.grpc.aio` client per event loop).

    Args:
        grpc_url: ``host:port`` of Triton's gRPC endpoint.
        model: the LLM model's name; None = discover (`LLM_MODELS`) at `connect`.
    """

    def __init__(self, grpc_url: str, model: str | None = None) -> None:
        self.grpc_url, self.model = grpc_url, model
        self.inputs: frozenset[str] = frozenset()
        self.outputs: frozenset[str] = frozenset()
        self._client: grpcaio.InferenceServerClient | None = None

    async def connect(self) -> None:
        """Open the client and read the model's declared inputs and outputs (retried by `ready`)."""
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.grpc_url)
        for name in ([self.model] if self.model else LLM_MODELS):
            try:
                config = (await self._client.get_model_config(name, as_json=True))["config"]
            except InferenceServerException:
                continue
            self.model = name
            self.inputs = frozenset(i["name"] for i in config.get("input", []))
            self.outputs = frozenset(o["name"] for o in config.get("output", []))
            return
        raise OpenAIError(503, f"the Triton server at {self.grpc_url} serves none of {', '.join(LLM_MODELS)}")

    async def ready(self) -> bool:
        """Whether the LLM model is loaded and ready."""
        try:
            if not self.inputs:
                await self.connect()
            assert self._client is not None and self.model is not None
            return bool(await self._client.is_model_ready(self.model))
        except (InferenceServerException, OpenAIError):
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def require(self, feature: str, param: str, *inputs: str) -> None:
        """Refuse `param` (400) when the model lacks an input that `feature` needs."""
        missing = [name for name in inputs if name not in self.inputs]
        if missing:
            raise bad_request(f"{param}: {feature} is not available in this deployment (the {self.model} model has "
                              f"no {', '.join(missing)} input)", param)

    def _arrays(self, request: SequenceRequest) -> dict[str, np.ndarray]:
        ids = np.asarray([request.prompt_ids], dtype=np.int32)
        arrays = {"input_ids": ids, "input_lengths": np.asarray([[ids.shape[1]]], dtype=np.int32),
                  "request_output_len": np.asarray([[request.max_tokens]], dtype=np.int32),
                  "streaming": np.asarray([[True]]),
                  "temperature": np.asarray([[request.temperature]], dtype=np.float32),
                  "runtime_top_p": np.asarray([[request.top_p]], dtype=np.float32)}
        optional: dict[str, tuple[bool, np.ndarray]] = {
            "runtime_top_k": (request.top_k > 0, np.asarray([[request.top_k]], dtype=np.int32)),
            "random_seed": (request.seed is not None, np.asarray([[request.seed or 0]], dtype=np.uint64)),
            "presence_penalty": (request.presence_penalty != 0, np.asarray([[request.presence_penalty]], np.float32)),
            "frequency_penalty": (request.frequency_penalty != 0,
                                  np.asarray([[request.frequency_penalty]], np.float32)),
            "repetition_penalty": (request.repetition_penalty != 1,
                                   np.asarray([[request.repetition_penalty]], np.float32)),
            "min_length": (request.min_tokens > 0, np.asarray([[request.min_tokens + 1]], dtype=np.int32)),
            "return_log_probs": (request.logprobs is not None, np.asarray([[True]])),
            "num_top_log_probs": (bool(request.logprobs), np.asarray([[request.logprobs or 0]], dtype=np.int32)),
            "return_finish_reason": (True, np.asarray([[True]])),
            # the totals usage needs, on the last response only (every response costs ~17 % latency)
            "return_final_perf_metrics": (not request.stats_every_response, np.asarray([[True]])),
            "return_perf_metrics": (request.stats_every_response, np.asarray([[True]])),
        }
        if request.logit_bias:
            bias = np.zeros((1, max(request.logit_bias) + 1), dtype=np.float32)
            for token, value in request.logit_bias.items():
                bias[0, token] = value
            optional["embedding_bias"] = (True, bias)
        for name, (wanted, array) in optional.items():
            if wanted and name in self.inputs:
                arrays[name] = array
        return arrays

    async def generate(self, request: SequenceRequest, request_id: str) -> AsyncGenerator[SequenceChunk, None]:
        """Stream one sequence. Raises OpenAIError (classified by `errors.from_triton`) when the deployment answers
        with an error or cannot be reached. Leaving the iteration early cancels the request on the server."""
        if self._client is None or not self.inputs:
            await self.connect()
        assert self._client is not None and self.model is not None
        tensors = [_tensor(name, array) for name, array in self._arrays(request).items()]
        outputs = [grpcclient.InferRequestedOutput(name) for name in _OUTPUTS if name in self.outputs]

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": tensors, "outputs": outputs, "request_id": request_id}

        responses = self._client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise from_triton(error.message() if hasattr(error, "message") else str(error))
                chunk = self._chunk(result)
                finished = chunk.finish_reason is not None
                yield chunk
            finished = True
        except InferenceServerException as error:
            raise from_triton(str(error)) from None
        except OpenAIError:
            raise
        except Exception as error:  # grpc.aio.AioRpcError and the like: Triton unreachable or gone
            if hasattr(error, "details"):
                raise from_triton(f"Triton unavailable: {error.details()}") from None
            raise
        finally:
            if not finished:
                responses.cancel()  # the model sees is_cancelled() and aborts the engine request

    @staticmethod
    def _chunk(result: grpcclient.InferResult) -> SequenceChunk:
        def get(name: str) -> np.ndarray | None:
            array: np.ndarray | None = result.as_numpy(name)
            return array

        lengths, ids_out = get("sequence_length"), get("output_ids")
        if lengths is None or ids_out is None:
            raise OpenAIError(500, f"the {', '.join(LLM_MODELS)} model answered without output_ids / sequence_length")
        length = int(lengths.reshape(-1)[0])
        chunk = SequenceChunk([int(t) for t in ids_out.reshape(-1)[:length]])
        if (log_probs := get("output_log_probs")) is not None:
            chunk.log_probs = [float(v) for v in log_probs.reshape(-1)[:length]]
        ids, values = get("top_token_ids"), get("top_log_probs")
        if ids is not None and values is not None and ids.size:
            k = ids.shape[-1]
            chunk.top = [list(zip(map(int, i), map(float, v), strict=True))
                         for i, v in zip(ids.reshape(-1, k)[:length], values.reshape(-1, k)[:length], strict=True)]
        if (reason := get("finish_reason")) is not None:
            text = reason.reshape(-1)[0]
            text = text.decode() if isinstance(text, bytes) else str(text)
            chunk.finish_reason = text or None
        for name in ("total_accepted_draft_tokens", "total_draft_tokens", "kv_cache_reused_block"):
            if (value := get(name)) is not None:
                chunk.stats[name] = int(value.reshape(-1)[0])
        return chunk
