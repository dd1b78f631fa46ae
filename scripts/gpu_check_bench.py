"""``scripts/gpu_check.py --bench-only``: every figure of issue 25 in one run of at most 5 minutes on one GPU.

Offline: builds the CUDA library from the tree (CMake + nvcc, only the device's architecture, no TensorRT), then
- correctness gates: the step-resolver kernel against the Python specification and the CPU library's results on
  random traces (miss rates 0 / 10 / 50 %, 1 and 26 sources, verification staging), the start-up self-check, the
  sparse MLA kernel on FP8 rows;
- a chunked pinned host store (>= 8 GB in 1 GiB chunks, set up by parallel first touch + cudaHostRegister, timed);
  the row-copy gather from it (656- and 1152-byte rows, batch 1 / 32 / 128, 205 and 2048 rows per request) against a
  plain pinned→device copy of the same bytes;
- the step resolver's time by batch (N 2048, B 4096); sparse MLA decode by batch, heads and row format against its
  HBM floor (the device-to-device copy bandwidth measured in the same run);
- decode host synchronisations per step (demo engine, bfloat16, CUDA kernels);
- the GLM-5-shaped layer stack (``dhisparse.kernels.layer_step``) per policy, batch 32 / 128, 32K / 100K history,
  with and without a drafter; the layer step of resident and adaptive captured in CUDA graphs at batch 1 and 8;
and writes ``docs/results/gpu_check/<date>.json`` / ``.md`` (schema: ``scripts/gpu_check_report.py``).

``--cpu-dry-run`` runs the same code at tiny sizes on the CPU (the step resolver's block code through the CPU
library, torch attention, no pinning, no graphs, no timing that means anything) so that the script itself is tested
where no GPU exists.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "backend", ROOT / "engine_builder", ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

GIB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    store_bytes: int  # each chunked host store holds at least this
    chunk_bytes: int
    gather_batches: tuple[int, ...]
    gather_rows: tuple[int, ...]
    resolver_batches: tuple[int, ...]
    topk: int
    hot_rows: int
    mla_batches: tuple[int, ...]
    mla_heads: tuple[int, ...]
    stack_batches: tuple[int, ...]
    stack_histories: tuple[int, ...]
    graph_batches: tuple[int, ...]
    graph_history: int
    repeats: int
    layer: dict[str, Any]  # LayerShape fields


REAL = Sizes(store_bytes=8 * GIB + GIB // 2, chunk_bytes=GIB, gather_batches=(1, 32, 128), gather_rows=(205, 2048),
             resolver_batches=(1, 8, 32, 64, 128), topk=2048, hot_rows=4096, mla_batches=(1, 8, 32, 128),
             mla_heads=(64, 128), stack_batches=(32, 128), stack_histories=(32768, 102400), graph_batches=(1, 8),
             graph_history=32768, repeats=20, layer={})
TINY = Sizes(store_bytes=3 << 20, chunk_bytes=1 << 20, gather_batches=(1, 3), gather_rows=(5, 17),
             resolver_batches=(1, 3), topk=24, hot_rows=64, mla_batches=(1, 3), mla_heads=(4,),
             stack_batches=(2,), stack_histories=(64,), graph_batches=(1,), graph_history=64, repeats=2,
             layer={"heads": 4, "index_heads": 4, "index_dim": 16, "topk": 16, "page_rows": 8, "hot_rows": 32})
DEVICE_KV_BYTES = 60e9  # an H200's KV budget next to GLM-5's weights (TP8), spread over the model's layers …
MODEL_LAYERS = 78  # … of which the stack runs a few: the adaptive pool scaled to the layers run


class Env:
    """Device, kernels, sizes and the time budget of one run."""

    def __init__(self, device: torch.device, kernels: Any, sizes: Sizes, deadline: float) -> None:
        self.device, self.kernels, self.sizes, self.deadline = device, kernels, sizes, deadline
        self.cuda = device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def time_us(self, fn: Callable[[], object], repeats: int | None = None,
                setup: Callable[[], object] | None = None) -> float:
        """Median time of ``fn`` in µs (CUDA events on a GPU), ``setup`` run untimed before each repeat."""
        repeats = repeats or self.sizes.repeats
        if setup is not None:
            setup()
        fn()  # warm-up (compiles, caches)
        times = []
        for _ in range(repeats):
            if setup is not None:
                setup()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[len(times) // 2]


# ------------------------------------------------------------------------------------------------ build and identity
def commit_id(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: pass --commit)"


def tree_digest() -> str:
    """sha256 over the sources the run builds and imports (ties a report to a tree when there is no git)."""
    h = hashlib.sha256()
    for folder in ("plugins", "backend/dhisparse", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".h", ".cu", ".cpp", ".cuh", ".txt", ".cmake"):
                h.update(str(path.relative_to(ROOT)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def build(jobs: int) -> float:
    """CMake build of the CPU library and the CUDA library for this device's architecture only (no TensorRT, no
    network); returns seconds."""
    major, minor = torch.cuda.get_device_capability()
    build_dir = ROOT / "build" / "native"
    generator = ["-G", "Ninja"] if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists() else []
    start = time.monotonic()
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
                    "-DDHS_WARNINGS_AS_ERRORS=ON", "-DDHS_ENABLE_TENSORRT=OFF",
                    f"-DCMAKE_CUDA_ARCHITECTURES={major}{minor}", f"-DPython3_EXECUTABLE={sys.executable}"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", "dhisparse_cpu",
                    "dhisparse_cuda"], check=True)
    return time.monotonic() - start


# ------------------------------------------------------------------------------------------------ correctness
def check_resolver(env: Env) -> dict[str, Any]:
    """The step-resolver kernel against the specification (and through it the CPU library, which equals it: tests)."""
    from dhisparse.kernels.resolver_traces import expected_step, mismatch, step_outputs, step_trace

    bad = []
    cases = [(m, s, g, 0) for m in (0.0, 0.1, 0.5) for s, g in ((1, 1), (30, 26))] + [(0.5, 4, 2, 120)]
    for i, (miss, sources, groups, staging) in enumerate(cases):
        t = step_trace(40 + i, batch=5, sources=sources, groups=groups, queries=3 if staging else 2, topk=150,
                       hot_rows=100 if staging else 400, miss_rate=miss, page_rows=16, staging_rows=staging)
        want = expected_step(t)
        dev = t.to(env.device)
        out = step_outputs(dev)
        stamp = torch.tensor([t.stamp], device=env.device)
        env.kernels.resolve_step(stamp, dev.positions, dev.lengths, dev.sources, dev.slots, dev.page_table,
                                 dev.hot_pos, dev.hot_stamp, dev.hot_loc, dev.host_pages, dev.staging,
                                 t.page_rows, out)
        problem = mismatch(out, dev, want)
        if problem:
            bad.append(f"miss {miss} S {sources} G {groups} staging {staging}: {problem}")
    return {"resolver_equal_to_cpu_library": not bad, "resolver_mismatches": bad}


def check_kernels(env: Env) -> dict[str, Any]:
    """The start-up self-check (resolver, row copy, attention) and attention over 656-byte FP8 rows."""
    from dhisparse.kernels.reference import decode_fp8_rows, encode_fp8_rows, sparse_mla_reference
    from dhisparse.kernels.self_check import compare_attention, failures, run_self_check

    out: dict[str, Any] = {"self_check_failures": failures([r for seed in range(2)
                                                              for r in run_self_check(env.kernels, env.device, seed)])}
    g = torch.Generator().manual_seed(3)
    kv = encode_fp8_rows(torch.randn(3000, 576, generator=g))
    q_lat, q_pe = torch.randn(3, 2, 7, 512, generator=g).bfloat16(), torch.randn(3, 2, 7, 64, generator=g).bfloat16()
    loc = torch.stack([torch.randperm(3000, generator=g)[:333] for _ in range(6)]).view(3, 2, 333)
    loc[torch.rand(3, 2, 333, generator=g) < 0.15] = -1
    want = sparse_mla_reference(q_lat, q_pe, decode_fp8_rows(kv), loc, 576**-0.5)
    got = env.kernels.sparse_mla(q_lat.to(env.device), q_pe.to(env.device), kv.to(env.device), loc.to(env.device),
                                 576**-0.5, kv_format=2)
    out["sparse_mla_fp8_mismatch"] = compare_attention(got, want, 2e-2)
    return out


# ------------------------------------------------------------------------------------------------ host store, gather
def host_store(env: Env, row_dim: int, dtype: torch.dtype, min_rows: int = 0) -> tuple[Any, Any, float]:
    """A chunked host store of >= ``store_bytes`` (and >= ``min_rows``), preallocated (pinned on a GPU); its mapped
    view and its set-up rate in GB/s."""
    from dhisparse.kv.host_store import ChunkedRows

    row_bytes = row_dim * torch.empty(0, dtype=dtype).element_size()
    rows = max(-(-env.sizes.store_bytes // row_bytes), min_rows)
    store = ChunkedRows(rows, max(1, env.sizes.chunk_bytes // row_bytes), row_dim, dtype, pinned=env.cuda)
    start = time.monotonic()
    store.preallocate(workers=os.cpu_count())
    seconds = time.monotonic() - start
    view = store.mapped(env.device)
    if view is None:
        raise RuntimeError("the host store has no device view (chunk device pointers differ from host pointers)")
    return store, view, store.nbytes / seconds / 1e9


def gather(env: Env, store: Any, view: Any, report: dict[str, Any]) -> None:
    """``gather_gbps`` for the store's row size: kernel gather of random rows vs a plain copy of the same bytes."""
    row_dim, dtype = store.row_dim, store.dtype
    row_bytes = row_dim * store.chunks[0].element_size()
    s = env.sizes
    arena_rows = max(s.gather_batches) * max(s.gather_rows)
    arena = torch.zeros(arena_rows, row_dim, dtype=dtype, device=env.device)
    flat_dst = arena.view(-1)
    g = torch.Generator().manual_seed(row_bytes)
    contiguous = store.chunks[0].view(-1)
    results: dict[str, Any] = {}
    for batch in s.gather_batches:
        for per in s.gather_rows:
            n = batch * per
            src = torch.randint(0, store.allocated_rows, (batch, per), generator=g).to(env.device)
            src = view.span_rows(src) if store.allocated_rows > store.chunk_rows else src
            dst = torch.randperm(arena_rows, generator=g)[:n].view(batch, per).to(env.device)
            us = env.time_us(lambda src=src, dst=dst: env.kernels.copy_rows(view.span, arena, src, dst))
            values = n * row_dim
            plain = env.time_us(lambda values=values: flat_dst[:values].copy_(contiguous[:values], non_blocking=True))
            gather_gbps, plain_gbps = n * row_bytes / us / 1e3, n * row_bytes / plain / 1e3
            results.setdefault(str(batch), {})[str(per)] = {"gather": gather_gbps, "plain": plain_gbps,
                                                            "ratio": gather_gbps / plain_gbps}
    if env.cuda:  # exactness of the kernel's reads across chunks
        index = torch.randint(0, store.allocated_rows, (1, 4096), generator=g)
        src = view.span_rows(index.to(env.device)) if store.allocated_rows > store.chunk_rows else index.to(env.device)
        dst = torch.arange(4096, device=env.device).view(1, -1)
        env.kernels.copy_rows(view.span, arena, src, dst)
        torch.cuda.synchronize()
        if not torch.equal(arena[:4096].cpu(), store.index_select(0, index.view(-1))):
            report["failures"].append(f"gather of {row_bytes}-byte rows differs from the host rows")
    report["gather_gbps"][str(row_bytes)] = results


