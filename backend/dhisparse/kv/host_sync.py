"""HostSync: the one place where a step reads device values on the host, and counts it.

On a GPU every device→host read (``.tolist()``, ``.item()``, ``bool(t.any())``, ``.cpu()`` of a device tensor)
stalls the host until the device has caught up. A step must therefore read the device a *constant* number of
times, independent of the number of layers and requests: the KV side checks and statistics of a step are
accumulated on the device and read once, together with the engine's sampled tokens when the engine fuses them
into its own read (``KVManager.end_step(..., report=...)``).

Every such read in the KV side and the engine goes through :meth:`HostSync.read`, which concatenates the tensors
it is given into one transfer. ``reads`` (cumulative) is reported as ``kv_host_syncs`` in ``stats()``.
"""

from __future__ import annotations

import torch


class HostSync:
    """Counts device→host reads. ``reads`` is cumulative; ``step_reads`` counts since :meth:`mark_step`."""

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
