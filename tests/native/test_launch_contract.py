"""Python's launcher layer against the C++ launch contract (``plugins/common/include/dhisparse/launch.h``).

The CUDA launchers and the TensorRT plugins' ``enqueue`` take the argument structs of ``launch.h`` and launch
what its ``plan_*`` functions return. The CPU library exports the same code, so without a GPU we check:
the ctypes mirror's layout (size and every field offset), that each field packed from torch tensors is what
C++ reads, and the launch rules (copy grid 4→32 blocks by batch, resolver and attention grids, workspace,
access width, refusals).
"""

from __future__ import annotations

import struct

import pytest
import torch

from dhisparse.kernels import abi, native

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason=f"native CPU library not built ({native.library_path()}); run scripts/setup_native.sh",
)


@pytest.mark.parametrize("kind", [abi.KIND_RESOLVER, abi.KIND_ROW_COPY, abi.KIND_SPARSE_MLA, abi.KIND_PLAN,
                                  abi.KIND_STEP_RESOLVER])
def test_ctypes_structs_have_the_cpp_layout(kind: int) -> None:
    assert abi.python_layout(kind) == abi.cpp_layout(kind)


def resolver_tensors(r: int, n: int, m: int, b: int, dtype: torch.dtype = torch.int64):
    ins = [torch.zeros(1, dtype=dtype), torch.zeros(r, n, dtype=dtype), torch.zeros(r, m, dtype=dtype),
           torch.zeros(r, b, dtype=dtype), torch.zeros(r, b, dtype=dtype), torch.zeros(r, b, dtype=dtype)]
    out = {"locations": torch.zeros(r, n, dtype=dtype), "steps": torch.zeros(r, n, dtype=torch.int8),
           "hot_pos": torch.zeros(r, b, dtype=dtype), "hot_stamp": torch.zeros(r, b, dtype=dtype),
           "copy_position": torch.zeros(r, n, dtype=dtype), "copy_slot": torch.zeros(r, n, dtype=dtype),
           "copy_location": torch.zeros(r, n, dtype=dtype), "summary": torch.zeros(r, 6, dtype=torch.int32)}
    return ins, out


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_resolver_packing_is_what_cpp_reads(dtype: torch.dtype) -> None:
    (stamp, pos, table, hot_pos, hot_stamp, hot_loc), out = resolver_tensors(3, 211, 17, 260, dtype)
    args = abi.pack_resolver(stamp, pos, table, hot_pos, hot_stamp, hot_loc, 16, out)
    expected = [3, 211, 17, 260, 16, dtype.itemsize, stamp.data_ptr(), pos.data_ptr(), table.data_ptr(),
                hot_pos.data_ptr(), hot_stamp.data_ptr(), hot_loc.data_ptr()]
    expected += [out[k].data_ptr() for k in ("locations", "steps", "hot_pos", "hot_stamp", "copy_position",
                                              "copy_slot", "copy_location", "summary")]
    assert abi.cpp_fields(abi.KIND_RESOLVER, args) == expected


def test_row_copy_and_attention_packing_is_what_cpp_reads() -> None:
    host, arena = torch.zeros(50, 576, dtype=torch.bfloat16), torch.zeros(70, 576, dtype=torch.bfloat16)
    src, dst = torch.zeros(5, 9, dtype=torch.int32), torch.zeros(5, 9, dtype=torch.int32)
    args = abi.pack_row_copy(host, arena, src, dst)
    assert abi.cpp_fields(abi.KIND_ROW_COPY, args) == [host.data_ptr(), 0, arena.data_ptr(), 1152, src.data_ptr(),
                                                      dst.data_ptr(), 5, 9, 4]
    q_lat, q_pe = torch.zeros(2, 3, 7, 512, dtype=torch.bfloat16), torch.zeros(2, 3, 7, 64, dtype=torch.bfloat16)
    loc, out = torch.zeros(2, 3, 61, dtype=torch.int64), torch.zeros(2, 3, 7, 512, dtype=torch.bfloat16)
    args = abi.pack_sparse_mla(q_lat, q_pe, arena, loc, 0.0417, out)
    scale_bits = struct.unpack("<i", struct.pack("<f", 0.0417))[0]
    assert abi.cpp_fields(abi.KIND_SPARSE_MLA, args) == [2, 3, 7, 61, 512, 64, 1, 1, 8, scale_bits, q_lat.data_ptr(),
                                                        q_pe.data_ptr(), arena.data_ptr(), loc.data_ptr(),
                                                        out.data_ptr()]


