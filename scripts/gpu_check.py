"""GPU check of the native kernels against pure-torch references (needs an NVIDIA GPU; sm_80 or sm_90).

Builds the native tree (``scripts/setup_native.sh``) unless ``--no-build``, loads ``libdhisparse_cuda.so``
through ctypes and, on random inputs of irregular sizes:

* the resolver kernel against ``dhisparse.kv.resolver.resolve`` (every output, int32 and int64 indices),
* the host->device gather copy against indexing of the pinned host tensor,
* sparse MLA decode (fp32, bf16 and the 656-byte FP8 row) against :func:`sparse_mla_reference`,

then prints copy bandwidth (GB/s) and resolver / attention times (median of CUDA-event timings) at batch
1, 2, 4, ..., 128. Without a GPU it says so and exits with status 2: nothing here runs on CPU machines.

Usage: ``python scripts/gpu_check.py [--no-build] [--quick]``
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

from dhisparse.kv.resolver import resolve  # noqa: E402 (after the sys.path set-up above)

LIB = ROOT / "build" / "native" / "plugins" / "libdhisparse_cuda.so"
FP8_RANK, FP8_ROPE, FP8_ROW_BYTES = 512, 64, 656
KV_FORMATS = {"fp32": 0, "bf16": 1, "fp8": 2}


def decode_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[n, 656]`` uint8 DeepSeek-V3.2 rows -> ``[n, 576]`` float32 (latent * per-128 scale, then rope)."""
    latent = rows[:, :FP8_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[:, FP8_RANK : FP8_RANK + 16].contiguous().view(torch.float32)
    rope = rows[:, FP8_RANK + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent * scales.repeat_interleave(128, dim=1), rope], dim=1)


def encode_fp8_rows(values: torch.Tensor) -> torch.Tensor:
    """``[n, 576]`` float -> ``[n, 656]`` uint8 rows (scale = amax / 448 per 128 latent values)."""
    latent = values[:, :FP8_RANK].float().view(-1, 4, 128)
    scales = (latent.abs().amax(dim=2) / 448.0).clamp(min=1e-12)
    quant = (latent / scales[..., None]).to(torch.float8_e4m3fn).view(-1, FP8_RANK)
    rope = values[:, FP8_RANK:].to(torch.bfloat16)
    return torch.cat(
        [quant.view(torch.uint8), scales.contiguous().view(torch.uint8), rope.contiguous().view(torch.uint8)],
        dim=1,
    )


def sparse_mla_reference(
    q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor, scale: float
) -> torch.Tensor:
    """Absorbed sparse MLA decode in float32.

    Args:
        q_lat: ``[B, Q, H, rank]``; q_pe: ``[B, Q, H, rope]``.
        kv: ``[rows, rank + rope]`` values (already decoded to float).
        locations: ``[B, Q, K]`` int, ``-1`` = masked.
        scale: softmax scale.

    Returns:
        ``[B, Q, H, rank]`` float32; zeros for a query whose locations are all ``-1``.
    """
    rank = q_lat.shape[-1]
    rows = kv.float()[locations.clamp(min=0).long()]  # [B, Q, K, rank + rope]
    q = torch.cat([q_lat.float(), q_pe.float()], dim=-1)  # [B, Q, H, rank + rope]
    scores = torch.einsum("bqhd,bqkd->bqhk", q, rows) * scale
    scores = scores.masked_fill((locations < 0)[:, :, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bqhk,bqkd->bqhd", probs, rows[..., :rank])


def load_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(LIB))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.dhs_cuda_resolver_workspace_bytes.restype = ctypes.c_size_t
    lib.dhs_cuda_resolver_workspace_bytes.argtypes = [i64, i64, i64]
    lib.dhs_cuda_resolve.argtypes = [i64] * 5 + [i32] + [ptr] * 16
    lib.dhs_cuda_row_copy.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i32, ptr]
    lib.dhs_cuda_sparse_mla.argtypes = [i64] * 4 + [i32] * 5 + [ctypes.c_float] + [ptr] * 6
    return lib


