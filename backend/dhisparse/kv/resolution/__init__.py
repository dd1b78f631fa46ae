"""How a KV step resolves selected positions to arena rows: one interface, three implementations, chosen once.

- :class:`~dhisparse.kv.resolution.reference.TorchResolution` — the torch reference (any device): the resolver of
  ``dhisparse.kernels.resolver`` over the step's state, fixed-shape copy lists, nothing read on the host.
- :class:`~dhisparse.kv.resolution.native.NativeResolution` — the CPU library (``libdhisparse_cpu.so``, the resolver
  shared with the CUDA kernels): the step's set-up and each index group's resolution by one call each.
- :class:`~dhisparse.kv.resolution.cuda.CudaResolution` — the CUDA kernels on a GPU: resolver and row-copy kernels,
  sparse MLA attention.

:func:`choose_resolution` turns the manager's kernel selection (``dhisparse.kernels.selection``, self-checked at start)
into one of them; the manager hands it to every step (``StepKV``), which calls :meth:`StepResolution.setup` when it
opens and :meth:`StepResolution.resolve` for each index group's first gather. Every implementation follows the
resolver's contract (``kernels/resolver.py``) including verification staging (step 4: a verification step's misses
past the hot cache's evictable slots go to the request's staging rows); the step itself owns what is common: the
state snapshot, the report (counts, staged rows, flags), fetch issue, and dropping an entry whose staging slot a
later resolution reuses.
"""

from __future__ import annotations

from dhisparse.kernels.selection import KernelSelection
from dhisparse.kv.resolution.common import StepResolution
from dhisparse.kv.resolution.cuda import CudaResolution
from dhisparse.kv.resolution.native import NativeResolution
from dhisparse.kv.resolution.reference import TorchResolution

__all__ = ["CudaResolution", "NativeResolution", "StepResolution", "TorchResolution", "choose_resolution"]


def choose_resolution(kernels: KernelSelection) -> StepResolution:
    """The implementation for a kernel selection: the CUDA kernels when they run on the device, the CPU library
    when the selection carries it (a CPU device; its single-source and whole-step calls self-checked against the torch
    resolver when the library was selected), else the torch reference."""
    if kernels.on_device:
        return CudaResolution(kernels.kernels)
    if kernels.native_resolver is not None:
        return NativeResolution(kernels.native_resolver)
    return TorchResolution()
