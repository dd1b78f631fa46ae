"""ctypes mirror of the launch contract in ``plugins/common/include/dhisparse/launch.h``, and the libraries.

The CUDA kernels are launched from Python the same way the TensorRT plugins' ``enqueue`` launches them: an
argument struct (:class:`ResolverArgs`, :class:`RowCopyArgs`, :class:`SparseMlaArgs`, byte for byte the C++
structs) is packed from torch tensors' ``data_ptr()`` and handed to ``dhisparse::cuda::launch_*`` through the
C ABI of ``libdhisparse_cuda.so`` (``dhs_cuda_launch_*``), on torch's current CUDA stream. The launchers run
the ``plan_*`` rules of ``launch.h`` (validation, grid, block, shared memory, workspace); the CPU library
``libdhisparse_cpu.so`` exports the same rules (``dhs_launch_plan``, ``dhs_launch_layout``,
``dhs_launch_fields``) so that tests check this module's packing on machines without a GPU.

Nothing here loads at import time; :func:`cuda_library` and :func:`contract_library` return ``None`` when the
library is not built.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

from dhisparse.kernels import native

ABI_VERSION = 3
REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_PLUGINS = REPO_ROOT / "build" / "native" / "plugins"

# Kinds of dhs_launch_layout / dhs_launch_fields / dhs_launch_plan (DHS_LAUNCH_* in c_api.h).
KIND_RESOLVER, KIND_ROW_COPY, KIND_SPARSE_MLA, KIND_PLAN, KIND_STEP_RESOLVER = 0, 1, 2, 3, 4
# LaunchPlan.status (dhisparse::PlanStatus).
PLAN_OK, PLAN_EMPTY = 0, 1
PLAN_ERRORS = {-1: "a size is negative or out of range", -2: "index_bytes must be 4 or 8",
               -3: "kv_format does not fit (rank, rope)", -4: "a required tensor pointer is null"}
# KvFormat of mla_row.h.
KV_FORMAT = {torch.float32: 0, torch.bfloat16: 1}
KV_FORMAT_FP8 = 2

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float


class ResolverArgs(ctypes.Structure):
    _fields_ = [
        ("num_sources", _i64), ("n_select", _i64), ("num_pages", _i64), ("hot_rows", _i64), ("page_rows", _i64),
        ("index_bytes", _i32), ("pad0", _i32), ("stamp", _ptr), ("positions", _ptr), ("page_table", _ptr),
        ("hot_pos_in", _ptr), ("hot_stamp_in", _ptr), ("hot_loc", _ptr), ("locations", _ptr), ("steps", _ptr),
        ("hot_pos_out", _ptr), ("hot_stamp_out", _ptr), ("copy_position", _ptr), ("copy_slot", _ptr),
        ("copy_location", _ptr), ("summary", _ptr),
    ]


class RowCopyArgs(ctypes.Structure):
    _fields_ = [
        ("host_rows", _ptr), ("host_rows_address", _ptr), ("device_rows", _ptr), ("row_bytes", _i64),
        ("src_rows", _ptr), ("dst_rows", _ptr), ("num_requests", _i64), ("copies_per_request", _i64),
        ("index_bytes", _i32), ("pad0", _i32),
    ]


class SparseMlaArgs(ctypes.Structure):
    _fields_ = [
        ("batch", _i64), ("queries", _i64), ("heads", _i64), ("topk", _i64), ("rank", _i32), ("rope", _i32),
        ("kv_format", _i32), ("q_bf16", _i32), ("index_bytes", _i32), ("softmax_scale", _f32), ("q_lat", _ptr),
        ("q_pe", _ptr), ("kv", _ptr), ("locations", _ptr), ("out_lat", _ptr),
    ]


_STEP_SIZES = ("batch", "n", "groups", "hot_rows", "page_rows", "num_pages", "host_num_pages", "num_sources",
               "num_slots", "staging_rows", "staging_count", "table_row_stride", "table_source_stride",
               "hot_slot_stride", "hot_source_stride", "host_slot_stride", "host_source_stride", "staging_slot_stride",
               "staging_group_stride")
_STEP_POINTERS = ("stamp", "positions", "lengths", "sources", "slots", "page_table", "hot_pos", "hot_stamp", "hot_loc",
                  "host_pages", "staging_slots", "staging_loc", "locations", "steps", "fetch_src", "fetch_dst",
                  "counts", "staged", "flags")


class StepResolveArgs(ctypes.Structure):
    _fields_ = [(name, _i64) for name in _STEP_SIZES] + [(name, _ptr) for name in _STEP_POINTERS]


class LaunchPlan(ctypes.Structure):
    _fields_ = [
        ("status", _i32), ("grid_x", _i32), ("grid_y", _i32), ("block", _i32), ("shared_bytes", _i64),
        ("workspace_bytes", _i64), ("vector_bytes", _i32), ("pad0", _i32),
    ]


STRUCT_OF_KIND: dict[int, type[ctypes.Structure]] = {
    KIND_RESOLVER: ResolverArgs, KIND_ROW_COPY: RowCopyArgs, KIND_SPARSE_MLA: SparseMlaArgs, KIND_PLAN: LaunchPlan,
    KIND_STEP_RESOLVER: StepResolveArgs,
}


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _index_bytes(*tensors: torch.Tensor) -> int:
    sizes = {t.element_size() for t in tensors}
    if len(sizes) != 1 or tensors[0].dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index tensors must all be int32 or all int64, got {[t.dtype for t in tensors]}")
    return sizes.pop()


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read dense row-major memory)")


def pack_resolver(
    stamp: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor,
    hot_stamp: torch.Tensor, hot_loc: torch.Tensor, page_rows: int, out: dict[str, torch.Tensor],
) -> ResolverArgs:
    """Resolver arguments: ``positions [R, N]``, ``page_table [R, M]``, ``hot_* [R, B]``, ``stamp [1]``, all
    of one index dtype; ``out`` holds ``locations, steps, hot_pos, hot_stamp, copy_position, copy_slot,
    copy_location, summary`` (shapes of ``dhisparse/resolver.h``)."""
    for name, t in (("positions", positions), ("page_table", page_table), ("hot_pos", hot_pos),
                    ("hot_stamp", hot_stamp), ("hot_loc", hot_loc), *out.items()):
        _contiguous(name, t)
    if positions.dim() != 2 or page_table.dim() != 2 or hot_pos.dim() != 2:
        raise ValueError("positions, page_table and hot_pos must be 2-D [R, ...] tensors")
    index_bytes = _index_bytes(stamp, positions, page_table, hot_pos, hot_stamp, hot_loc)
    return ResolverArgs(
        num_sources=positions.shape[0], n_select=positions.shape[1], num_pages=page_table.shape[1],
        hot_rows=hot_pos.shape[1], page_rows=page_rows, index_bytes=index_bytes, pad0=0,
        stamp=stamp.data_ptr(), positions=positions.data_ptr(), page_table=page_table.data_ptr(),
        hot_pos_in=hot_pos.data_ptr(), hot_stamp_in=hot_stamp.data_ptr(), hot_loc=hot_loc.data_ptr(),
        locations=out["locations"].data_ptr(), steps=out["steps"].data_ptr(), hot_pos_out=out["hot_pos"].data_ptr(),
        hot_stamp_out=out["hot_stamp"].data_ptr(), copy_position=out["copy_position"].data_ptr(),
        copy_slot=out["copy_slot"].data_ptr(), copy_location=out["copy_location"].data_ptr(),
        summary=out["summary"].data_ptr(),
    )


def pack_step_resolver(
    stamp: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None, sources: torch.Tensor,
    slots: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
    hot_loc: torch.Tensor, host_pages: torch.Tensor | None, staging: tuple[torch.Tensor, torch.Tensor] | None,
    page_rows: int, out: dict[str, torch.Tensor],
) -> StepResolveArgs:
    """Step-resolver arguments (``StepResolveArgs`` of launch.h), all int64: ``stamp [1]``, ``positions [B, N]``,
    ``lengths [B]`` (or None), ``sources [G]``, ``slots [B]``, ``page_table [B, S, M]`` (a snapshot by request),
    ``hot_pos / hot_stamp / hot_loc [slots, S, H]`` (one layout; updated in place), ``host_pages [slots, S, M']`` or
    None, ``staging`` = ``(staging_loc [slots, staging slots, T], staging_slots [G])`` (the batch state's staging rows
    and each group member's staging slot) or None; 3-D tensors need a contiguous last dimension. ``out``:
    ``locations`` ``[G, B, N]``, ``steps`` (int8, optional), ``fetch_src`` / ``fetch_dst`` ``[G, B, N]``, ``counts
    [B, 3]`` (added to), ``staged [B]`` (optional, added to), ``flags`` int32 ``[1]`` (or-ed into)."""
    staging_loc, staging_slots = staging if staging is not None else (None, None)
    for name, t in (("stamp", stamp), ("positions", positions), ("sources", sources), ("slots", slots),
                    *((k, v) for k, v in out.items() if v is not None), ("lengths", lengths),
                    ("staging_slots", staging_slots)):
        if t is None:
            continue
        want = torch.int32 if name == "flags" else torch.int8 if name == "steps" else torch.int64
        if t.dtype != want or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {want} tensor, got {t.dtype} {list(t.shape)}")
    for name, t in (("page_table", page_table), ("hot_pos", hot_pos), ("hot_stamp", hot_stamp),
                    ("hot_loc", hot_loc), ("host_pages", host_pages), ("staging_loc", staging_loc)):
        if t is not None and (t.dtype != torch.int64 or t.dim() != 3 or t.stride(2) != 1):
            raise ValueError(f"{name} must be an int64 [rows, sources, width] tensor with a contiguous last "
                             f"dimension, got {t.dtype} {list(t.shape)} strides {t.stride()}")
    if hot_stamp.stride() != hot_pos.stride() or hot_loc.stride() != hot_pos.stride() or \
            hot_stamp.shape != hot_pos.shape or hot_loc.shape != hot_pos.shape:
        raise ValueError("hot_pos, hot_stamp and hot_loc must have one shape and layout")
    batch, n = positions.shape
    groups = sources.shape[0]
    if out["locations"].shape != (groups, batch, n) or out["fetch_src"].shape != (groups, batch, n) or \
            out["fetch_dst"].shape != (groups, batch, n) or out["counts"].shape != (batch, 3):
        raise ValueError("locations / fetch_src / fetch_dst must be [G, B, N] and counts [B, 3]")
    host = host_pages if host_pages is not None else hot_pos
    staged_rows = 0 if staging_loc is None else staging_loc.shape[2]
    if staged_rows and (staging_slots is None or staging_slots.shape != (groups,)
                        or staging_loc.shape[0] != hot_pos.shape[0]):
        raise ValueError(f"staging must be (staging_loc [slots, staging slots, T], staging_slots [G = {groups}])")
    return StepResolveArgs(
        batch=batch, n=n, groups=groups, hot_rows=hot_pos.shape[2], page_rows=page_rows,
        num_pages=page_table.shape[2], host_num_pages=host.shape[2], num_sources=page_table.shape[1],
        num_slots=hot_pos.shape[0], staging_rows=staged_rows,
        staging_count=staging_loc.shape[1] if staged_rows else 0, table_row_stride=page_table.stride(0),
        table_source_stride=page_table.stride(1), hot_slot_stride=hot_pos.stride(0),
        hot_source_stride=hot_pos.stride(1), host_slot_stride=host.stride(0), host_source_stride=host.stride(1),
        staging_slot_stride=staging_loc.stride(0) if staged_rows else 0,
        staging_group_stride=staging_loc.stride(1) if staged_rows else 0,
        stamp=stamp.data_ptr(), positions=positions.data_ptr(), lengths=_ptr_of(lengths),
        sources=sources.data_ptr(), slots=slots.data_ptr(), page_table=page_table.data_ptr(),
        hot_pos=hot_pos.data_ptr(), hot_stamp=hot_stamp.data_ptr(), hot_loc=hot_loc.data_ptr(),
        host_pages=_ptr_of(host_pages), staging_slots=_ptr_of(staging_slots) if staged_rows else None,
        staging_loc=_ptr_of(staging_loc) if staged_rows else None,
        locations=out["locations"].data_ptr(), steps=_ptr_of(out.get("steps")),
        fetch_src=out["fetch_src"].data_ptr(), fetch_dst=out["fetch_dst"].data_ptr(),
        counts=out["counts"].data_ptr(), staged=_ptr_of(out.get("staged")), flags=out["flags"].data_ptr(),
    )


def pack_row_copy(host_rows: torch.Tensor, device_rows: torch.Tensor, src_rows: torch.Tensor,
                  dst_rows: torch.Tensor) -> RowCopyArgs:
    """Gather copy ``device_rows[dst_rows[r, i]] = host_rows[src_rows[r, i]]`` for ``src >= 0``.

    ``host_rows`` / ``device_rows`` are ``[rows, ...]`` of one dtype (a row is everything past dim 0);
    ``src_rows`` / ``dst_rows`` ``[R, M]`` int32 or int64 on the device."""
    _contiguous("host_rows", host_rows)
    _contiguous("device_rows", device_rows)
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 2:
        raise ValueError(f"src_rows and dst_rows must be the same [R, M] shape, got {list(src_rows.shape)} "
                         f"and {list(dst_rows.shape)}")
    if host_rows.dtype != device_rows.dtype or host_rows.shape[1:] != device_rows.shape[1:]:
        raise ValueError("host_rows and device_rows must have the same dtype and row shape")
    row_bytes = host_rows[0].numel() * host_rows.element_size() if host_rows.shape[0] else 0
    row_bytes = row_bytes or device_rows[0].numel() * device_rows.element_size()
    return RowCopyArgs(
        host_rows=host_rows.data_ptr(), host_rows_address=None, device_rows=device_rows.data_ptr(),
        row_bytes=row_bytes, src_rows=src_rows.data_ptr(), dst_rows=dst_rows.data_ptr(),
        num_requests=src_rows.shape[0], copies_per_request=src_rows.shape[1],
        index_bytes=_index_bytes(src_rows, dst_rows), pad0=0,
    )


def pack_sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor,
                    softmax_scale: float, out_lat: torch.Tensor, kv_format: int | None = None) -> SparseMlaArgs:
    """``q_lat [B, Q, H, rank]``, ``q_pe [B, Q, H, rope]`` (float32 or bfloat16), ``kv [rows, width]``
    (float32 / bfloat16 rows of ``rank + rope`` values, or 656-byte FP8 rows with ``kv_format=2``),
    ``locations [B, Q, K]`` int32/int64 (``-1`` masked), ``out_lat`` like ``q_lat``."""
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("kv", kv), ("locations", locations), ("out_lat", out_lat)):
        _contiguous(name, t)
    if q_lat.dim() != 4 or q_pe.shape[:3] != q_lat.shape[:3] or locations.dim() != 3:
        raise ValueError(f"q_lat must be [B, Q, H, rank], q_pe [B, Q, H, rope], locations [B, Q, K]; got "
                         f"{list(q_lat.shape)}, {list(q_pe.shape)}, {list(locations.shape)}")
    if q_lat.dtype not in (torch.float32, torch.bfloat16) or q_pe.dtype != q_lat.dtype or out_lat.dtype != q_lat.dtype:
        raise ValueError(f"q_lat, q_pe and out_lat must all be float32 or all bfloat16, got {q_lat.dtype}, "
                         f"{q_pe.dtype}, {out_lat.dtype}")
    if kv_format is None:
        if kv.dtype not in KV_FORMAT:
            raise ValueError(f"kv rows of dtype {kv.dtype} have no kernel format (float32, bfloat16, or FP8 rows)")
        kv_format = KV_FORMAT[kv.dtype]
    b, q, h, rank = q_lat.shape
    return SparseMlaArgs(
        batch=b, queries=q, heads=h, topk=locations.shape[2], rank=rank, rope=q_pe.shape[3], kv_format=kv_format,
        q_bf16=int(q_lat.dtype == torch.bfloat16), index_bytes=_index_bytes(locations),
        softmax_scale=float(softmax_scale), q_lat=q_lat.data_ptr(), q_pe=q_pe.data_ptr(), kv=kv.data_ptr(),
        locations=locations.data_ptr(), out_lat=out_lat.data_ptr(),
    )


def plan_error(kind: str, status: int) -> str:
    return f"{kind} launch refused by the launch contract: {PLAN_ERRORS.get(status, f'status {status}')}"


def _library_path(env: str, name: str) -> Path:
    override = os.environ.get(env)
    return Path(override) if override else BUILD_PLUGINS / name


def cuda_library_path() -> Path:
    """Where :func:`cuda_library` looks (``$DHISPARSE_CUDA_LIB`` or ``build/native/plugins``)."""
    return _library_path("DHISPARSE_CUDA_LIB", "libdhisparse_cuda.so")


@lru_cache(maxsize=1)
def cuda_library() -> ctypes.CDLL | None:
    """``libdhisparse_cuda.so`` (the launchers), or ``None`` when it is not built or has another ABI."""
    path = cuda_library_path()
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    lib.dhs_cuda_abi_version.restype = _i32
    if lib.dhs_cuda_abi_version() != ABI_VERSION:
        return None
    for name, struct in (("resolver", ResolverArgs), ("row_copy", RowCopyArgs), ("sparse_mla", SparseMlaArgs),
                         ("step_resolver", StepResolveArgs)):
        fn = getattr(lib, f"dhs_cuda_launch_{name}")
        fn.restype = _i32
        with_workspace = name in ("resolver", "step_resolver")
        fn.argtypes = [ctypes.POINTER(struct), _ptr, _ptr] if with_workspace else [ctypes.POINTER(struct), _ptr]
    lib.dhs_cuda_launch_plan.restype = _i32
    lib.dhs_cuda_launch_plan.argtypes = [_i32, _ptr, ctypes.POINTER(LaunchPlan)]
    lib.dhs_cuda_error_name.restype = ctypes.c_char_p
    lib.dhs_cuda_error_name.argtypes = [_i32]
    return lib


@lru_cache(maxsize=1)
def contract_library() -> ctypes.CDLL | None:
    """``libdhisparse_cpu.so`` with the launch contract exported (``None`` when not built)."""
    lib = native.load()
    if lib is None:
        return None
    lib.dhs_launch_layout.restype = _i32
    lib.dhs_launch_layout.argtypes = [_i32, ctypes.POINTER(_i64), _i32]
    lib.dhs_launch_fields.restype = _i32
    lib.dhs_launch_fields.argtypes = [_i32, _ptr, ctypes.POINTER(_i64), _i32]
    lib.dhs_launch_plan.restype = _i32
    lib.dhs_launch_plan.argtypes = [_i32, _ptr, ctypes.POINTER(LaunchPlan)]
    lib.dhs_emulate_launch.restype = _i32
    lib.dhs_emulate_launch.argtypes = [_i32, _ptr]
    return lib


def emulate_launch(kind: int, args: ctypes.Structure) -> int:
    """Runs the resolver kernel of ``args`` (``KIND_RESOLVER`` / ``KIND_STEP_RESOLVER``) on the CPU: the CPU
    library executes the kernel's block code (``resolver_blocks.h``) for every block of its grid with one thread,
    over the host tensors the struct points at. Returns the plan's status (0: done)."""
    lib = contract_library()
    assert lib is not None, "libdhisparse_cpu.so is not built"
    return int(lib.dhs_emulate_launch(kind, ctypes.byref(args)))


def python_layout(kind: int) -> list[int]:
    """``[sizeof, offset of every named field]`` of this module's mirror (pads excluded), as C++ reports."""
    struct = STRUCT_OF_KIND[kind]
    return [ctypes.sizeof(struct)] + [getattr(struct, n).offset for n, _ in struct._fields_ if n != "pad0"]


def cpp_layout(kind: int) -> list[int]:
    lib = contract_library()
    assert lib is not None, "libdhisparse_cpu.so is not built"
    out = (_i64 * 64)()
    n = lib.dhs_launch_layout(kind, out, 64)
    return list(out[:n])


def cpp_fields(kind: int, args: ctypes.Structure) -> list[int]:
    """Every named field of ``args`` as the C++ launcher reads it (see ``dhs_launch_fields``)."""
    lib = contract_library()
    assert lib is not None, "libdhisparse_cpu.so is not built"
    out = (_i64 * 64)()
    n = lib.dhs_launch_fields(kind, ctypes.byref(args), out, 64)
    return list(out[:n])


def cpp_plan(kind: int, args: ctypes.Structure) -> LaunchPlan:
    """The launch plan C++ computes for ``args`` (what the CUDA launcher would launch)."""
    lib = contract_library()
    assert lib is not None, "libdhisparse_cpu.so is not built"
    plan = LaunchPlan()
    lib.dhs_launch_plan(kind, ctypes.byref(args), ctypes.byref(plan))
    return plan
