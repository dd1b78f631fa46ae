"""The GLM-5-shaped layer stack of ``scripts/gpu_check.py --bench-only`` (per-layer step time and host share per
policy; the layer step replayed from CUDA graphs) and the run that puts every part together (:func:`run`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import gpu_check_bench as bench
import gpu_check_report as report_lib
import torch

from dhisparse.device import resolve_device
from dhisparse.kernels.layer_step import (
    POLICIES,
    LayerShape,
    LayerStack,
    StackCase,
    history_rows_needed,
    random_rows,
    scratch_rows_needed,
)

SOURCES = 2  # layers run: a full-indexer layer and the layer that shares its selection
DRAFTER_QUERIES = 4  # γ = 3


def resident_share(shape: LayerShape, batch: int, history: int) -> float:
    """The adaptive policy's share of history pages on the device: a per-layer pool (the device's KV budget over the
    model's layers) less the required hot caches, over the per-layer history."""
    pool = bench.DEVICE_KV_BYTES / bench.MODEL_LAYERS
    required = batch * shape.hot_rows * shape.row_bytes
    return max(0.0, min(1.0, (pool - required) / (batch * history * shape.row_bytes)))


class StackArena:
    """The history (device) and its copy in a chunked pinned host store, sized for the largest case, made once."""

    def __init__(self, env: bench.Env, shape: LayerShape, store: Any, view: Any) -> None:
        s = env.sizes
        self.rows = history_rows_needed(shape, max(s.stack_batches), max(s.stack_histories), SOURCES)
        scratch = scratch_rows_needed(shape, max(s.stack_batches), DRAFTER_QUERIES, SOURCES)
        self.arena = torch.empty(self.rows + scratch, shape.row_width, dtype=shape.row_dtype, device=env.device)
        step = 1 << 20
        for i in range(0, self.rows, step):  # random rows, a slice at a time (a whole history at once is too big)
            n = min(step, self.rows - i)
            self.arena[i: i + n] = random_rows(n, shape, env.device)
        done = 0
        for chunk in store.chunks:  # the host store: a byte copy of the history
            n = min(chunk.shape[0], self.rows - done)
            if n <= 0:
                break
            chunk[:n].copy_(self.arena[done: done + n].view(chunk.dtype).view(n, -1), non_blocking=True)
            done += n
        if env.cuda:
            torch.cuda.synchronize()
        self.view = view

    def stack(self, shape: LayerShape, case: StackCase, kernels: Any, device: torch.device) -> LayerStack:
        """A layer stack over this arena and host store (its mapped span, rows translated when it has chunks)."""
        rows = self.view.span_rows if self.view.allocated_rows > self.view.chunk_rows else None
        return LayerStack(shape, case, kernels, self.arena, self.rows, self.view.span, device, rows)


def stack_runs(env: bench.Env, shape: LayerShape, arena: StackArena, report: dict[str, Any]) -> None:
    """``glm5_stack``: every policy at every batch, history and drafter setting; per-layer step (median) and shares."""
    s = env.sizes
    runs: list[dict[str, Any]] = []
    report["glm5_stack"] = {"layers_run": SOURCES, "shape": shape.__dict__ | {"row_bytes": shape.row_bytes},
                            "pool_per_layer_bytes": bench.DEVICE_KV_BYTES / bench.MODEL_LAYERS,
                            "steps_measured": 5, "runs": runs}
    for batch in s.stack_batches:
        for history in s.stack_histories:
            for queries in (1, DRAFTER_QUERIES):
                for policy in POLICIES:
                    row: dict[str, Any] = {"policy": policy, "batch": batch, "history": history, "queries": queries}
                    runs.append(row)
                    if env.left() < 25:
                        row["error"] = "skipped: time budget"
                        continue
                    share = resident_share(shape, batch, history) if policy == "adaptive" else float(
                        policy == "resident")
                    row["resident_share"] = share
                    try:
                        case = StackCase(policy, batch=batch, history=history, queries=queries, sources=SOURCES,
                                         resident_share=share)
                        stack = arena.stack(shape, case, env.kernels, env.device)
                        for _ in range(2):
                            stack.step()
                        stack.counts.zero_()
                        stack.staged.zero_()
                        step_us = env.time_us(stack.step, repeats=5)
                        row["layer_step_ms"] = step_us / 1e3 / SOURCES
                        row["host_share"] = stack.host_share()
                        total = float(stack.counts.sum())
                        row["staged_share"] = float(stack.staged.sum()) / total if total else 0.0
                        if int(stack.flags[0]):
                            row["error"] = f"step flags {int(stack.flags[0])}"
                        del stack
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                    if env.cuda:
                        torch.cuda.empty_cache()
                    print(f"  glm5 stack {row}", flush=True)


