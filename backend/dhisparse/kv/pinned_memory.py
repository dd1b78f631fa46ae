"""Setting up (and releasing) hundreds of GB of pinned host memory for the host store, fast.

``torch.zeros(n, pin_memory=True)`` makes the CUDA driver allocate and lock every page of the chunk in one thread
(``cudaHostAlloc``) and then zero it in a second pass; chunk by chunk that is a few GB/s, minutes for a host store
of hundreds of GB, and torch keeps freed pinned blocks in its caching host allocator. :func:`touch_and_pin` instead

1. takes ordinary (pageable, untouched) memory for each chunk,
2. touches it first from ``workers`` threads at once (zeroing a chunk is its first touch: the kernel faults its pages
   in in parallel, each thread on its own chunks; torch's fill releases the GIL),
3. page-locks each touched chunk with ``cudaHostRegister`` (portable, mapped: the device reads it at its host
   address under unified addressing, what ``kv/mapped_host.py`` checks) in the worker that touched it, so locking
   one chunk overlaps touching the next,

reporting progress after each chunk. :func:`unpin` undoes the registration (``cudaHostUnregister``) before the
memory is freed, so shutting a store down returns every byte at once. Without CUDA (tests, CPU serving) the
same path runs with pinning off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class PinError(RuntimeError):
    """``cudaHostRegister`` / ``cudaHostUnregister`` failed (names the CUDA error)."""


def default_workers() -> int:
    """Threads for the first touch: the CPUs this process may use, at most 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus))


def _check(call: str, result: Any) -> None:
    code = int(getattr(result, "value", result))  # torch's cudart returns an enum (or int on older builds)
    if code != 0:
        raise PinError(f"{call} failed with CUDA error {code}")


def pin(tensor: torch.Tensor) -> None:
    """Page-lock ``tensor``'s memory (contiguous, CPU) with ``cudaHostRegister`` (portable, mapped)."""
    cudart = torch.cuda.cudart()
    nbytes = tensor.numel() * tensor.element_size()
    _check("cudaHostRegister", cudart.cudaHostRegister(tensor.data_ptr(), nbytes,
                                                       _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))


def unpin(tensor: torch.Tensor) -> None:
    """Undo :func:`pin` (before the memory is freed)."""
    _check("cudaHostUnregister", torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))


def touch_and_pin(chunks: Sequence[torch.Tensor], pin_memory: bool, workers: int | None = None,
                  progress: Progress | None = None, pinned: list[torch.Tensor] | None = None) -> None:
    """Zero every chunk (its first touch) from ``workers`` threads and, with ``pin_memory``, page-lock each one after
    touching it (see the module docstring). ``progress(done, total)`` is called (from one thread at a time) after
    each chunk, ``done`` reaching ``total`` at the end; each chunk pinned is appended to ``pinned``. A failure stops
    the remaining work and is raised; the chunks in ``pinned`` are then the ones to :func:`unpin`."""
    total = sum(c.numel() * c.element_size() for c in chunks)
    done = 0
    lock = threading.Lock()
    failed = threading.Event()

    def one(chunk: torch.Tensor) -> None:
        nonlocal done
        if failed.is_set():
            return
        try:
            chunk.zero_()
            if pin_memory:
                pin(chunk)
        except Exception:
            failed.set()
            raise
        with lock:
            if pin_memory and pinned is not None:
                pinned.append(chunk)
            done += chunk.numel() * chunk.element_size()
            if progress is not None:
                progress(done, total)

    workers = max(1, min(workers or default_workers(), len(chunks) or 1))
    if workers == 1:
        for chunk in chunks:
            one(chunk)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dhisparse-pin") as pool:
        for future in [pool.submit(one, chunk) for chunk in chunks]:
            future.result()
