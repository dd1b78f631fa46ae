"""How `disaggregated_serving_bls` reaches the `context` model: in its own server, or on another host.

- :class:`LocalContext`: a BLS request (``pb_utils.InferenceRequest``) to the `context` model of the same server
  (both roles in one tritonserver, ``dhisparse-serve --disaggregated``).
- :class:`RemoteContext`: the same request over Triton gRPC (``tritonclient.grpc``) to a server that serves only
  `context` (``dhisparse-serve --role context`` on another host; the orchestrating server is started with
  ``--role generation --context-url HOST:PORT``).

Same protocol either way: ``request_type = context_only`` in, the first token and ``context_phase_params`` out;
the bulk bytes never pass through here (the generation engine READs them over NIXL from the context engine).
``cancel(request_id)`` sends the context model a control request (``cancel_request_id``) that frees that context
request's region at once, for a client that cancelled before the generation phase pulled it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dhisparse.serving.internal_auth import AUTH_INPUT, CANCEL, InternalAuth

CONTEXT_OUTPUTS = ["output_ids", "sequence_length", "context_phase_params"]
# gRPC channel of RemoteContext: tritonclient's message limits, and reconnect backoff capped at 1 s (gRPC's default
# grows to 120 s, during which every request fails at once: a restarted context server would stay unused).
CHANNEL_ARGS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]


class ContextPhaseError(RuntimeError):
    """The context phase answered an error (or could not be reached); the message says which and why."""


class ContextClient(Protocol):
    def call(self, arrays: dict[str, np.ndarray], request_id: str) -> tuple[int, np.ndarray]:
        """Run the context phase: ``(first token, context_phase_params)``; raises ContextPhaseError."""
        ...

    def cancel(self, request_id: str) -> int:
        """Free the region of context request ``request_id`` now; returns how many regions were freed."""
        ...


def _control(request_id: str, auth: InternalAuth | None) -> dict[str, np.ndarray]:
    # input_lengths is a required input of the context model; a control request carries no prompt.
    arrays = {"cancel_request_id": np.array([[request_id.encode()]], dtype=object),
              "input_lengths": np.array([[0]], dtype=np.int32)}
    if auth is not None:
        arrays[AUTH_INPUT] = auth.token(CANCEL, request_id)
    return arrays


class LocalContext:
    """The `context` model of the orchestrator's own server, through BLS requests."""

    def __init__(self, pb: Any, model: str = "context", auth: InternalAuth | None = None) -> None:
        self._pb, self.model, self._auth = pb, model, auth

    def _exec(self, arrays: dict[str, np.ndarray], request_id: str) -> Any:
        tensors = [self._pb.Tensor(name, value) for name, value in arrays.items()]
        answer = self._pb.InferenceRequest(model_name=self.model, inputs=tensors, request_id=request_id,
                                           requested_output_names=CONTEXT_OUTPUTS).exec()
        if answer.has_error():
            raise ContextPhaseError(answer.error().message())
        return answer

    def _output(self, answer: Any, name: str) -> np.ndarray:
        return self._pb.get_output_tensor_by_name(answer, name).as_numpy()

    def call(self, arrays: dict[str, np.ndarray], request_id: str) -> tuple[int, np.ndarray]:
        answer = self._exec(arrays, request_id)
        return int(self._output(answer, "output_ids").reshape(-1)[0]), self._output(answer, "context_phase_params")

    def cancel(self, request_id: str) -> int:
        answer = self._exec(_control(request_id, self._auth), f"{request_id}-cancel")
        return int(self._output(answer, "sequence_length").reshape(-1)[0])


class RemoteContext:
    """The `context` model of another tritonserver (``url`` = its gRPC ``host:port``), through tritonclient."""

    def __init__(self, url: str, model: str = "context", timeout_s: float | None = None,
                 auth: InternalAuth | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self._auth = auth
        if not url or ":" not in url:
            raise ValueError(f"context_url must be HOST:PORT of the context server's gRPC endpoint, got {url!r}")
        self.url, self.model, self._timeout_s = url, model, timeout_s
        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)

    def _infer(self, arrays: dict[str, np.ndarray], request_id: str) -> Any:
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        inputs = []
        for name, value in arrays.items():
            tensor = self._grpc.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        outputs = [self._grpc.InferRequestedOutput(name) for name in CONTEXT_OUTPUTS]
        try:
            return self._client.infer(self.model, inputs, outputs=outputs, request_id=request_id,
                                      client_timeout=self._timeout_s)
        except InferenceServerException as error:
            raise ContextPhaseError(f"context server {self.url}: {error.message()}") from error

    def call(self, arrays: dict[str, np.ndarray], request_id: str) -> tuple[int, np.ndarray]:
        answer = self._infer(arrays, request_id)
        return int(answer.as_numpy("output_ids").reshape(-1)[0]), answer.as_numpy("context_phase_params")

    def cancel(self, request_id: str) -> int:
        answer = self._infer(_control(request_id, self._auth), f"{request_id}-cancel")
        return int(answer.as_numpy("sequence_length").reshape(-1)[0])

    def close(self) -> None:
        self._client.close()