def graph_runs(env: bench.Env, shape: LayerShape, arena: StackArena, report: dict[str, Any]) -> None:
    """``graph_adaptive_vs_resident``: the layer step (indexer, resolution, fetch, attention of both layers) of the
    resident and the adaptive policy captured in a CUDA graph and replayed, at each graph batch; resident step time ÷
    adaptive step time. Replay equals eager: a second stack with the same seed steps eagerly and must give the same
    outputs after the same number of steps. (On a CPU the steps run eagerly: no graph, no ratio that means much.)"""
    s = env.sizes
    report["details"]["graph_scope"] = ("GLM-5-shaped layer step (indexer top-k, one step-resolver launch, row "
                                        "copies, sparse MLA of 2 layers), history "
                                        f"{s.graph_history}; the engine's decode step is not captured yet")
    exact = True
    for batch in s.graph_batches:
        times = {}
        for policy in ("resident", "adaptive"):
            share = resident_share(shape, batch, s.graph_history) if policy == "adaptive" else 1.0
            case = StackCase(policy, batch=batch, history=s.graph_history, sources=SOURCES, resident_share=share,
                             seed=11)
            graphed = arena.stack(shape, case, env.kernels, env.device)
            eager = arena.stack(shape, case, env.kernels, env.device)
            for stack in (graphed, eager):
                for _ in range(2):
                    stack.step()
            if env.cuda:
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    outputs = graphed.step()
                replay = graph.replay
            else:
                outputs = graphed.step()

                def replay(outputs: list[torch.Tensor] = outputs, graphed: LayerStack = graphed) -> None:
                    outputs[:] = graphed.step()

                eager.step()  # the CPU "capture" ran one step
            for _ in range(3):
                replay()
                want = eager.step()
            if env.cuda:
                torch.cuda.synchronize()
            exact &= all(torch.equal(a, b) for a, b in zip(outputs, want, strict=True))
            times[policy] = env.time_us(replay)
        report["graph_adaptive_vs_resident"][str(batch)] = times["resident"] / times["adaptive"]
        report["details"].setdefault("graph_step_us", {})[str(batch)] = times
    report["details"]["graph_replay_exact"] = exact


