"""Optional ctypes binding of the native CPU library (``plugins/cpu``, ``libdhisparse_cpu.so``).

The library is the CPU build of the header-only resolver shared with the CUDA kernels
(``plugins/common/include/dhisparse/resolver.h``). :func:`resolve` has the signature and the exact results
of :func:`dhisparse.kernels.resolver.resolve` (locations, step codes, LRU state, copy list, counts).

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

from dhisparse.kernels.resolver import HotCacheOverflowError, Resolution, from_padded

ABI_VERSION = 5
_STATUS_HOT_CACHE_TOO_SMALL = 1
# Flags of resolve_step (DHS_STEP_* in c_api.h).
STEP_BAD_POSITION, STEP_HOT_CACHE_OVERFLOW, STEP_NO_HOST_COPY, STEP_UNMAPPED = 1, 2, 4, 8
_STEP_ARGS, _SETUP_ARGS = 39, 19  # int64 fields of DhsStepArgs, DhsSetupArgs
_REPO_ROOT = Path(__file__).resolve().parents[3]
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
    lib.dhs_resolve_step_i64.restype = ctypes.c_int32
    lib.dhs_resolve_step_i64.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.dhs_step_setup_i64.restype = ctypes.c_int32
    lib.dhs_step_setup_i64.argtypes = [ctypes.POINTER(ctypes.c_int64)]
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
    """:func:`dhisparse.kernels.resolver.resolve` computed by the CPU library (same arguments, same results).

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
    pos, table, loc_in = _i64(positions), _i64(page_table), _i64(hot_loc)
    new_pos, new_stamp = torch.stack([_i64(hot_pos), _i64(hot_stamp)]).unbind(0)  # one copy of the hot state
    locations, copy_position, copy_slot, copy_location = torch.empty(4, num_requests, n, dtype=torch.int64).unbind(0)
    steps = torch.empty(num_requests, n, dtype=torch.int8)
    summary = torch.empty(num_requests, 6, dtype=torch.int32)
    status = lib.dhs_resolve_batch_i64(
        num_requests, n, table.shape[1], num_slots, page_rows, stamp,
        pos.data_ptr(), table.data_ptr(), new_pos.data_ptr(), new_stamp.data_ptr(), loc_in.data_ptr(),
        locations.data_ptr(), steps.data_ptr(), copy_position.data_ptr(), copy_slot.data_ptr(),
        copy_location.data_ptr(), summary.data_ptr(),
    )  # fmt: skip
    if status == _STATUS_HOT_CACHE_TOO_SMALL:
        r = int(torch.nonzero(summary[:, 0] != 0)[0, 0])
        misses = int(summary[r, 1] - summary[r, 3] - summary[r, 4])
        raise HotCacheOverflowError(
            f"request row {r} misses {misses} rows but its hot cache of {num_slots} slots cannot take them; "
            "raise hot_rows (B) to at least the number of distinct rows one step can select"
        )
    if status != 0:
        raise ValueError(f"native resolver rejected its arguments (status {status})")
    return from_padded(locations, steps, new_pos, new_stamp, copy_position, copy_slot, copy_location, summary)


class StepOutputs(NamedTuple):
    """What :func:`resolve_step` returns for ``G`` sources, ``B`` requests, ``N`` selections: ``locations
    [G, B, N]`` (``-1`` where unused), each source's copy list as host rows ``fetch_src [G, B * N]`` → arena
    rows ``fetch_dst [G, B * N]`` of which the first ``fetch_count[g]`` are valid, and the ``STEP_*`` flags."""

    locations: torch.Tensor
    fetch_src: torch.Tensor
    fetch_dst: torch.Tensor
    fetch_count: list[int]
    flags: int


def _strided(name: str, t: torch.Tensor, rows: int, sources: int, call: str = "resolve_step") -> None:
    if (t.dtype is not torch.int64 or not t.is_cpu or t.dim() != 3 or t.stride(2) != 1 or t.shape[0] < rows
            or t.shape[1] < sources):
        raise ValueError(f"{call}: {name} must be a CPU int64 [rows, sources, width] tensor with a "
                         f"contiguous last dimension, got {t.dtype} {list(t.shape)} strides {t.stride()}")