def plain_h2d(env: Env, store: Any) -> float:
    src = store.chunks[0].view(-1)
    n = min(src.numel(), (256 << 20) // src.element_size())
    dst = torch.empty(n, dtype=src.dtype, device=env.device)
    return n * src.element_size() / env.time_us(lambda: dst.copy_(src[:n], non_blocking=True)) / 1e3


def hbm_gbps(env: Env) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s) of 512 MiB."""
    n = (512 << 20) if env.cuda else (8 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=env.device)
    y = torch.empty_like(x)
    return 2 * n / env.time_us(lambda: y.copy_(x)) / 1e3


# ------------------------------------------------------------------------------------------------ resolver, attention
def resolver_times(env: Env, report: dict[str, Any]) -> None:
    """``resolver_us`` by batch: one step-resolver launch (one source, N = top-k, B = hot rows, 10 % misses), the hot
    state restored before each timed launch; at the largest batch also 50 % misses, and its result checked."""
    from dhisparse.kernels.resolver_traces import expected_step, mismatch, step_outputs, step_trace

    s = env.sizes
    for batch in s.resolver_batches:
        for miss in ((0.1, 0.5) if batch == max(s.resolver_batches) else (0.1,)):
            t = step_trace(batch, batch=batch, sources=1, groups=1, queries=1, topk=s.topk, hot_rows=s.hot_rows,
                           miss_rate=miss, page_rows=64 if env.cuda else 8, history=8 * s.topk)
            want = expected_step(t.clone()) if miss == 0.1 and batch == max(s.resolver_batches) else None
            dev = t.clone().to(env.device)
            out = step_outputs(dev)
            stamp = torch.tensor([t.stamp], device=env.device)
            hot_pos, hot_stamp = dev.hot_pos.clone(), dev.hot_stamp.clone()

            def restore(dev: Any = dev, hot_pos: torch.Tensor = hot_pos, hot_stamp: torch.Tensor = hot_stamp,
                        out: dict[str, torch.Tensor] = out) -> None:
                dev.hot_pos.copy_(hot_pos)
                dev.hot_stamp.copy_(hot_stamp)
                out["counts"].zero_()

            def launch(dev: Any = dev, out: dict[str, torch.Tensor] = out, stamp: torch.Tensor = stamp,
                       page_rows: int = t.page_rows) -> None:
                env.kernels.resolve_step(stamp, dev.positions, dev.lengths, dev.sources, dev.slots, dev.page_table,
                                         dev.hot_pos, dev.hot_stamp, dev.hot_loc, dev.host_pages, None, page_rows,
                                         out)

            us = env.time_us(launch, setup=restore)
            if miss == 0.1:
                report["resolver_us"][str(batch)] = us
            else:
                report["details"][f"resolver_us_batch{batch}_miss50"] = us
            if want is not None:
                restore()
                out["flags"].zero_()
                launch()
                problem = mismatch(out, dev, want)
                report["details"]["resolver_real_size_equal"] = problem is None
                if problem:
                    report["failures"].append(f"step resolver at batch {batch}: {problem}")


def random_kv(env: Env, rows: int, fp8: bool) -> torch.Tensor:
    from dhisparse.kernels.layer_step import LayerShape, random_rows

    chunks = [random_rows(min(1 << 20, rows - i), LayerShape(fp8=fp8), env.device) for i in range(0, rows, 1 << 20)]
    return torch.cat(chunks)


def sparse_mla_times(env: Env, hbm: float, report: dict[str, Any]) -> None:
    """``sparse_mla_us`` / ``sparse_mla_floor_us`` by dtype, heads and batch (top-k 2048, one query): the floor moves
    each selected row once plus the queries, outputs and locations, at the measured device copy bandwidth."""
    from dhisparse.kernels import triton_mla

    s = env.sizes
    rank, rope = 512, 64
    rows = max(s.mla_batches) * s.topk * 2
    g = torch.Generator().manual_seed(5)
    base = torch.randperm(rows, generator=g)[: s.topk]
    for dtype, fp8 in (("bf16", False), ("fp8", True)):
        kv = random_kv(env, rows, fp8)
        row_bytes = kv.shape[1] * kv.element_size()
        for heads in s.mla_heads:
            for batch in s.mla_batches:
                if env.left() < 20:
                    report["skipped"].append(f"sparse MLA {dtype} H{heads} batch {batch}: time budget")
                    continue
                loc = ((base[None, :] + torch.arange(batch)[:, None] * s.topk) % rows).view(batch, 1, s.topk)
                loc = loc.to(env.device)
                q_lat = torch.randn(batch, 1, heads, rank, device=env.device).bfloat16()
                q_pe = torch.randn(batch, 1, heads, rope, device=env.device).bfloat16()
                us = env.time_us(lambda q_lat=q_lat, q_pe=q_pe, loc=loc, kv=kv, fp8=fp8: env.kernels.sparse_mla(
                    q_lat, q_pe, kv, loc, 576**-0.5, kv_format=2 if fp8 else None))
                moved = batch * s.topk * (row_bytes + 8) + batch * heads * (rank + rope + rank) * 2
                report["sparse_mla_us"].setdefault(dtype, {}).setdefault(str(heads), {})[str(batch)] = us
                report["sparse_mla_floor_us"].setdefault(dtype, {}).setdefault(str(heads), {})[str(batch)] = (
                    moved / hbm / 1e3)
                if batch == 1 and triton_mla.available() and getattr(env.kernels, "attention", "") == "triton":
                    config = triton_mla.MlaConfig()
                    m_tiles = -(-heads // min(config.block_m, heads))
                    report["details"].setdefault("mla_batch1_programs", {})[f"{dtype} H{heads}"] = (
                        m_tiles * triton_mla.choose_splits(config, 1, m_tiles, s.topk))
        del kv
    if env.cuda and getattr(env.kernels, "attention", "") == "triton" and env.left() > 60:
        sweep_configs(env, report, rows)


def sweep_configs(env: Env, report: dict[str, Any], rows: int) -> None:
    """A few Triton configurations at batch 128, 64 heads, bf16 (which one the default should be), and the CUDA C++
    kernel the TensorRT plugin shares, for comparison."""
    from dhisparse.kernels import abi, triton_mla

    s = env.sizes
    batch, heads = max(s.mla_batches), 64
    kv = random_kv(env, rows, False)
    loc = torch.randint(0, rows, (batch, 1, s.topk), device=env.device)
    q_lat = torch.randn(batch, 1, heads, 512, device=env.device).bfloat16()
    q_pe = torch.randn(batch, 1, heads, 64, device=env.device).bfloat16()
    out = {}
    for bm, bn, warps, splits in ((64, 32, 8, 0), (64, 64, 8, 0), (32, 32, 4, 0), (64, 32, 8, 1)):
        if env.left() < 30:
            break
        config = triton_mla.MlaConfig(block_m=bm, block_n=bn, num_warps=warps, splits=splits)
        try:
            out[f"m{bm} n{bn} w{warps} s{splits}"] = env.time_us(
                lambda config=config: triton_mla.sparse_mla(q_lat, q_pe, kv, loc, 0.04, config=config))
        except Exception as exc:  # a configuration the compiler refuses (shared memory): recorded, not fatal
            out[f"m{bm} n{bn} w{warps} s{splits}"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    lib = abi.cuda_library()
    if lib is not None and env.left() > 30:
        from dhisparse.kernels.cuda_kernels import CudaKernels

        cxx = CudaKernels(lib, env.device, attention="cuda")
        out["cuda_cxx_kernel"] = env.time_us(lambda: cxx.sparse_mla(q_lat, q_pe, kv, loc, 0.04), repeats=5)
    report["details"]["mla_configs_batch128_h64_bf16_us"] = out


# ------------------------------------------------------------------------------------------------ engine syncs
def decode_syncs(env: Env, details: dict[str, Any]) -> float | None:
    """Host synchronisations per decode step of the demo engine in bfloat16 with the CUDA kernels (adaptive, a pool
    small enough that rows come from host), counted by torch's sync-debug mode over the steps after admission; and
    what in one such step would break a CUDA-graph capture (``step_graphs``' recorder: operators, host reads). On a
    CPU (the dry run) the engine runs there, the recorder too, and no synchronisation is counted (None)."""
    from dhisparse import LLM, SamplingParams
    from dhisparse.engine.step_graphs import DEVICE_TO_HOST, HOST_READS, _Recorder
    from dhisparse_builder import BuildOptions, build_engine

    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "demo"
        build_engine(BuildOptions(ROOT / "models" / "demo" / "target", engine_dir, {"dtype": "bfloat16"}),
                     progress=lambda d, t: None)
        llm = LLM(engine_dir, device=env.device.type, kernels="cuda" if env.cuda else "auto", kv_policy="adaptive",
                  pool_bytes=2_000_000, dtype="bfloat16")
        g = torch.Generator().manual_seed(5)
        for n in (300, 517, 1029, 64):
            llm.engine.add_request(torch.randint(0, 256, (n,), generator=g).tolist(),
                                   SamplingParams(max_tokens=12, ignore_eos=True))
        llm.engine.step()
        recorder = _Recorder()
        with recorder:
            llm.engine.step()
        details["decode_step_ops"] = len(recorder.ops)
        details["decode_step_capture_breakers"] = sorted({name for name, _ in recorder.ops if name in HOST_READS
                                                          or name.startswith(DEVICE_TO_HOST)})
        if not env.cuda:
            return None
        counts = []
        while llm.engine.has_unfinished():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    llm.engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        return sum(counts) / len(counts) if counts else None


def run_part(report: dict[str, Any], name: str, fn: Callable[[], object], env: Env, need_s: float) -> None:
    """Run one part, recording its failure (and going on) or skipping it when the budget is spent."""
    if env.left() < need_s:
        report["skipped"].append(f"{name}: time budget ({env.left():.0f} s left)")
        return
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        report["failures"].append(f"{name}: {type(exc).__name__}: {exc}")
        report["details"].setdefault("tracebacks", {})[name] = traceback.format_exc(limit=8)
    report["details"].setdefault("part_seconds", {})[name] = round(time.monotonic() - start, 1)
    print(f"gpu_check --bench-only: {name} done ({time.monotonic() - start:.1f} s, {env.left():.0f} s left)",
          flush=True)


def date_stem() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