def test_packing_refuses_mixed_index_types_and_strided_tensors() -> None:
    (stamp, pos, table, hot_pos, hot_stamp, hot_loc), out = resolver_tensors(2, 5, 3, 8)
    with pytest.raises(ValueError, match="int32 or all int64"):
        abi.pack_resolver(stamp, pos.int(), table, hot_pos, hot_stamp, hot_loc, 4, out)
    with pytest.raises(ValueError, match="page_table must be contiguous"):
        abi.pack_resolver(stamp, pos, torch.zeros(3, 2, dtype=torch.int64).t(), hot_pos, hot_stamp, hot_loc, 4, out)
    q = torch.zeros(1, 1, 2, 8)
    with pytest.raises(ValueError, match="float64"):
        abi.pack_sparse_mla(q, torch.zeros(1, 1, 2, 4), torch.zeros(5, 12, dtype=torch.float64),
                            torch.zeros(1, 1, 3, dtype=torch.int64), 1.0, q.clone())


def copy_plan(batch: int, row_values: int = 576, dtype: torch.dtype = torch.bfloat16, host_offset: int = 0
              ) -> abi.LaunchPlan:
    host = torch.zeros(64 * row_values + 1, dtype=dtype)[host_offset : host_offset + 64 * row_values]
    arena = torch.zeros(64, row_values, dtype=dtype)
    src = torch.zeros(batch, 3, dtype=torch.int64)
    return abi.cpp_plan(abi.KIND_ROW_COPY, abi.pack_row_copy(host.view(64, row_values), arena, src, src.clone()))