def resolve_step(lib: ctypes.CDLL, positions: torch.Tensor, lengths: torch.Tensor, sources: torch.Tensor,
                 slots: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
                 hot_loc: torch.Tensor, host_pages: torch.Tensor | None, counts: torch.Tensor, stamp: int,
                 page_rows: int, direct_only: bool = False,
                 staging: tuple[torch.Tensor, list[int], torch.Tensor] | None = None,
                 checked: list[torch.Tensor | None] | None = None) -> StepOutputs:
    """One KV step's resolution of the sources ``sources [G]`` selected by the same ``positions [B, N]`` (an index
    group, or one source), by one library call (``dhs_resolve_step_i64``, the contract of ``resolver.h`` per
    request and source): the step's state is read where it lives — the page-table snapshot ``[B, S, M]`` by
    request, the hot state ``[slots, S, H]`` (updated in place) and host page ids ``[slots, S, M']`` by each
    request's slot ``slots [B]`` — and each request's direct / hot / host counts are added to ``counts [B, 3]``.
    Nothing is resolved when a position is at or past its request's ``lengths`` (flag ``STEP_BAD_POSITION``); a
    request whose misses overflow its hot cache keeps its state (``STEP_HOT_CACHE_OVERFLOW``, its locations -1).
    With ``direct_only`` (a step whose every request's history is direct) the call is resolver step 1 alone:
    page-table locations, each request's distinct valid positions counted as direct, the hot state untouched, no
    copies; a position whose page is not mapped gets -1 and the flag ``STEP_UNMAPPED``.
    ``staging = (staging_loc [slots, slot count, T], staging slot of each source [G], staged [B])``: verification
    staging (the contract's step 4) — a request's misses past its evictable hot slots go to the staging rows of its
    source's staging slot, and each request's staged rows are added to ``staged``.
    All tensors int64 on the CPU; the 3-D ones need a contiguous last dimension (checked, as are the sizes).
    ``checked``: the caller's record of the batch-state tensors already checked (a step's calls pass the batch state's
    own tensors, whose shape and layout never change in place: the batch state replaces them when it grows)."""
    batch, n = positions.shape
    groups = sources.shape[0]
    for name, t in (("positions", positions), ("lengths", lengths), ("sources", sources), ("slots", slots),
                    ("counts", counts)):
        if t.dtype is not torch.int64 or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"resolve_step: {name} must be a contiguous CPU int64 tensor")
    if lengths.shape != (batch,) or slots.shape != (batch,) or counts.shape != (batch, 3):
        raise ValueError("resolve_step: lengths and slots must be [B], counts [B, 3]")
    num_sources = page_table.shape[1]
    _strided("page_table", page_table, batch, num_sources)
    staging_loc = staging[0] if staging is not None else None
    state = (hot_pos, hot_stamp, hot_loc, host_pages, staging_loc)
    checked = [] if checked is None else checked
    if len(checked) != 5 or any(a is not b for a, b in zip(state, checked, strict=True)) or \
            hot_pos.shape[1] < num_sources:
        for name, t in (("hot_pos", hot_pos), ("hot_stamp", hot_stamp), ("hot_loc", hot_loc)):
            _strided(name, t, 1, num_sources)
            if t.shape != hot_pos.shape or t.stride() != hot_pos.stride():
                raise ValueError("resolve_step: hot_pos, hot_stamp and hot_loc must have one shape and layout")
        if host_pages is not None:
            _strided("host_pages", host_pages, hot_pos.shape[0], num_sources)
        if staging_loc is not None:
            _strided("staging_loc", staging_loc, hot_pos.shape[0], 0)
        checked[:] = state  # the batch state's tensors, checked once (held by the caller, so never another's id)
    staging_slots_c = staged_ptr = 0
    staging_rows = staging_count = 0
    staging_strides = (0, 0)
    if staging is not None and staging[0].shape[2] > 0:
        staging_loc, members, staged = staging
        if len(members) != groups or staged.shape != (batch,) or staged.dtype is not torch.int64 or \
                not staged.is_cpu or not staged.is_contiguous():
            raise ValueError("resolve_step: staging needs a staging slot per source and staged [B] (CPU int64)")
        staging_slots_c = (ctypes.c_int64 * groups)(*members)
        staging_rows, staging_count = staging_loc.shape[2], staging_loc.shape[1]
        staging_strides = (staging_loc.stride(0), staging_loc.stride(1))
        staged_ptr = staged.data_ptr()
    else:
        staging_loc = None
    # Separate outputs (a slice or view of one buffer costs more in Python than an allocation); the copy counts
    # in a ctypes array, read without torch.
    locations = torch.empty((groups, batch, n), dtype=torch.int64)
    fetch_src = torch.empty((groups, batch * n), dtype=torch.int64)
    fetch_dst = torch.empty((groups, batch * n), dtype=torch.int64)
    fetch_count = (ctypes.c_int64 * max(groups, 1))()
    host = host_pages if host_pages is not None else hot_pos  # strides only; the pointer passed is NULL
    args = (ctypes.c_int64 * _STEP_ARGS)(
        batch, n, groups, hot_pos.shape[2], page_rows, stamp, page_table.shape[2], host.shape[2],
        num_sources, hot_pos.shape[0], int(direct_only),
        page_table.stride(0), page_table.stride(1), hot_pos.stride(0), hot_pos.stride(1),
        host.stride(0), host.stride(1), counts.stride(0),
        positions.data_ptr(), lengths.data_ptr(), sources.data_ptr(), slots.data_ptr(), page_table.data_ptr(),
        hot_pos.data_ptr(), hot_stamp.data_ptr(), hot_loc.data_ptr(),
        host_pages.data_ptr() if host_pages is not None else 0, locations.data_ptr(), fetch_src.data_ptr(),
        fetch_dst.data_ptr(), ctypes.addressof(fetch_count), counts.data_ptr(),
        staging_rows, staging_count, *staging_strides,
        ctypes.addressof(staging_slots_c) if staging_loc is not None else 0,
        staging_loc.data_ptr() if staging_loc is not None else 0, staged_ptr,
    )  # fmt: skip
    flags = int(lib.dhs_resolve_step_i64(args))
    if flags < 0:
        raise ValueError("resolve_step: the library rejected the sizes, the stamp, a source or a slot")
    return StepOutputs(locations, fetch_src, fetch_dst, fetch_count[:groups], flags)