def _time_ms(fn, repeats: int = 20) -> float:
    """Median CUDA-event time of ``fn`` in milliseconds (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def random_resolver_case(g: torch.Generator, requests: int, n: int, pages: int, page_rows: int, slots: int):
    ready = torch.rand(requests, pages, generator=g) < 0.5
    page_table = torch.where(ready, torch.randperm(requests * pages, generator=g).view(requests, pages), -1)
    positions = torch.randint(0, pages * page_rows, (requests, n), generator=g)
    positions[torch.rand(requests, n, generator=g) < 0.1] = -1
    hot_pos = torch.full((requests, slots), -1, dtype=torch.int64)
    filled = torch.randperm(pages * page_rows, generator=g)[: slots // 2]
    hot_pos[:, : filled.numel()] = filled
    hot_stamp = torch.randint(0, 5, (requests, slots), generator=g)
    hot_loc = 10**6 + torch.arange(requests * slots).view(requests, slots)
    return positions, page_table, hot_pos, hot_stamp, hot_loc


def run_resolver(
    lib: ctypes.CDLL, case, stamp: int, page_rows: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    positions, page_table, hot_pos, hot_stamp, hot_loc = (t.to("cuda", dtype) for t in case)
    r, n = positions.shape
    b = hot_pos.shape[1]
    out = {
        "locations": torch.empty_like(positions),
        "steps": torch.empty(r, n, dtype=torch.int8, device="cuda"),
        "hot_pos": torch.empty_like(hot_pos),
        "hot_stamp": torch.empty_like(hot_stamp),
        "copy_position": torch.empty_like(positions),
        "copy_slot": torch.empty_like(positions),
        "copy_location": torch.empty_like(positions),
        "summary": torch.empty(r, 6, dtype=torch.int32, device="cuda"),
    }
    workspace = torch.empty(lib.dhs_cuda_resolver_workspace_bytes(r, n, b), dtype=torch.uint8, device="cuda")
    stamp_t = torch.tensor([stamp], dtype=dtype, device="cuda")

    def launch() -> None:
        rc = lib.dhs_cuda_resolve(
            r, n, page_table.shape[1], b, page_rows, positions.element_size(), stamp_t.data_ptr(),
            positions.data_ptr(), page_table.data_ptr(), hot_pos.data_ptr(), hot_stamp.data_ptr(),
            hot_loc.data_ptr(), out["locations"].data_ptr(), out["steps"].data_ptr(), out["hot_pos"].data_ptr(),
            out["hot_stamp"].data_ptr(), out["copy_position"].data_ptr(), out["copy_slot"].data_ptr(),
            out["copy_location"].data_ptr(), out["summary"].data_ptr(), workspace.data_ptr(),
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        assert rc == 0, f"resolver launch failed: cudaError {rc}"

    launch()
    torch.cuda.synchronize()
    out["launch"] = launch  # type: ignore[assignment]
    return out


def check_resolver(lib: ctypes.CDLL, g: torch.Generator) -> None:
    for trial in range(12):
        requests, n = (
            int(torch.randint(1, 9, (1,), generator=g)),
            int(torch.randint(1, 700, (1,), generator=g)),
        )
        page_rows, pages = (
            int(torch.randint(1, 65, (1,), generator=g)),
            int(torch.randint(1, 40, (1,), generator=g)),
        )
        slots = n + int(torch.randint(0, 300, (1,), generator=g))
        case = random_resolver_case(g, requests, n, pages, page_rows, slots)
        expected = resolve(*case, stamp=7, page_rows=page_rows)
        for dtype in (torch.int64, torch.int32):
            got = run_resolver(lib, case, 7, page_rows, dtype)
            for name in ("locations", "steps", "hot_pos", "hot_stamp"):
                assert torch.equal(got[name].cpu().long(), getattr(expected, name).long()), (
                    trial,
                    dtype,
                    name,
                )
            valid = got["copy_position"] >= 0
            assert torch.equal(got["copy_position"][valid].cpu().long(), expected.copy_position)
            assert torch.equal(got["copy_slot"][valid].cpu().long(), expected.copy_slot)
            assert torch.equal(got["copy_location"][valid].cpu().long(), expected.copy_location)
            assert torch.equal(got["summary"][:, 3:].cpu().long(), expected.counts)
    print("resolver kernel == dhisparse.kv.resolver.resolve on 12 random irregular cases (int32 and int64)")


def check_row_copy(lib: ctypes.CDLL, g: torch.Generator, quick: bool) -> None:
    host = torch.randint(0, 256, (20000, FP8_ROW_BYTES), dtype=torch.uint8, generator=g).pin_memory()
    arena = torch.zeros(30000, FP8_ROW_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for requests, per in ((3, 17), (50, 33), (128, 5)):
        src = torch.randint(0, host.shape[0], (requests, per), generator=g)
        src[torch.rand(requests, per, generator=g) < 0.2] = -1
        dst = torch.randperm(arena.shape[0], generator=g)[: requests * per].view(requests, per)
        src_d, dst_d = src.cuda(), dst.cuda()
        arena.zero_()
        rc = lib.dhs_cuda_row_copy(host.data_ptr(), arena.data_ptr(), FP8_ROW_BYTES, src_d.data_ptr(),
                                   dst_d.data_ptr(), requests, per, 8, stream)  # fmt: skip
        assert rc == 0
        torch.cuda.synchronize()
        keep = src >= 0
        assert torch.equal(arena[dst[keep].cuda()].cpu(), host[src[keep]])
    print("row copy == host[src] on irregular batches; bandwidth (656-byte rows, 100 misses per request):")
    for batch in [1, 2, 4, 8, 16, 32, 64, 128][: 4 if quick else None]:
        per = 100
        src = torch.randint(0, host.shape[0], (batch, per), generator=g).cuda()
        dst = torch.randperm(arena.shape[0], generator=g)[: batch * per].view(batch, per).cuda()
        args = (
            host.data_ptr(),
            arena.data_ptr(),
            FP8_ROW_BYTES,
            src.data_ptr(),
            dst.data_ptr(),
            batch,
            per,
            8,
            stream,
        )
        ms = _time_ms(lambda args=args: lib.dhs_cuda_row_copy(*args))
        blocks = min(32, max(4, -(-batch // 4)))
        print(
            f"  batch {batch:4d}: {blocks:2d} blocks, {ms * 1e3:8.1f} us, "
            f"{batch * per * FP8_ROW_BYTES / ms / 1e6:6.2f} GB/s"
        )


def check_sparse_mla(lib: ctypes.CDLL, g: torch.Generator, quick: bool) -> None:
    stream = torch.cuda.current_stream().cuda_stream

    def run(q_lat, q_pe, kv, locations, fmt: str, scale: float) -> tuple[torch.Tensor, object]:
        b, q, h, rank = q_lat.shape
        out = torch.empty_like(q_lat)

        def launch() -> None:
            rc = lib.dhs_cuda_sparse_mla(
                b, q, h, locations.shape[-1], rank, q_pe.shape[-1], KV_FORMATS[fmt], int(q_lat.dtype == torch.bfloat16),
                locations.element_size(), scale, q_lat.data_ptr(), q_pe.data_ptr(), kv.data_ptr(),
                locations.data_ptr(), out.data_ptr(), stream,
            )  # fmt: skip
            assert rc == 0, f"sparse MLA launch failed: cudaError {rc}"

        launch()
        torch.cuda.synchronize()
        return out, launch

    for fmt, qdtype, rank, rope in (("fp32", torch.float32, 96, 32), ("bf16", torch.bfloat16, 512, 64),
                                    ("fp8", torch.bfloat16, 512, 64), ("fp8", torch.float32, 512, 64)):  # fmt: skip
        b, q, h, k, rows = 3, 2, 7, 333, 5000
        values = torch.randn(rows, rank + rope, generator=g)
        if fmt == "fp8":
            kv, kv_ref = encode_fp8_rows(values), decode_fp8_rows(encode_fp8_rows(values))
        else:
            kv = values.to(qdtype)
            kv_ref = kv.float()
        q_lat = torch.randn(b, q, h, rank, generator=g).to(qdtype)
        q_pe = torch.randn(b, q, h, rope, generator=g).to(qdtype)
        locations = torch.randint(0, rows, (b, q, k), generator=g)
        locations[torch.rand(b, q, k, generator=g) < 0.15] = -1
        locations[0, 1] = -1  # a fully masked query -> zeros
        scale = (rank + rope) ** -0.5
        expected = sparse_mla_reference(q_lat, q_pe, kv_ref, locations, scale)
        for idx in (torch.int32, torch.int64):
            got, _ = run(q_lat.cuda(), q_pe.cuda(), kv.cuda(), locations.to(idx).cuda(), fmt, scale)
            tol = 2e-2 if qdtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)
    print("sparse MLA == sparse_mla_reference (fp32, bf16, fp8 rows; irregular B, Q, H, K; masked entries)")
    print(
        "sparse MLA decode time (H=16, K=2048, rank 512 + rope 64, Q=1) and resolver time (N=2048, B=4096):"
    )
    rows = 200000
    kv_by_fmt = {"bf16": torch.randn(rows, 576, device="cuda").to(torch.bfloat16),
                 "fp8": encode_fp8_rows(torch.randn(rows, 576)).cuda()}  # fmt: skip
    for batch in [1, 2, 4, 8, 16, 32, 64, 128][: 4 if quick else None]:
        q_lat = torch.randn(batch, 1, 16, 512, device="cuda").to(torch.bfloat16)
        q_pe = torch.randn(batch, 1, 16, 64, device="cuda").to(torch.bfloat16)
        loc = torch.randint(0, rows, (batch, 1, 2048), device="cuda", dtype=torch.int32)
        times = {fmt: _time_ms(run(q_lat, q_pe, kv, loc, fmt, 0.04)[1]) for fmt, kv in kv_by_fmt.items()}
        case = random_resolver_case(g, batch, 2048, 64, 64, 4096)
        resolver_ms = _time_ms(run_resolver(lib, case, 9, 64, torch.int32)["launch"])  # type: ignore[arg-type]
        print(f"  batch {batch:4d}: attention bf16 {times['bf16'] * 1e3:8.1f} us, fp8 {times['fp8'] * 1e3:8.1f} us;"
              f" resolver {resolver_ms * 1e3:8.1f} us")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="use the existing build/native")
    parser.add_argument("--quick", action="store_true", help="timings at batch 1..8 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; nothing was run (the kernels only compile here)")
        return 2
    if not args.no_build:
        subprocess.run([str(ROOT / "scripts" / "setup_native.sh")], check=True)
    print(
        f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    )
    lib = load_library()
    g = torch.Generator().manual_seed(0)
    check_resolver(lib, g)
    check_row_copy(lib, g, args.quick)
    check_sparse_mla(lib, g, args.quick)
    print("gpu_check: all kernels agree with their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
