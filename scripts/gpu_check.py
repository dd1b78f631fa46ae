"""One prepared end-to-end GPU check of the CUDA kernels in the request path (budget: < 8 minutes on one H200).

1. Builds the native tree with the project's CMake (``scripts/setup_native.sh``) unless ``--no-build``.
2. Kernels against the torch reference on random irregular inputs: the engine's start-up self-check over
   several seeds, the resolver with int32 indices (the TensorRT plugin's layout), attention over 656-byte FP8
   rows (``dhisparse.kernels.reference``).
3. Microbenchmarks (CUDA events, medians): host→device gather bandwidth for batch 1…128 (copy grid 4→32
   blocks), resolver and sparse MLA decode microseconds at GLM-5 sizes (N = 2048, B = 4096, H = 64, K = 2048).
4. The engine end to end on the GPU (``kernels="cuda"``) against the CPU run (``device="cpu"``), greedy tokens
   compared: the demo model for every KV policy without speculation and with both drafters; a synthetic
   GLM-5-shaped layer stack at real attention dimensions (random weights, a few layers, a 32K history) for
   every policy. The CPU run is made once per model and speculation setting (the CPU tokens of every policy
   are identical, tests/kv). Host synchronisations per step are counted with
   ``torch.cuda.set_sync_debug_mode`` (it sees tensor reads such as ``.item()`` / ``.cpu()`` / ``nonzero``,
   not ``Event.synchronize``).
5. The host store mapped into the device (``kv/mapped_host.py``): a pinned store of several chunks is gathered
   through its device view with a device-side index and compared with the CPU rows; a fetch through the copy
   engine is checked for zero host reads (``HostSync`` and torch's sync debug mode); the mapped gather is timed.
   The demo model then runs on the torch path (``kernels="torch"``, where every host fetch takes the mapped
   gather) for ``hisparse`` and ``adaptive`` with a small pool, tokens compared with the CPU run, and the KV
   side's counted host reads per decode step (``kv_host_syncs``) reported beside torch's count.
6. Writes ``gpu_check.json`` and ``gpu_check.md`` (``--out``, default ``docs/results/gpu_check``).

Without a GPU it prints "nothing was run: no GPU" and exits 0. Every part records its own failure and the
script goes on, so one run reports everything; the exit status is 1 if anything failed.

Usage: ``python scripts/gpu_check.py [--no-build] [--quick] [--out DIR] [--stack-history 32768] [--budget-s 420]``

``--bench-only`` instead runs the figures of issue 25 in at most 5 minutes, offline (``scripts/gpu_check_bench.py``,
``scripts/gpu_check_stack.py``; report schema in ``scripts/gpu_check_report.py``): ``python scripts/gpu_check.py
--bench-only [--commit SHA] [--budget-s 270] [--out DIR]``; ``--cpu-dry-run`` runs that code at tiny sizes on a CPU.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT / "engine_builder"))
sys.path.insert(0, str(ROOT / "scripts"))

BUDGET_S = 7 * 60  # leave a minute of the 8 for start-up and writing
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
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


# --------------------------------------------------------------------------------------------- kernels
def check_kernels(kernels: Any, dev: torch.device, seeds: int) -> dict[str, Any]:
    from dhisparse.kernels.reference import decode_fp8_rows, encode_fp8_rows, sparse_mla_reference
    from dhisparse.kernels.resolver import resolve
    from dhisparse.kernels.self_check import (
        compare_attention,
        compare_resolutions,
        failures,
        resolver_case,
        run_self_check,
    )

    out: dict[str, Any] = {}
    results = [r for seed in range(seeds) for r in run_self_check(kernels, dev, seed)]
    out["self_check_cases"] = len(results)
    out["self_check_failures"] = failures(results)
    g = torch.Generator().manual_seed(100)
    bad = []
    for trial in range(6):  # int32 indices: the TensorRT plugin's layout
        r, n = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 700, (1,), generator=g))
        pages, page_rows = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 65, (1,), generator=g))
        case = resolver_case(g, r, n, pages, page_rows, n + int(torch.randint(0, 300, (1,), generator=g)))
        want = resolve(*case, stamp=7, page_rows=page_rows)
        got = kernels.resolve(*(t.to(dev, torch.int32) for t in case), stamp=7, page_rows=page_rows)
        mismatch = compare_resolutions(got, want)
        if mismatch:
            bad.append(f"int32 trial {trial}: {mismatch}")
    out["resolver_int32_failures"] = "; ".join(bad) or None
    bad = []
    for qdtype in (torch.bfloat16, torch.float32):  # 656-byte FP8 rows
        b, q, h, k, rows = 3, 2, 7, 333, 5000
        values = torch.randn(rows, 576, generator=g)
        kv = encode_fp8_rows(values)
        q_lat = torch.randn(b, q, h, 512, generator=g).to(qdtype)
        q_pe = torch.randn(b, q, h, 64, generator=g).to(qdtype)
        loc = torch.randint(0, rows, (b, q, k), generator=g)
        loc[torch.rand(b, q, k, generator=g) < 0.15] = -1
        want = sparse_mla_reference(q_lat, q_pe, decode_fp8_rows(kv), loc, 576**-0.5)
        got = kernels.sparse_mla(q_lat.to(dev), q_pe.to(dev), kv.to(dev), loc.to(dev), 576**-0.5, kv_format=2)
        mismatch = compare_attention(got, want, 2e-2 if qdtype == torch.bfloat16 else 1e-4)
        if mismatch:
            bad.append(f"fp8 rows, q {qdtype}: {mismatch}")
    out["sparse_mla_fp8_failures"] = "; ".join(bad) or None
    return out


def bench_kernels(kernels: Any, dev: torch.device, batches: list[int]) -> list[dict[str, Any]]:
    from dhisparse.kernels import native
    from dhisparse.kernels.self_check import resolver_case

    g = torch.Generator().manual_seed(1)
    host = torch.randint(0, 256, (400_000, 656), dtype=torch.uint8, generator=g).pin_memory()
    arena = torch.zeros(200_000, 656, dtype=torch.uint8, device=dev)
    kv = torch.randn(200_000, 576, device=dev).to(torch.bfloat16)
    rows = []
    for batch in batches:
        per = 100  # misses per request and step
        src = torch.randint(0, host.shape[0], (batch, per), generator=g).to(dev)
        dst = torch.randperm(arena.shape[0], generator=g)[: batch * per].view(batch, per).to(dev)
        copy_ms = median_ms(lambda src=src, dst=dst: kernels.copy_rows(host, arena, src, dst))
        q_lat = torch.randn(batch, 1, 64, 512, device=dev).to(torch.bfloat16)
        q_pe = torch.randn(batch, 1, 64, 64, device=dev).to(torch.bfloat16)
        loc = torch.randint(0, kv.shape[0], (batch, 1, 2048), device=dev)
        attn_ms = median_ms(lambda q_lat=q_lat, q_pe=q_pe, loc=loc: kernels.sparse_mla(q_lat, q_pe, kv, loc, 0.04))
        case = [t.to(dev) for t in resolver_case(g, batch, 2048, 512, 64, 4096)]
        resolve_ms = median_ms(lambda case=case: kernels.resolve_padded(*case, 9, 64))
        rows.append({
            "batch": batch, "copy_blocks": native.copy_grid_blocks(batch) if native.available() else None,
            "copy_us": copy_ms * 1e3, "copy_gb_s": batch * per * 656 / copy_ms / 1e6,
            "resolver_us": resolve_ms * 1e3, "attention_bf16_us": attn_ms * 1e3,
        })
    return rows


# --------------------------------------------------------------------------------------------- mapped host store
def check_mapped_host(dev: torch.device) -> dict[str, Any]:
    """The host store's device view against the CPU rows, a fetch with no host read, and the gather's time."""
    from dhisparse.host_values import HostSync
    from dhisparse.kv.copies import CopyEngine
    from dhisparse.kv.host_store import ChunkedRows
    from dhisparse.kv.mapped_host import host_device_pointer

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    bad = []
    for dtype, row_dim in ((torch.bfloat16, 576), (torch.uint8, 656)):  # bf16 rows; FP8 rows (656 bytes)
        chunk_rows, rows = 1000, 4500  # five chunks, the last one short
        store = ChunkedRows(rows, chunk_rows, row_dim, dtype, pinned=True)
        store.ensure(rows)
        dense = torch.randint(0, 256, (rows, row_dim), generator=g).to(dtype)
        store.index_copy_(0, torch.arange(rows), dense)
        view = store.mapped(dev)
        if view is None:
            bad.append(f"{dtype}: no device view (a chunk's device pointer differs from its host pointer)")
            continue
        out["device_pointer_from"] = host_device_pointer(store.chunks[0].data_ptr())[1]
        edges = torch.tensor([r for k in range(1, 5) for r in (k * chunk_rows - 1, k * chunk_rows)])
        index = torch.cat([edges, torch.randint(0, rows, (5000,), generator=g)])
        if not torch.equal(view.gather(index.to(dev)).cpu(), dense[index]):
            bad.append(f"{dtype}: mapped gather differs from the CPU rows")
        sync = HostSync()
        copies = CopyEngine(dev, sync)
        arena = torch.zeros(index.numel(), row_dim, dtype=dtype, device=dev)
        src, dst = index.to(dev), torch.randperm(index.numel(), generator=g).to(dev)
        ticket, torch_syncs = _torch_syncs(functools.partial(copies.issue, "fetch", arena, dst, store, src), True)
        copies.wait(ticket)
        if not torch.equal(arena[dst].cpu(), dense[index]):
            bad.append(f"{dtype}: fetch through the copy engine differs")
        if sync.reads or torch_syncs or copies.mapped_copies != 1:
            bad.append(f"{dtype}: fetch read the host (HostSync {sync.reads}, torch {torch_syncs}, "
                       f"mapped copies {copies.mapped_copies})")
        if dtype == torch.uint8:
            timings = []
            for n in (100, 800, 6400):
                idx = torch.randint(0, rows, (n,), generator=g).to(dev)
                ms = median_ms(lambda idx=idx, view=view: view.gather(idx))
                timings.append({"rows": n, "us": ms * 1e3, "gb_s": n * row_dim / ms / 1e6})
            out["mapped_gather_656B"] = timings
    out["mapped_failures"] = "; ".join(bad) or None
    return out


def count_decode_reads(engine_dir: Path, prompts: list[list[int]], policy: str, pool_bytes: int, device: str = "cuda",
                       dtype: str = "float32") -> dict[str, Any]:
    """Host reads per decode step on the torch path (every host fetch from the mapped store), as
    tests/engine/test_host_syncs.py counts them on CPU: the KV side's ``HostSync`` count and torch's sync debug
    count of each step after the first (the first step admits and prefills)."""
    from dhisparse import LLM, SamplingParams

    llm = LLM(engine_dir, device=device, kernels="torch", kv_policy=policy, pool_bytes=pool_bytes, dtype=dtype)
    cuda = device == "cuda"
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    counted, torch_counted = [], []
    while engine.has_unfinished():
        before = engine.kv.sync.reads
        _, syncs = _torch_syncs(engine.step, cuda)
        counted.append(engine.kv.sync.reads - before)
        torch_counted.append(syncs)
    stats = llm.stats()
    return {"policy": policy, "batch": len(prompts), "dtype": dtype, "kv_reads_per_step": sorted(set(counted)),
            "torch_syncs_per_step": sorted(set(torch_counted)), "rows_host": stats.get("kv_rows_host"),
            "mapped_copies": engine.kv.copies.mapped_copies}


SYNC_SITES: collections.Counter[str] = collections.Counter()  # "file:line" of each counted synchronisation


def _torch_syncs(fn: Callable[[], Any], count: bool) -> tuple[Any, int]:
    """``(fn(), host synchronisations torch reported while it ran)``: with ``count``, under CUDA sync-debug mode
    "warn" (each synchronisation a warning, counted, its Python call site added to ``SYNC_SITES``); without, 0."""
    if not count:
        return fn(), 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    SYNC_SITES.update(f"{Path(w.filename).relative_to(ROOT) if w.filename.startswith(str(ROOT)) else w.filename}"
                      f":{w.lineno}" for w in syncs)
    return out, len(syncs)


# --------------------------------------------------------------------------------------------- engine
def run_engine(engine_dir: Path, prompts: list[list[int]], max_tokens: int, count_syncs: bool, **options: Any
               ) -> dict[str, Any]:
    from dhisparse import LLM, SamplingParams

    llm = LLM(engine_dir, **options)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs, syncs = _torch_syncs(lambda: llm.generate(prompts, params), count_syncs)
    stats = llm.stats()
    steps = stats.get("decode_steps", 0.0) + stats.get("verify_steps", 0.0)
    return {"tokens": [o.token_ids for o in outs], "seconds": time.perf_counter() - start,
            "kernels": "cuda" if stats.get("kv_kernels_cuda") else "torch", "steps": steps,
            "syncs_per_step": syncs / steps if steps else None, "rows_host": stats.get("kv_rows_host"),
            "kv_reads_per_step": stats.get("kv_host_syncs", 0.0) / steps if steps else None}


def compare_runs(name: str, engine_dir: Path, prompts: list[list[int]], max_tokens: int,
                 configs: list[dict[str, Any]], deadline: float, gpu_kernels: str = "cuda") -> list[dict[str, Any]]:
    rows = []
    cpu_runs: dict[object, dict[str, Any]] = {}  # CPU tokens are the same under every policy (tests/kv)
    for cfg in configs:
        label = {k: v for k, v in cfg.items() if k not in ("pool_bytes", "hot_rows", "page_rows")}
        if time.monotonic() > deadline:
            rows.append({"model": name, **label, "status": "skipped: time budget"})
            continue
        try:
            key = cfg.get("speculative")
            if key not in cpu_runs:
                cpu_runs[key] = run_engine(engine_dir, prompts, max_tokens, False, device="cpu", kernels="torch",
                                           **cfg)
            cpu = cpu_runs[key]
            gpu = run_engine(engine_dir, prompts, max_tokens, True, device="cuda", kernels=gpu_kernels, **cfg)
            same = cpu["tokens"] == gpu["tokens"]
            first = next((i for i, (a, b) in enumerate(zip(cpu["tokens"], gpu["tokens"], strict=True)) if a != b), None)
            rows.append({"model": name, **label, "status": "identical" if same else f"DIFFERENT (request {first})",
                         "gpu_kernels": gpu["kernels"], "gpu_s": gpu["seconds"], "cpu_s": cpu["seconds"],
                         "syncs_per_step": gpu["syncs_per_step"], "rows_host": gpu["rows_host"],
                         "kv_reads_per_step": gpu["kv_reads_per_step"]})
        except Exception as exc:
            rows.append({"model": name, **label, "status": f"ERROR {type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc(limit=6)})
        print(f"  {rows[-1]['model']} {label}: {rows[-1]['status']}", flush=True)
    return rows


def build_demo_engine(work: Path) -> Path:
    from dhisparse_builder import BuildOptions, build_engine

    models = ROOT / "models" / "demo"
    out = work / "demo-engine"
    build_engine(BuildOptions(models / "target", out, {"dtype": "float32"},
                              drafters=(models / "dflash2", models / "dspark")), progress=lambda d, t: None)
    return out


def build_glm5_stack(work: Path) -> Path:
    """GLM-5 attention at real dimensions (hidden 6144, 64 heads, MLA 512 + 64, q_lora 2048, indexer 32 x 128,
    top-k 2048), 3 layers (dense, then full / shared indexer), 4 routed experts and a vocabulary of 8192 so
    that the CPU reference of a 32K history fits the time budget. Random weights."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from dhisparse_builder import BuildOptions, build_engine

    cfg = GlmMoeDsaConfig(
        vocab_size=8192, hidden_size=6144, intermediate_size=4096, moe_intermediate_size=2048, num_hidden_layers=3,
        num_attention_heads=64, num_key_value_heads=64, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256,
        qk_nope_head_dim=192, index_head_dim=128, index_n_heads=32, index_topk=2048, index_topk_pattern="FSS",
        first_k_dense_replace=1, max_position_embeddings=40960, n_group=1, topk_group=1, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    ckpt = work / "glm5-stack-ckpt"
    GlmMoeDsaForCausalLM(cfg).save_pretrained(ckpt)
    out = work / "glm5-stack-engine"
    build_engine(BuildOptions(ckpt, out, {"dtype": "float32"}), progress=lambda d, t: None)
    return out


# --------------------------------------------------------------------------------------------- report
def write_report(out_dir: Path, report: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# GPU check — {report['device']}", "", f"Total {report['seconds']:.0f} s. Failures: "
             f"{report['failures'] or 'none'}. Skipped (time budget): {report.get('skipped') or 'none'}.", "",
             "## Kernels against the torch reference", ""]
    for key, value in report.get("kernels", {}).items():
        lines.append(f"- {key}: {value if value is not None else 'all equal'}")
    lines += ["", "## Microbenchmarks (medians of CUDA-event timings)", "",
              "| batch | copy blocks | gather copy µs | GB/s (656-byte rows, 100/request) "
              "| resolver µs (N 2048, B 4096) | sparse MLA bf16 µs (H 64, K 2048) |", "|---|---|---|---|---|---|"]
    for r in report.get("bench", []):
        lines.append(f"| {r['batch']} | {r['copy_blocks']} | {r['copy_us']:.1f} | {r['copy_gb_s']:.2f} | "
                     f"{r['resolver_us']:.1f} | {r['attention_bf16_us']:.1f} |")
    mapped = report.get("mapped_host", {})
    lines += ["", "## Host store mapped into the device (`kv/mapped_host.py`)", "",
              "- mapped gather and fetch vs the CPU rows, host reads: "
              f"{mapped.get('mapped_failures') or 'all equal, none'}",
              f"- device pointer from: {mapped.get('device_pointer_from', '–')}"]
    for t in mapped.get("mapped_gather_656B", []):
        lines.append(f"- gather of {t['rows']} rows of 656 bytes from host: {t['us']:.1f} µs ({t['gb_s']:.2f} GB/s)")
    for r in report.get("decode_reads", []):
        lines.append(f"- decode steps, {r['policy']} batch {r['batch']} {r.get('dtype')} (torch path): KV host reads "
                     f"per step {r['kv_reads_per_step']}, torch syncs per step {r['torch_syncs_per_step']}, host rows "
                     f"{r['rows_host']}, mapped copies {r['mapped_copies']}")
    lines += ["", "## Engine end to end: GPU tokens vs the CPU run", "",
              "| model | policy | speculative | tokens | GPU kernels | host syncs / step (torch) "
              "| KV host reads / step (all ÷ steps) | host rows | GPU s | CPU s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    def f(r: dict[str, Any], key: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(r[key]) if r.get(key) is not None else "–"

    for r in report.get("engine", []):
        lines.append(f"| {r['model']} | {r.get('kv_policy')} | {r.get('speculative') or '–'} | {r['status']} | "
                     f"{r.get('gpu_kernels', '–')} | {f(r, 'syncs_per_step')} | {f(r, 'kv_reads_per_step')} | "
                     f"{f(r, 'rows_host', '{:.0f}')} | "
                     f"{f(r, 'gpu_s')} | {f(r, 'cpu_s')} |")
    for key, title in (("engine_sync_sites", "the demo engine, CUDA kernels, every configuration"),
                       ("decode_sync_sites", "decode steps on the torch path"),):
        if report.get(key):
            lines += ["", f"Host synchronisations torch reported ({title}), by call site:", ""]
            lines += [f"- `{site}`: {n}" for site, n in report[key].items()]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="use the existing build/native")
    parser.add_argument("--no-bench", action="store_true", help="skip the microbenchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer seeds and batches, demo model only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "gpu_check")
    parser.add_argument("--stack-history", type=int, default=32768, help="history tokens of the GLM-5 stack")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds after start-up past which parts are skipped (default 420; 270 with --bench-only)")
    parser.add_argument("--bench-only", action="store_true",
                        help="issue 25's figures only (<= 5 min, offline): docs/results/gpu_check/<date>.json, .md")
    parser.add_argument("--cpu-dry-run", action="store_true", help="with --bench-only: tiny sizes on the CPU")
    parser.add_argument("--commit", help="commit id to record (default: git rev-parse HEAD, if git is there)")
    parser.add_argument("--jobs", type=int, default=16, help="build jobs (--bench-only)")
    args = parser.parse_args()
    if args.bench_only:
        import gpu_check_stack

        args.budget_s = 270.0 if args.budget_s is None else args.budget_s
        return gpu_check_stack.run(args)
    args.budget_s = BUDGET_S if args.budget_s is None else args.budget_s
    if not torch.cuda.is_available():
        print("nothing was run: no GPU (torch sees no CUDA device; the kernels only compile here)")
        return 0
    start = time.monotonic()
    deadline = start + args.budget_s
    if not args.no_build:
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_native.sh")], check=True)
    from dhisparse.kernels import abi
    from dhisparse.kernels.cuda_kernels import CudaKernels

    dev = torch.device("cuda")
    name = f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    print(f"device: {name}", flush=True)
    report: dict[str, Any] = {"device": name, "failures": []}
    lib = abi.cuda_library()
    if lib is None:
        print(f"gpu_check: {abi.cuda_library_path()} is not built", file=sys.stderr)
        return 1
    kernels = CudaKernels(lib, dev)
    parts = [("kernels", lambda: check_kernels(kernels, dev, 2 if args.quick else 6))]
    if not args.no_bench:
        parts.append(("bench", lambda: bench_kernels(kernels, dev, BATCHES[:4] if args.quick else BATCHES)))
    for part, fn in parts:
        try:
            report[part] = fn()
            print(f"{part}: {json.dumps(report[part], default=str)[:2000]}", flush=True)
        except Exception as exc:
            report["failures"].append(f"{part}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    for key in ("self_check_failures", "resolver_int32_failures", "sparse_mla_fp8_failures"):
        if report.get("kernels", {}).get(key):
            report["failures"].append(f"{key}: {report['kernels'][key]}")
    try:
        SYNC_SITES.clear()
        report["mapped_host"] = check_mapped_host(dev)
        report["mapped_host"]["sync_sites"] = dict(SYNC_SITES)
        print(f"mapped_host: {json.dumps(report['mapped_host'], default=str)[:2000]}", flush=True)
        if report["mapped_host"]["mapped_failures"]:
            report["failures"].append(f"mapped_host: {report['mapped_host']['mapped_failures']}")
    except Exception as exc:
        report["failures"].append(f"mapped_host: {type(exc).__name__}: {exc}")
        traceback.print_exc()

    report["engine"] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            demo = build_demo_engine(work)
            g = torch.Generator().manual_seed(5)
            prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 517, 1029, 64)]
            configs = [{"kv_policy": p, "speculative": s, "pool_bytes": 8_000_000}
                       for p in ("resident", "hisparse", "adaptive") for s in (None, "dflash2", "dspark")]
            SYNC_SITES.clear()
            report["engine"] += compare_runs("demo", demo, prompts, 24, configs, deadline)
            report["engine_sync_sites"] = dict(SYNC_SITES.most_common())
            print(f"demo engine sync sites (all configurations): {report['engine_sync_sites']}", flush=True)
            # The torch path: every host fetch gathers from the mapped host store.
            mapped = [{"kv_policy": p, "speculative": None, "pool_bytes": 2_000_000}
                      for p in ("hisparse", "adaptive")]
            report["engine"] += compare_runs("demo (torch, mapped host)", demo, prompts, 24, mapped, deadline,
                                             gpu_kernels="torch")
            # A 2 MB pool admits all four prompts and leaves adaptive short of device pages (it fetches too).
            SYNC_SITES.clear()
            try:
                # float32 (the CPU comparison's dtype) and bfloat16 (torch._grouped_mm's CUDA kernel is for
                # bfloat16; other dtypes take its per-group fallback, which reads the group offsets on the host).
                report["decode_reads"] = [
                    count_decode_reads(demo, prompts[:n], p, 2_000_000, dtype=d)
                    for p, n, d in (("hisparse", 1, "float32"), ("hisparse", 4, "float32"),
                                    ("adaptive", 4, "float32"), ("hisparse", 4, "bfloat16"))]
                report["decode_sync_sites"] = dict(SYNC_SITES.most_common())
                print(f"decode_reads: {report['decode_reads']}\ndecode sync sites: {report['decode_sync_sites']}",
                      flush=True)
                # One host read per decode step: the KV side's, counted by HostSync and by torch alike (torch's
                # count in bfloat16 only: float32 grouped matmuls take torch's fallback, which reads the group
                # offsets on the host, 3 per MoE layer; measured 10 per step on the demo model).
                report["failures"] += [f"decode reads {r}" for r in report["decode_reads"]
                                       if r["kv_reads_per_step"] != [1] or not r["mapped_copies"]
                                       or (r["dtype"] == "bfloat16" and r["torch_syncs_per_step"] != [1])]
            except Exception as exc:
                report["failures"].append(f"decode reads: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            report["seconds"] = time.monotonic() - start
            write_report(args.out, report)  # a partial report, in case the GLM-5 stack outruns the caller's limit
            if not args.quick and time.monotonic() > deadline:
                report["engine"].append({"model": "glm5-stack", "status": "skipped: time budget"})
            elif not args.quick:
                stack = build_glm5_stack(work)
                g = torch.Generator().manual_seed(6)
                prompts = [torch.randint(0, 8192, (args.stack_history,), generator=g).tolist(),
                           torch.randint(0, 8192, (args.stack_history // 3,), generator=g).tolist()]
                configs = [{"kv_policy": p, "pool_bytes": 4 << 30, "hot_rows": 4096, "page_rows": 64}
                           for p in ("resident", "hisparse", "adaptive")]
                report["engine"] += compare_runs("glm5-stack", stack, prompts, 8, configs, deadline)
        except Exception as exc:
            report["failures"].append(f"engine: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    report["failures"] += [f"{r['model']} {r.get('kv_policy')} {r.get('speculative')}: {r['status']}"
                           for r in report["engine"] if r["status"] != "identical"
                           and not r["status"].startswith("skipped")]
    report["skipped"] = [f"{r['model']} {r.get('kv_policy')} {r.get('speculative')}" for r in report["engine"]
                         if r["status"].startswith("skipped")]
    report["seconds"] = time.monotonic() - start
    write_report(args.out, report)
    print(f"gpu_check: wrote {args.out}/gpu_check.json and .md in {report['seconds']:.0f} s; "
          f"{len(report['failures'])} failure(s)")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