def step_setup(lib: ctypes.CDLL, starts: list[int], slots: list[int], page_table: torch.Tensor,
               key_pages: torch.Tensor, width: int, query_len: int, page_rows: int, keys_per_page: int
               ) -> tuple[torch.Tensor, int]:
    """A KV step's per-step values from the batch state by one library call (``dhs_step_setup_i64``): one int64
    vector holding starts ``[B]``, lengths ``[B]``, the page-table snapshot ``[B, S, width]`` of the requests'
    slots, the new tokens' arena rows ``[S, B, Q]`` (0 where unmapped), their key pages ``[L, B, Q]`` and offsets
    within the page ``[B, Q]``; and the flags (``STEP_UNMAPPED`` when a new token's page is not mapped).
    ``page_table [slots, S, M]`` / ``key_pages [slots, L, KB]``: CPU int64 with a contiguous last dimension."""
    _strided("page_table", page_table, 1, 0, "step_setup")
    _strided("key_pages", key_pages, 1, 0, "step_setup")
    batch, sources, indexers = len(starts), page_table.shape[1], key_pages.shape[1]
    bq = batch * query_len
    out = torch.empty(2 * batch + batch * sources * width + (sources + indexers + 1) * bq, dtype=torch.int64)
    starts_c, slots_c = (ctypes.c_int64 * batch)(*starts), (ctypes.c_int64 * batch)(*slots)
    args = (ctypes.c_int64 * _SETUP_ARGS)(
        batch, query_len, sources, indexers, page_rows, keys_per_page, width, page_table.shape[0],
        page_table.shape[2], key_pages.shape[2], page_table.stride(0), page_table.stride(1), key_pages.stride(0),
        key_pages.stride(1), ctypes.addressof(starts_c), ctypes.addressof(slots_c), page_table.data_ptr(),
        key_pages.data_ptr() if indexers else 0, out.data_ptr(),
    )  # fmt: skip
    flags = int(lib.dhs_step_setup_i64(args))
    if flags < 0:
        raise ValueError("step_setup: the library rejected the sizes, a slot, a page or a key block")
    return out, flags
