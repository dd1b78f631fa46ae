"""Values between host and device: onto the device without a host synchronisation (:func:`to_device`), and back
to the host by counted reads (:class:`HostSync`).

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


class HostSync:
    """The one place where a step reads device values on the host, and counts it. ``reads`` is cumulative;
    ``step_reads`` counts since :meth:`mark_step`.

    On a GPU every device→host read (``.tolist()``, ``.item()``, ``bool(t.any())``, ``.cpu()`` of a device tensor)
    stalls the host until the device has caught up. A step must therefore read the device a *constant* number of
    times, independent of the number of layers and requests: the KV side checks and statistics of a step are
    accumulated on the device and read once, together with the engine's sampled tokens when the engine fuses them
    into its own read (``KVManager.end_step(..., report=...)``).

    Every such read in the KV side and the engine goes through :meth:`HostSync.read`, which concatenates the tensors
    it is given into one transfer. ``reads`` (cumulative) is reported as ``kv_host_syncs`` in ``stats()``.
    """

    def __init__(self) -> None:
        self.reads = 0
        self.step_reads = 0
        self.active = False  # true while a read is in progress (lets audits tell counted reads from others)

    def mark_step(self) -> None:
        self.step_reads = 0

    def read(self, *tensors: torch.Tensor) -> list[list[int]]:
        """One device→host transfer of integer/bool ``tensors`` (any shapes); returns each flattened as a
        Python list of ints, in order."""
        self.reads += 1
        self.step_reads += 1
        self.active = True
        try:
            flat = [t.reshape(-1).to(torch.int64) for t in tensors]
            sizes = [f.numel() for f in flat]
            values = torch.cat(flat).tolist() if flat else []
        finally:
            self.active = False
        out, start = [], 0
        for n in sizes:
            out.append(values[start:start + n])
            start += n
        return out

    def read_float(self, tensor: torch.Tensor) -> list[float]:
        """One device→host transfer of a floating tensor (flattened)."""
        self.reads += 1
        self.step_reads += 1
        self.active = True
        try:
            return tensor.reshape(-1).tolist()
        finally:
            self.active = False