def test_copy_grid_grows_from_4_to_32_blocks_with_the_batch() -> None:
    grids = {b: copy_plan(b).grid_x for b in range(1, 201)}
    assert all(grids[b] == min(32, max(4, -(-b // 4))) for b in grids)
    assert (grids[1], grids[16], grids[17], grids[20], grids[21], grids[124], grids[125], grids[200]) == (
        4, 4, 5, 5, 6, 31, 32, 32)
    assert all(copy_plan(b).block == 256 for b in (1, 64, 200))
    assert copy_plan(8).grid_x == native.copy_grid_blocks(8)


def test_copy_access_width_follows_row_size_and_alignment() -> None:
    assert copy_plan(4, 576, torch.bfloat16).vector_bytes == 16  # 1152-byte rows
    assert copy_plan(4, 81, torch.float32).vector_bytes == 4  # 324-byte rows
    assert copy_plan(4, 3, torch.bfloat16).vector_bytes == 1  # 6-byte rows
    assert copy_plan(4, 576, torch.bfloat16, host_offset=1).vector_bytes == 1  # host base 2-byte aligned


def test_copy_plan_skips_empty_batches_and_refuses_bad_sizes() -> None:
    assert copy_plan(0).status == abi.PLAN_EMPTY
    args = abi.pack_row_copy(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(1, 2, dtype=torch.int64),
                             torch.zeros(1, 2, dtype=torch.int64))
    args.index_bytes = 2
    assert abi.cpp_plan(abi.KIND_ROW_COPY, args).status == -2


def scratch_bytes(n: int, b: int) -> int:
    """block_resolver.h's block_scratch_bytes spelled out: sorted entries pow2(N) * 8, the hash table / eviction
    keys max(4 * pow2(2B), 8 * pow2(B)), entry and rank pow2(N) * 4 each, step codes align8(pow2(N)), needed
    align8(B)."""
    pow2 = lambda x: 1 << max(x - 1, 0).bit_length()  # noqa: E731
    align8 = lambda x: (x + 7) & ~7  # noqa: E731
    n2 = pow2(max(n, 1))
    return n2 * 8 + align8(max(4 * max(pow2(2 * b), 2), 8 * pow2(max(b, 1)))) + n2 * 8 + align8(n2) + align8(b)


def test_resolver_plan_one_block_per_row_scratch_in_shared_memory_when_it_fits() -> None:
    (stamp, pos, table, hot_pos, hot_stamp, hot_loc), out = resolver_tensors(3, 211, 17, 260)
    plan = abi.cpp_plan(abi.KIND_RESOLVER, abi.pack_resolver(stamp, pos, table, hot_pos, hot_stamp, hot_loc, 16, out))
    assert (plan.status, plan.grid_x, plan.grid_y, plan.block) == (abi.PLAN_OK, 3, 1, 512)
    assert (plan.shared_bytes, plan.workspace_bytes) == (scratch_bytes(211, 260), 0)
    assert scratch_bytes(2048, 4096) == 71680  # GLM-5 sizes: 70 KB, in shared memory
    (stamp, pos, table, hot_pos, hot_stamp, hot_loc), out = resolver_tensors(3, 3000, 17, 6000)
    plan = abi.cpp_plan(abi.KIND_RESOLVER, abi.pack_resolver(stamp, pos, table, hot_pos, hot_stamp, hot_loc, 16, out))
    assert (plan.shared_bytes, plan.workspace_bytes) == (0, 3 * scratch_bytes(3000, 6000))  # past 96 KB: global
    args = abi.pack_resolver(stamp, pos, table, hot_pos, hot_stamp, hot_loc, 0, out)
    assert abi.cpp_plan(abi.KIND_RESOLVER, args).status == -1  # page_rows must be > 0
    args.page_rows, args.hot_rows = 16, 1 << 24
    assert abi.cpp_plan(abi.KIND_RESOLVER, args).status == -1  # B below 2^24 (packed sort keys)
    args.hot_rows, args.num_sources = 260, 0
    assert abi.cpp_plan(abi.KIND_RESOLVER, args).status == abi.PLAN_EMPTY


def step_args(batch: int = 5, n: int = 300, groups: int = 3, hot_rows: int = 700, staging: int = 0
              ) -> tuple[abi.StepResolveArgs, dict[str, torch.Tensor], list[torch.Tensor]]:
    sources, slots_n, pages = 4, batch + 2, 9
    keep = [torch.zeros(1, dtype=torch.int64), torch.zeros(batch, n, dtype=torch.int64),
            torch.zeros(batch, dtype=torch.int64), torch.arange(groups), torch.arange(batch),
            torch.zeros(batch, sources, pages + 2, dtype=torch.int64)[:, :, :pages],
            torch.zeros(slots_n, sources, hot_rows, dtype=torch.int64), torch.zeros(slots_n, sources, hot_rows,
                                                                                     dtype=torch.int64),
            torch.zeros(slots_n, sources, hot_rows, dtype=torch.int64), torch.zeros(slots_n, sources, 11,
                                                                                     dtype=torch.int64),
            (torch.zeros(slots_n, groups + 2, staging, dtype=torch.int64), torch.arange(groups) + 1) if staging
            else None]
    out = {"locations": torch.zeros(groups, batch, n, dtype=torch.int64),
           "steps": torch.zeros(groups, batch, n, dtype=torch.int8),
           "fetch_src": torch.zeros(groups, batch, n, dtype=torch.int64),
           "fetch_dst": torch.zeros(groups, batch, n, dtype=torch.int64),
           "counts": torch.zeros(batch, 3, dtype=torch.int64), "staged": torch.zeros(batch, dtype=torch.int64),
           "flags": torch.zeros(1, dtype=torch.int32)}
    return abi.pack_step_resolver(*keep, 16, out), out, keep


def test_step_resolver_packing_is_what_cpp_reads_and_its_plan() -> None:
    args, out, keep = step_args(staging=6)
    stamp, positions, lengths, sources, slots, table, hot_pos, hot_stamp, hot_loc, host, (staging, members) = keep
    expected = [5, 300, 3, 700, 16, 9, 11, 4, 7, 6, 5, *table.stride()[:2], *hot_pos.stride()[:2],
                *host.stride()[:2], *staging.stride()[:2]]
    expected += [t.data_ptr() for t in (stamp, positions, lengths, sources, slots, table, hot_pos, hot_stamp, hot_loc,
                                        host, members, staging)]
    expected += [out[k].data_ptr() for k in ("locations", "steps", "fetch_src", "fetch_dst", "counts", "staged",
                                             "flags")]
    assert abi.cpp_fields(abi.KIND_STEP_RESOLVER, args) == expected
    plan = abi.cpp_plan(abi.KIND_STEP_RESOLVER, args)
    assert (plan.status, plan.grid_x, plan.block, plan.shared_bytes) == (abi.PLAN_OK, 15, 512, scratch_bytes(300, 700))
    args.flags = None
    assert abi.cpp_plan(abi.KIND_STEP_RESOLVER, args).status == -4  # a required pointer is null
    args, _, _ = step_args(batch=0)
    assert abi.cpp_plan(abi.KIND_STEP_RESOLVER, args).status == abi.PLAN_EMPTY
    with pytest.raises(ValueError, match="flags must be a contiguous torch.int32"):
        bad = dict(out, flags=torch.zeros(1, dtype=torch.int64))
        abi.pack_step_resolver(*keep, 16, bad)


def test_sparse_mla_plan_grid_shared_memory_and_formats() -> None:
    q_lat, q_pe = torch.zeros(2, 3, 7, 512), torch.zeros(2, 3, 7, 64)
    loc, out, kv = torch.zeros(2, 3, 61, dtype=torch.int32), torch.zeros(2, 3, 7, 512), torch.zeros(9, 576)
    args = abi.pack_sparse_mla(q_lat, q_pe, kv, loc, 0.05, out)
    plan = abi.cpp_plan(abi.KIND_SPARSE_MLA, args)
    assert (plan.status, plan.grid_x, plan.grid_y, plan.block) == (abi.PLAN_OK, 6, 2, 128)  # ceil(7 / 4 warps)
    assert plan.shared_bytes == 4 * 4 * (2 * 512 + 64)
    fp8 = abi.pack_sparse_mla(q_lat, q_pe, torch.zeros(9, 656, dtype=torch.uint8), loc, 0.05, out, abi.KV_FORMAT_FP8)
    assert abi.cpp_plan(abi.KIND_SPARSE_MLA, fp8).status == abi.PLAN_OK
    bad = abi.pack_sparse_mla(q_lat[..., :96].contiguous(), q_pe, kv, loc, 0.05, out[..., :96].contiguous(),
                              abi.KV_FORMAT_FP8)
    assert abi.cpp_plan(abi.KIND_SPARSE_MLA, bad).status == -3  # FP8 rows need rank 512, rope 64


needs_cuda_library = pytest.mark.skipif(
    abi.cuda_library() is None, reason=f"CUDA kernel library not built ({abi.cuda_library_path()}); needs nvcc"
)


@needs_cuda_library
def test_the_cuda_library_plans_exactly_like_the_contract() -> None:
    """libdhisparse_cuda.so (the launchers Python and the plugins call) loads without a GPU; its host code
    computes the same plans as the CPU library for every kind of launch."""
    from dhisparse.kernels.cuda_kernels import CudaKernels

    kernels = CudaKernels(abi.cuda_library(), torch.device("cpu"))
    host, arena = torch.zeros(50, 576, dtype=torch.bfloat16), torch.zeros(70, 576, dtype=torch.bfloat16)
    for batch in (1, 16, 17, 124, 125, 200):
        src = torch.zeros(batch, 3, dtype=torch.int64)
        args = abi.pack_row_copy(host, arena, src, src.clone())
        got, want = kernels.plan(abi.KIND_ROW_COPY, args), abi.cpp_plan(abi.KIND_ROW_COPY, args)
        assert bytes(got) == bytes(want) and got.grid_x == min(32, max(4, -(-batch // 4)))
    (stamp, pos, table, hot_pos, hot_stamp, hot_loc), out = resolver_tensors(5, 300, 9, 700)
    args = abi.pack_resolver(stamp, pos, table, hot_pos, hot_stamp, hot_loc, 64, out)
    assert bytes(kernels.plan(abi.KIND_RESOLVER, args)) == bytes(abi.cpp_plan(abi.KIND_RESOLVER, args))
    q = torch.zeros(3, 2, 9, 512)
    loc = torch.zeros(3, 2, 7, dtype=torch.int64)
    args = abi.pack_sparse_mla(q, torch.zeros(3, 2, 9, 64), torch.zeros(5, 576), loc, 0.1, q.clone())
    assert bytes(kernels.plan(abi.KIND_SPARSE_MLA, args)) == bytes(abi.cpp_plan(abi.KIND_SPARSE_MLA, args))
    args, _, _ = step_args(staging=3)
    assert bytes(kernels.plan(abi.KIND_STEP_RESOLVER, args)) == bytes(abi.cpp_plan(abi.KIND_STEP_RESOLVER, args))


@needs_cuda_library
def test_the_cuda_launchers_refuse_bad_arguments_before_touching_a_device() -> None:
    import ctypes

    from dhisparse.kernels.cuda_kernels import CudaKernels, KernelLaunchError

    lib = abi.cuda_library()
    src = torch.zeros(2, 3, dtype=torch.int64)
    args = abi.pack_row_copy(torch.zeros(4, 8), torch.zeros(4, 8), src, src.clone())
    args.index_bytes = 3
    rc = lib.dhs_cuda_launch_row_copy(ctypes.byref(args), None)
    assert lib.dhs_cuda_error_name(rc) == b"cudaErrorInvalidValue"
    args.index_bytes, args.num_requests = 8, 0
    assert lib.dhs_cuda_launch_row_copy(ctypes.byref(args), None) == 0  # empty: nothing launched
    kernels = CudaKernels(lib, torch.device("cpu"))
    with pytest.raises(KernelLaunchError, match="index_bytes must be 4 or 8"):
        args.num_requests = 2
        args.index_bytes = 2
        kernels.plan(abi.KIND_ROW_COPY, args)
    with pytest.raises(ValueError, match="pinned"):
        kernels.copy_rows(torch.zeros(4, 8), torch.zeros(4, 8), src, src.clone())
