"""Optional ctypes binding of the native CPU library (``plugins/cpu``, ``libdhisparse_cpu.so``).

The library is the CPU build of the header-only resolver shared with the CUDA kernels
(``plugins/common/include/dhisparse/resolver.h``). :func:`resolve` has the signature and the exact results
of :func:`dhisparse.kv.resolver.resolve` (locations, step codes, LRU state, copy list, counts).

Nothing here is required: importing this module never fails and never loads anything. :func:`load` looks
for the library (``$DHISPARSE_NATIVE_LIB``, else ``build/native/plugins/libdhisparse_cpu.so`` under the
repository root, built by ``scripts/setup_native.sh``) and returns ``None`` when it is absent.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from dhisparse.kv.resolver import HotCacheOverflowError, Resolution, from_padded

ABI_VERSION = 2
STATUS_HOT_CACHE_TOO_SMALL = 1
_REPO_ROOT = Path(__file__).resolve().parents[2]
_DEFAULT_LIBRARY = _REPO_ROOT / "build" / "native" / "plugins" / "libdhisparse_cpu.so"


def library_path() -> Path:
    """Where :func:`load` looks for ``libdhisparse_cpu.so``."""
    override = os.environ.get("DHISPARSE_NATIVE_LIB")
    return Path(override) if override else _DEFAULT_LIBRARY


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The loaded CPU library, or ``None`` when it is not built (or has another ABI version)."""
    path = library_path()
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    lib.dhs_cpu_abi_version.restype = ctypes.c_int32
    if lib.dhs_cpu_abi_version() != ABI_VERSION:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.dhs_resolve_batch_i64.restype = ctypes.c_int32
    lib.dhs_resolve_batch_i64.argtypes = [i64] * 6 + [ptr] * 11
    lib.dhs_copy_grid_blocks.restype = ctypes.c_int32
    lib.dhs_copy_grid_blocks.argtypes = [i64]
    return lib


def available() -> bool:
    """True when the CPU library is built and loadable."""
    return load() is not None


def copy_grid_blocks(batch: int) -> int:
    """Thread blocks (4..32) of the CUDA gather copy for a decode batch of ``batch`` requests."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU library not built (looked for {library_path()})")
    return int(lib.dhs_copy_grid_blocks(batch))


def _i64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous():
        return t  # the common case, without a dispatched no-op
    return t.detach().to(device="cpu", dtype=torch.int64).contiguous()


def resolve(
    positions: torch.Tensor,
    page_table: torch.Tensor,
    hot_pos: torch.Tensor,
    hot_stamp: torch.Tensor,
    hot_loc: torch.Tensor,
    stamp: int,
    page_rows: int,
) -> Resolution:
    """:func:`dhisparse.kv.resolver.resolve` computed by the CPU library (same arguments, same results).

    Shapes: positions ``[R, N]``, page_table ``[R, M]``, hot_pos / hot_stamp / hot_loc ``[R, B]``, all
    integer (converted to int64 on the CPU). Inputs are not modified.

    Raises:
        RuntimeError: the library is not built.
        ValueError: bad shapes or arguments.
        HotCacheOverflowError: a request misses more rows than its hot cache has evictable slots.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU library not built (looked for {library_path()})")
    if positions.dim() != 2 or page_table.dim() != 2 or hot_pos.dim() != 2:
        raise ValueError("positions, page_table and hot_pos must be 2-D [R, ...] tensors")
    num_requests, n = positions.shape
    num_slots = hot_pos.shape[1]
    if hot_stamp.shape != hot_pos.shape or hot_loc.shape != hot_pos.shape:
        raise ValueError("hot_pos, hot_stamp and hot_loc must have the same shape [R, B]")
    if page_table.shape[0] != num_requests or hot_pos.shape[0] != num_requests:
        raise ValueError("positions, page_table and hot_pos must have the same number of rows R")
    if page_rows <= 0 or stamp < 0:
        raise ValueError(f"page_rows must be > 0 and stamp >= 0, got {page_rows} and {stamp}")
    out = resolve_padded(lib, positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
    if out.status == STATUS_HOT_CACHE_TOO_SMALL:
        summary = out.summary
        r = int(torch.nonzero(summary[:, 0] != 0)[0, 0])
        misses = int(summary[r, 1] - summary[r, 3] - summary[r, 4])
        raise HotCacheOverflowError(
            f"request row {r} misses {misses} rows but its hot cache of {num_slots} slots cannot take them; "
            "raise hot_rows (B) to at least the number of distinct rows one step can select"
        )
    if out.status != 0:
        raise ValueError(f"native resolver rejected its arguments (status {out.status})")
    return from_padded(out.locations, out.steps, out.hot_pos, out.hot_stamp, out.copy_position, out.copy_slot,
                       out.copy_location, out.summary)


class Padded(NamedTuple):
    """The library's outputs for ``R`` rows of ``N`` selections (``dhisparse/resolver.h``): ``locations`` /
    ``steps`` / ``copy_position`` / ``copy_slot`` / ``copy_location`` ``[R, N]`` (copy lists compacted to the
    front of each row, ``-1`` after), the new hot state ``[R, B]``, ``summary [R, 6]`` int32 (column 0 a row's
    status, 3..5 its direct / hot / host counts) and the call's ``status`` (0, or 1 when a row overflowed its
    hot cache: that row's outputs are not valid)."""

    locations: torch.Tensor
    steps: torch.Tensor
    hot_pos: torch.Tensor
    hot_stamp: torch.Tensor
    copy_position: torch.Tensor
    copy_slot: torch.Tensor
    copy_location: torch.Tensor
    summary: torch.Tensor
    status: int


def resolve_padded(lib: ctypes.CDLL, positions: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor,
                   hot_stamp: torch.Tensor, hot_loc: torch.Tensor, stamp: int, page_rows: int) -> Padded:
    """One library call over ``R`` rows (2-D inputs as :func:`resolve`, shapes trusted), outputs fixed-shape and
    padded, nothing raised for an overflowing row: the KV step's CPU path (``kv/step_resolution.py``) turns
    them into its fixed-shape fetch list and device flags, like the CUDA kernel's outputs."""
    num_requests, n = positions.shape
    pos, table, loc_in = _i64(positions), _i64(page_table), _i64(hot_loc)
    new_pos, new_stamp = torch.stack([_i64(hot_pos), _i64(hot_stamp)]).unbind(0)  # one copy of the hot state
    locations, copy_position, copy_slot, copy_location = torch.empty(4, num_requests, n, dtype=torch.int64).unbind(0)
    steps = torch.empty(num_requests, n, dtype=torch.int8)
    summary = torch.empty(num_requests, 6, dtype=torch.int32)
    status = lib.dhs_resolve_batch_i64(
        num_requests, n, table.shape[1], new_pos.shape[1], page_rows, stamp,
        pos.data_ptr(), table.data_ptr(), new_pos.data_ptr(), new_stamp.data_ptr(), loc_in.data_ptr(),
        locations.data_ptr(), steps.data_ptr(), copy_position.data_ptr(), copy_slot.data_ptr(),
        copy_location.data_ptr(), summary.data_ptr(),
    )  # fmt: skip
    return Padded(locations, steps, new_pos, new_stamp, copy_position, copy_slot, copy_location, summary,
                  int(status))
