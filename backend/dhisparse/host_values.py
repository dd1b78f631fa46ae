"""Host values onto the device without a host synchronisation.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy from pageable host memory, which
CUDA performs synchronously: the host waits for the device's stream before the copy starts. A decode step that
builds its small per-request vectors (token ids, positions, lengths, sampling parameters) that way waits for
the device several times per step, however few host *reads* it makes. :func:`to_device` stages the values in
pinned memory and copies them with ``non_blocking=True`` instead: the copy is queued on the current stream and
PyTorch's caching host allocator keeps the pinned block alive until the copy has run, so the host never waits.
On a CPU device it is a plain tensor (no copy when the values already are one).

``scripts/gpu_check.py`` counts, with torch's CUDA sync-debug mode, the synchronisations of a decode step and
names their call sites; tests/engine/test_host_values.py keeps the engine's per-step modules free of the
synchronous forms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: torch.Tensor | Sequence | int | float, dtype: torch.dtype | None,
              device: torch.device | str) -> torch.Tensor:
    """``values`` (a host tensor, nested sequence or number) as a ``dtype`` tensor on ``device``, copied
    asynchronously through pinned memory when ``device`` is a GPU (see the module docstring). ``dtype`` None
    keeps a tensor's dtype (or torch's inference for Python values)."""
    device = torch.device(device)
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
