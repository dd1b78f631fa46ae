"""Moving numpy arrays in and out of Triton Python-backend requests and responses.

`triton_python_backend_utils` exists only inside the backend stub, so every function takes that module
as its first argument (`pb`); the model.py files pass theirs in. Everything else in `dhisparse.serving`
works on plain `dict[str, np.ndarray]` and is testable without a server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

# Held by every thread of a stub process while it builds response objects (numpy arrays, `pb.Tensor`,
# `pb.InferenceResponse`) or talks to the stub (`send`, `is_cancelled`, custom metrics). Seen under load (AIPerf
# at concurrency 4-8 on the OpenAI API, responses of 18 tensors): the `dhisparse` stub died in a numpy allocation
# while three other threads were inside `sender.send` ("Fatal Python error: Segmentation fault"; once
# "pybind11_object_dealloc(): Tried to deallocate unregistered instance!"), as if Triton 2.51's stub touched
# Python objects while a send has released the GIL. One thread at a time avoids it. Re-entrant: a holder may send.
STUB_LOCK = threading.RLock()


def request_arrays(pb: Any, request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The request's input tensors among `names` as numpy arrays; absent optional inputs are left out.

    BYTES/STRING tensors come back as object arrays of `bytes`.
    """
    arrays = {}
    for name in names:
        tensor = pb.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def response(pb: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """An `InferenceResponse` carrying `arrays` as output tensors."""
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, value) for name, value in arrays.items()])


def error_response(pb: Any, error: BaseException | Any) -> Any:
    """An `InferenceResponse` carrying `error`: a `pb.TritonError` as is, an exception as its text."""
    triton_error = error if isinstance(error, pb.TritonError) else pb.TritonError(str(error))
    return pb.InferenceResponse(output_tensors=[], error=triton_error)


def send(pb: Any, sender: Any, arrays_or_error: Mapping[str, np.ndarray] | BaseException | Any | None,
         flags: int) -> None:
    """Send through a response sender: flags only (``None``), output arrays (a mapping) or an error (anything else:
    an exception or a `pb.TritonError`). Under `STUB_LOCK`."""
    with STUB_LOCK:
        if arrays_or_error is None:
            sender.send(flags=flags)
        elif isinstance(arrays_or_error, Mapping):
            sender.send(response(pb, arrays_or_error), flags=flags)
        else:
            sender.send(error_response(pb, arrays_or_error), flags=flags)


def unload_in_background(pb: Any, model_name: str, reason: str) -> None:
    """A model whose engine stopped (every client has its error) unloads itself, so its readiness turns false.
    Needs explicit model control (dhisparse-serve runs Triton so); otherwise the model keeps answering errors.
    From a thread: Triton's unload waits for the model's own calls to return."""
    pb.Logger.log_error(f"{model_name}: the engine stopped, unloading the model: {reason}")

    def unload() -> None:
        try:
            pb.unload_model(model_name)
        except Exception as error:
            pb.Logger.log_error(f"{model_name}: could not unload itself ({error}); it answers errors")

    threading.Thread(target=unload, name="dhisparse-unload", daemon=True).start()


def parameter(config: Mapping[str, Any], key: str, default: str | None = None) -> str:
    """A `parameters { key: ... value: { string_value: ... } }` entry of a parsed model config."""
    entry = config.get("parameters", {}).get(key)
    if entry is None:
        if default is None:
            raise KeyError(f"model config has no parameter {key!r}")
        return default
    return entry["string_value"]
