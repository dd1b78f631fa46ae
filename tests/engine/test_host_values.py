"""Host values reach the device without a host synchronisation (dhisparse/host_values.py).

On a GPU, ``torch.tensor(values, device=cuda)`` copies from pageable memory, which waits for the device; the
GPU check (scripts/gpu_check.py, torch's sync-debug mode) found five such waits per decode step in the batch's
sampling parameters alone. Here, without a GPU: :func:`to_device`'s values, and a scan of the package for the
synchronous form, so a new per-step vector cannot bring the wait back unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import dhisparse
from dhisparse.host_values import to_device

PACKAGE = Path(dhisparse.__file__).resolve().parent

# Calls that build a device tensor from host values on purpose, each with its reason.
ALLOWED = {
    # aliases the pinned host store's device address range (__cuda_array_interface__): no copy at all
    ("kv/mapped_host.py", "torch.as_tensor"),
    # a one-off probe of torch._grouped_mm at first use per (device, dtype), not per step
    ("model/layers.py", "torch.tensor"),
}


@pytest.mark.parametrize("values, dtype", [([3, 1, 2], torch.int64), ([[0.5], [2.0]], torch.float64),
                                           ([], torch.int64), (7, torch.int32)])
def test_to_device_builds_the_values(values, dtype) -> None:
    got = to_device(values, dtype, "cpu")
    assert got.dtype == dtype and got.device.type == "cpu"
    assert torch.equal(got, torch.tensor(values, dtype=dtype))


def test_to_device_takes_tensors_and_converts_dtype() -> None:
    t = torch.arange(5)
    assert to_device(t, None, torch.device("cpu")) is t  # already there: no copy
    got = to_device(t, torch.int32, "cpu")
    assert got.dtype == torch.int32 and torch.equal(got, t.to(torch.int32))


def _device_literal(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "device":
            return ast.unparse(kw.value)
        if kw.arg is None:  # **options may name a device
            return f"**{ast.unparse(kw.value)}"
    return None


def test_no_module_builds_device_tensors_from_host_values_synchronously() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("planner/", "serving/")) or rel == "host_values.py":
            continue  # the planner runs no engine step; the serving layer hands host values to the engine
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name not in ("torch.tensor", "torch.as_tensor"):
                continue
            device = _device_literal(node)
            if device is None or device in ("'cpu'", '"cpu"'):
                continue
            if (rel, name) not in ALLOWED:
                found.append(f"{rel}:{node.lineno}: {name}(..., device={device})")
    assert not found, "build these through dhisparse.host_values.to_device (a pinned, non-blocking copy):\n" + \
        "\n".join(found)
