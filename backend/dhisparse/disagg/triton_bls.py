"""The `disaggregated_serving_bls` orchestrator: `context` (context_only) → `generation` (generation_only).

Same inputs and outputs as the `dhisparse` model (tensorrtllm_backend's `tensorrt_llm` names: ``input_ids``,
``request_output_len``, ``streaming``, … → ``output_ids``, ``sequence_length``), so the `ensemble` uses it in place
of the LLM model. Per request, on its own thread:

1. call `context` with ``request_type = context_only``; its response carries the first token and
   ``context_phase_params`` (UINT8: NIXL metadata and descriptors of the prompt's history);
2. streaming: send the first token to the client at once (tensorrtllm_backend leaves this as a TODO);
3. call `generation` (decoupled) with the same inputs, ``request_type = generation_only`` and that tensor, and
   forward its tokens; its first update repeats the first token, which is dropped when it was already sent.

The `context` model is reached through a :class:`ContextClient`: in the same server (BLS request), or on another
host over Triton gRPC when the model is configured with a ``context_url`` (``dhisparse-serve --role generation
--context-url HOST:PORT``); the history itself always moves by NIXL READ between the two engine processes.

Errors of either phase reach the client as an error response. A client that cancels (or disconnects) is noticed
between responses. Cancelled during the context phase (or a generation phase that fails before it pulled the
history): the orchestrator sends `context` a control request (``cancel_request_id``) that frees the prompt's
region at once, instead of at its hold deadline. Cancelled during the generation phase: a control request
(``cancel_request_id``) to `generation` aborts the generation request, which frees its KV memory (and, for a
request still waiting for admission, tells the prefill side over NIXL to free its region).
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

import numpy as np

from dhisparse.disagg.context_client import ContextClient, ContextPhaseError, LocalContext
from dhisparse.serving.internal_auth import AUTH_INPUT, CANCEL, CONTEXT, GENERATION, InternalAuth, request_subject
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.llm_request import LLM_INPUTS, check_limits, output_arrays
from dhisparse.serving.triton_tensors import error_response, request_arrays, response

INPUTS = tuple(name for name in LLM_INPUTS if name != "cancel_request_id")


class DisaggregatedBLS:
    """Args: pb: `triton_python_backend_utils`; context: how to reach `context`; auth: the deployment's internal key,
    which signs every request to `context` and `generation` (they refuse any other caller); limits: checked on the
    client's request before the context phase starts."""

    def __init__(self, pb: Any, context: ContextClient | None = None, generation_model: str = "generation",
                 auth: InternalAuth | None = None, limits: RequestLimits | None = None) -> None:
        self._pb, self._generation = pb, generation_model
        self._auth, self._limits = auth, limits or RequestLimits()
        self._context: ContextClient = context if context is not None else LocalContext(pb, auth=auth)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def start(self, request: Any) -> None:
        """Read the tensors now (they live only during execute) and orchestrate from a thread."""
        sender = request.get_response_sender()
        inputs = request_arrays(self._pb, request, INPUTS)
        threading.Thread(target=self._run, args=(inputs, sender), daemon=True).start()

    def _request(self, model: str, arrays: dict[str, np.ndarray], request_id: str, outputs: list[str]) -> Any:
        tensors = [self._pb.Tensor(name, value) for name, value in arrays.items()]
        return self._pb.InferenceRequest(model_name=model, inputs=tensors, request_id=request_id,
                                         requested_output_names=outputs)

    def _cancel(self, target: str) -> None:
        # Its own request id: a control request sharing the target's id stalls the target's stream.
        # input_lengths: a required input of `generation`; a control request carries no prompt.
        arrays = {"cancel_request_id": np.array([[target.encode()]], dtype=object),
                  "input_lengths": np.array([[0]], dtype=np.int32)}
        if self._auth is not None:
            arrays[AUTH_INPUT] = self._auth.token(CANCEL, target)
        control = self._request(self._generation, arrays, f"{target}-cancel", ["output_ids", "sequence_length"])
        for _ in control.exec(decoupled=True):
            pass

    def _cancelled_error(self) -> Any:
        return self._pb.TritonError("request cancelled by the client", self._pb.TritonError.CANCELLED)

    def _release_context(self, context_id: str) -> None:
        try:
            self._context.cancel(context_id)
        except Exception:
            pass  # the context side frees the region at its hold deadline anyway

    def _run(self, inputs: dict[str, np.ndarray], sender: Any) -> None:
        pb, final = self._pb, self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        request_id = f"disagg-{self._prefix}-{next(self._ids)}"
        context_id = f"{request_id}-ctx"
        streaming = bool(np.asarray(inputs.get("streaming", np.array([[False]]))).reshape(-1)[0])
        published = pulled = False  # a region holds the history / the generation side has taken it
        try:
            check_limits(inputs, self._limits)  # before the context phase does any work for it
            context_inputs = {**inputs, "request_type": np.array([[b"context_only"]], dtype=object)}
            if self._auth is not None:
                context_inputs[AUTH_INPUT] = self._auth.token(CONTEXT, request_subject(context_id, inputs))
            try:
                first, params = self._context.call(context_inputs, context_id)
            except ContextPhaseError as error:
                sender.send(error_response(pb, RuntimeError(f"context phase: {error}")), flags=final)
                return
            published = True
            if sender.is_cancelled():
                sender.send(error_response(pb, self._cancelled_error()), flags=final)
                return
            if streaming:
                sender.send(response(pb, output_arrays([first])))
            generation_inputs = {**inputs, "request_type": np.array([[b"generation_only"]], dtype=object),
                                 "context_phase_params": params.reshape(1, -1)}
            if self._auth is not None:
                generation_inputs[AUTH_INPUT] = self._auth.token(GENERATION,
                                                                 request_subject(f"{request_id}-gen", inputs))
            tokens: list[int] = []
            skip_first, cancelled = True, False
            for inner in self._request(self._generation, generation_inputs, f"{request_id}-gen",
                                       ["output_ids", "sequence_length"]).exec(decoupled=True):
                if not cancelled and sender.is_cancelled():
                    cancelled = True
                    self._cancel(f"{request_id}-gen")
                if cancelled:
                    continue  # drain what the generation model still sends
                if inner.has_error():
                    sender.send(error_response(pb, RuntimeError(f"generation phase: {inner.error().message()}")),
                                flags=final)
                    return
                output = pb.get_output_tensor_by_name(inner, "output_ids")
                if output is None:
                    continue
                pulled = True  # the generation side's first update follows its import
                length = int(pb.get_output_tensor_by_name(inner, "sequence_length").as_numpy().reshape(-1)[0])
                chunk = [int(t) for t in output.as_numpy().reshape(-1)[:length]]
                if skip_first and chunk:
                    skip_first = False
                    if streaming:
                        chunk = chunk[1:]  # the client has the first token already
                tokens.extend(chunk)
                if streaming and chunk:
                    sender.send(response(pb, output_arrays(chunk)))
            if cancelled:
                sender.send(error_response(pb, self._cancelled_error()), flags=final)
            elif streaming:
                sender.send(flags=final)
            else:
                sender.send(response(pb, output_arrays(tokens)), flags=final)
        except Exception as error:
            sender.send(error_response(pb, RuntimeError(f"request failed: {error}")), flags=final)
        finally:
            if published and not pulled:  # cancelled or failed before the generation side took the history
                self._release_context(context_id)
