"""A view of the host store that a gather reads on the arena's own device: the host fetch without a host round trip.

The host store (:class:`~dhisparse.kv.host_store.ChunkedRows`) holds its rows in fixed chunks that never move, each
starting at an address that is a multiple of the row size. :func:`map_chunks` exposes all allocated chunks as one
tensor ``span [span_rows, row_dim]`` over the address range from the lowest chunk to the end of the highest, plus
``first_row [num_chunks]`` (the span row where each chunk starts), so that global host row ``r`` is span row
``first_row[r // chunk_rows] + r % chunk_rows``: a host fetch is **one fixed-shape** ``index_select`` whose index is
computed where the copy list was made, whatever the number of chunks. Only rows inside chunks are ever indexed
(indices are clamped to the allocated rows); the memory between chunks is never touched.

- **CUDA**: the span is a CUDA tensor (``__cuda_array_interface__``) aliasing the pinned host memory, so the
  gather kernel reads host memory directly over the bus and its index never leaves the device. This relies on
  unified virtual addressing, which the CUDA runtime enables automatically in 64-bit processes; host memory from
  ``cudaHostAlloc``/``cudaMallocHost`` (torch's pinned allocator) is then accessible from every such device at the
  same pointer value, "it is not necessary to call cudaHostGetDevicePointer()" (CUDA Runtime API, *Unified
  Addressing*: docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__UNIFIED.html). For memory registered with
  ``cudaHostRegister`` the device pointer "may or may not match the original host pointer" (it does when every
  visible device has ``cudaDevAttrCanUseHostPointerForRegisteredMem``; ``cudaHostGetDevicePointer`` docs). So each
  chunk's device pointer is asked for (cuda-python if installed, else ``cudaHostGetDevicePointer`` of the libcudart
  torch loaded, through ctypes; the pointer itself when neither is available), and the store is mapped only when
  every chunk's device pointer equals its host pointer; otherwise :func:`map_chunks` returns ``None`` and copies
  take the staged path (one counted host read of the fetch list per copy).
- **CPU**: the same span over the chunks' own memory (a ctypes buffer), so the CPU tests run the same index
  arithmetic and gather as the GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from dataclasses import dataclass

import torch

from dhisparse.host_values import to_device


@dataclass
class MappedRows:
    """All allocated chunks of a host store as one tensor on ``device`` (see module docstring)."""

    span: torch.Tensor  # [span_rows, row_dim] on ``device``, aliasing the chunks' memory
    first_row: torch.Tensor  # [num_chunks] int64 on ``device``: the span row where each chunk starts
    chunk_rows: int
    allocated_rows: int
    owners: tuple[torch.Tensor, ...]  # the chunks, kept alive as long as the view

    @property
    def device(self) -> torch.device:
        return self.span.device

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, row_dim]`` at global host rows ``index [N]`` (any device; moved to the view's device — from
        the device itself no host read). Indices outside the allocated rows read a row of the store, never
        memory outside it."""
        index = index.to(self.span.device, torch.int64).clamp(0, self.allocated_rows - 1)
        if self.allocated_rows <= self.chunk_rows:  # one chunk: the span is that chunk
            return self.span.index_select(0, index)
        return self.span.index_select(0, self.span_rows(index))

    def span_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Span rows of the global host rows ``index`` (non-negative, allocated; on the view's device)."""
        chunk = index // self.chunk_rows
        return self.first_row[chunk] + (index - chunk * self.chunk_rows)


class _CudaBytes:
    """``__cuda_array_interface__`` (v3) of ``nbytes`` bytes at device pointer ``ptr``; holds ``owner``."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


def _cpu_bytes(ptr: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


_CUDART: list[object] = []  # [libcudart handle or None], looked up once


def _libcudart() -> object | None:
    if not _CUDART:
        lib = None
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        nvidia = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cuda_runtime", "lib")
        names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
        names += sorted(glob.glob(os.path.join(nvidia, "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(torch_lib, "libcudart*.so*")))
        found = ctypes.util.find_library("cudart")
        names += [found] if found else []
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                lib.cudaHostGetDevicePointer  # noqa: B018 - the symbol must exist
                break
            except (OSError, AttributeError):
                lib = None
        _CUDART.append(lib)
    return _CUDART[0]


def host_device_pointer(ptr: int) -> tuple[int, str]:
    """The device pointer of pinned host memory at ``ptr`` (current CUDA device) and how it was obtained:
    ``"cuda-python"``, ``"libcudart"`` (``cudaHostGetDevicePointer``), or ``"uva"`` (the pointer itself, valid
    for ``cudaHostAlloc`` memory under unified addressing) when neither API is reachable or the call fails."""
    try:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart
        err, dptr = cudart.cudaHostGetDevicePointer(ptr, 0)
        if int(err) == 0:
            return int(dptr), "cuda-python"
        cudart.cudaGetLastError()
    except Exception:  # not installed or unusable: try the next way
        pass
    lib = _libcudart()
    if lib is not None:
        out = ctypes.c_void_p()
        if lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(ptr), ctypes.c_uint(0)) == 0:  # type: ignore[attr-defined]
            return int(out.value or 0), "libcudart"
        lib.cudaGetLastError()  # type: ignore[attr-defined]  # a failed call must not surface in torch's next check
    return ptr, "uva"


def map_chunks(chunks: list[torch.Tensor], chunk_rows: int, device: torch.device) -> MappedRows | None:
    """The span view of ``chunks`` (each ``[rows, row_dim]`` contiguous, starting at a multiple of the row size)
    on ``device``; ``None`` when it cannot be made there (a CUDA device with unpinned chunks, or a chunk whose
    device pointer differs from its host pointer), and the caller copies through the host instead."""
    if not chunks:
        return None
    row_bytes = chunks[0].shape[1] * chunks[0].element_size()
    dtype, row_dim = chunks[0].dtype, chunks[0].shape[1]
    starts = [c.data_ptr() for c in chunks]
    if any(s % row_bytes for s in starts):
        raise ValueError("map_chunks: a host chunk does not start at a multiple of the row size")
    low = min(starts)
    high = max(s + c.shape[0] * row_bytes for s, c in zip(starts, chunks, strict=True))
    first_row = torch.tensor([(s - low) // row_bytes for s in starts], dtype=torch.int64)
    allocated = sum(c.shape[0] for c in chunks)
    owners = tuple(chunks)
    if device.type == "cpu":
        span = chunks[0] if len(chunks) == 1 else _cpu_bytes(low, high - low).view(dtype).view(-1, row_dim)
        return MappedRows(span, first_row, chunk_rows, allocated, owners)
    if device.type != "cuda" or not all(c.is_pinned() for c in chunks):
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        if any(host_device_pointer(s)[0] != s for s in starts):
            return None  # no single device address range mirrors the chunks (see module docstring)
        # ``device`` named explicitly: torch then builds the tensor there, or (older torch) the pointer's device,
        # which is the same one for a single-device engine. A copy instead of an alias is refused below.
        raw = torch.as_tensor(_CudaBytes(low, high - low, owners), device=device)
    if raw.data_ptr() != low:
        return None
    span = raw.view(dtype).view(-1, row_dim)
    return MappedRows(span, to_device(first_row, None, device), chunk_rows, allocated, owners)
