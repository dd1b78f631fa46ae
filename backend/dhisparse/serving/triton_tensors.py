"""Moving numpy arrays in and out of Triton Python-backend requests and responses.

`triton_python_backend_utils` exists only inside the backend stub, so every function takes that module
as its first argument (`pb`); the model.py files pass theirs in. Everything else in `dhisparse.serving`
works on plain `dict[str, np.ndarray]` and is testable without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


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


def parameter(config: Mapping[str, Any], key: str, default: str | None = None) -> str:
    """A `parameters { key: ... value: { string_value: ... } }` entry of a parsed model config."""
    entry = config.get("parameters", {}).get(key)
    if entry is None:
        if default is None:
            raise KeyError(f"model config has no parameter {key!r}")
        return default
    return entry["string_value"]