def run(args: argparse.Namespace) -> int:
    """The whole bench-only run (see ``gpu_check_bench``'s docstring); returns the exit status."""
    start = time.monotonic()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check --bench-only: nothing was run: no GPU (torch sees no CUDA device). On a GPU machine this "
              "builds the CUDA library offline and writes docs/results/gpu_check/<date>.json and .md.")
        return 0
    device = torch.device("cpu") if dry else torch.device("cuda")
    name = "CPU dry run (tiny sizes; timings mean nothing)" if dry else (
        f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    report = report_lib.empty_report(bench.commit_id(args.commit), name)
    report.update(date=bench.date_stem(), h2d_pinned_gbps=None, gather_gbps={}, resolver_us={}, sparse_mla_us={},
                  sparse_mla_floor_us={}, graph_adaptive_vs_resident={}, glm5_stack={})
    report["details"]["tree_sha256"] = bench.tree_digest()
    report["details"]["device_auto"] = resolve_device("auto").type
    if not dry and not args.no_build:
        report["details"]["build_seconds"] = bench.build(args.jobs)
    kernels = _kernels(device, dry)
    report["details"]["attention_kernel"] = getattr(kernels, "attention", kernels.name)
    env = bench.Env(device, kernels, bench.TINY if dry else bench.REAL, start + args.budget_s)
    shape = LayerShape(**env.sizes.layer)
    parts: dict[str, Any] = {}
    hbm = {"gbps": 0.0}

    def stores() -> None:
        for key, row_dim, dtype in (("656", 656, torch.uint8), ("1152", shape.row_width, shape.row_dtype)):
            need = history_rows_needed(shape, max(env.sizes.stack_batches), max(env.sizes.stack_histories), SOURCES)
            store, view, rate = bench.host_store(env, row_dim, dtype, need if key == "1152" else 0)
            parts[key] = (store, view)
            report["details"].setdefault("host_store_setup_gbps", {})[key] = rate
            report["details"].setdefault("host_store_bytes", {})[key] = store.nbytes
            report["details"].setdefault("host_store_chunks", {})[key] = len(store.chunks)

    steps = [
        ("correctness: resolver traces", lambda: report["details"].update(bench.check_resolver(env)), 10),
        ("correctness: kernels", lambda: report["details"].update(bench.check_kernels(env)), 20),
        ("hbm bandwidth", lambda: hbm.update(gbps=bench.hbm_gbps(env)), 5),
        ("host stores", stores, 30),
        ("plain h2d", lambda: report.update(h2d_pinned_gbps=bench.plain_h2d(env, parts["656"][0])), 5),
        ("gather 656", lambda: bench.gather(env, *parts["656"], report), 10),
        ("gather 1152", lambda: bench.gather(env, *parts["1152"], report), 10),
        ("resolver", lambda: bench.resolver_times(env, report), 15),
        ("sparse MLA", lambda: bench.sparse_mla_times(env, hbm["gbps"], report), 40),
        ("stack arena", lambda: parts.update(arena=StackArena(env, shape, *parts["1152"])), 20),
        ("glm5 stack", lambda: stack_runs(env, shape, parts["arena"], report), 30),
        ("graphs", lambda: graph_runs(env, shape, parts["arena"], report), 20),
        ("decode host syncs",
         lambda: report.update(decode_host_syncs_bf16=bench.decode_syncs(env, report["details"])), 25),
    ]
    for part, fn, need in steps:
        bench.run_part(report, part, fn, env, need)
    report["details"]["hbm_copy_gbps"] = hbm["gbps"]
    for key in ("self_check_failures", "sparse_mla_fp8_mismatch"):
        if report["details"].get(key):
            report["failures"].append(f"{key}: {report['details'][key]}")
    if report["details"].get("resolver_equal_to_cpu_library") is False:
        report["failures"].append(f"resolver traces: {report['details'].get('resolver_mismatches')}")
    report["seconds"] = time.monotonic() - start
    report["goals"] = report_lib.judge(report)
    for key in ("656", "1152"):
        if key in parts:
            parts[key][0].close()
    json_path, md_path = report_lib.write(args.out, report["date"] if not dry else "dry-run", report)
    print(f"gpu_check --bench-only: wrote {json_path} and {md_path} in {report['seconds']:.0f} s; "
          f"{len(report['failures'])} failure(s), goals: "
          + ", ".join(f"{g}={v['pass']}" for g, v in report["goals"].items()))
    return 1 if report["failures"] else 0


def _kernels(device: torch.device, dry: bool) -> Any:
    if dry:
        from dhisparse.kernels.emulated import EmulatedKernels

        return EmulatedKernels()
    from dhisparse.kernels import abi
    from dhisparse.kernels.cuda_kernels import CudaKernels

    lib = abi.cuda_library()
    if lib is None:
        raise RuntimeError(f"{abi.cuda_library_path()} is not built (or has another ABI)")
    return CudaKernels(lib, device)
