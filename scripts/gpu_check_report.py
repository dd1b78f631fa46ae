"""The report of ``scripts/gpu_check.py --bench-only``: its JSON schema, the goals of issue 25 judged from the
measured figures, and the Markdown rendering (pure functions; tested on CPU).

Required top-level keys (``REQUIRED_KEYS``; ``dhisparse-plan --measured FILE`` reads them):

- ``commit`` (str): the commit measured (``--commit``, else ``git rev-parse HEAD``, else ``"unknown"``).
- ``h2d_pinned_gbps`` (float): a plain pinned→device copy of 256 MiB (``Tensor.copy_``), GB/s.
- ``gather_gbps``: ``{row_bytes: {batch: {rows_per_request: {"gather": GB/s, "plain": GB/s, "ratio": float}}}}``
  (keys are strings): the row-copy kernel reading random rows of a chunked pinned host store (mapped view) against a
  plain pinned→device copy of the same bytes, measured in the same run.
- ``resolver_us``: ``{batch: µs}`` — one step-resolver launch (N 2048, B 4096, one source, 10 % of the non-direct
  selections missing).
- ``sparse_mla_us`` / ``sparse_mla_floor_us``: ``{dtype: {heads: {batch: µs}}}`` — sparse MLA decode (top-k 2048,
  one query) and its HBM floor: the bytes the kernel must move (each selected row once, queries, outputs) over the
  device-to-device copy bandwidth measured in the same run.
- ``decode_host_syncs_bf16`` (float | null): host synchronisations per decode step of the demo engine in bfloat16
  with the CUDA kernels (torch's sync-debug count).
- ``graph_adaptive_vs_resident``: ``{batch: float}`` — resident step time ÷ adaptive step time, both replayed from
  CUDA graphs (``details.graph_scope`` says what the step is).
- ``glm5_stack``: ``{"layers_run", "shape", "pool_per_layer_bytes", "runs": [{"policy", "batch", "history",
  "queries", "layer_step_ms", "host_share", "staged_share", "resident_share"}]}``.

Other keys: ``device``, ``date``, ``seconds``, ``goals`` (``{goal: {"pass": bool | None, "why": str}}``; ``None``:
not measured), ``failures``, ``skipped`` and ``details`` (correctness checks, configurations, set-up rates).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("commit", "h2d_pinned_gbps", "gather_gbps", "resolver_us", "sparse_mla_us", "sparse_mla_floor_us",
                 "decode_host_syncs_bf16", "graph_adaptive_vs_resident", "glm5_stack")

# The goals (issue 25, "What must exist").
MLA_FLOOR_FACTOR = 2.0  # sparse MLA at batch 128 within 2x its HBM floor, 64 and 128 heads
RESOLVER_US = 30.0  # one launch at batch 128 x top-k 2048 x B 4096
GATHER_RATIO = 0.8  # host gather at >= 80 % of a plain pinned->device copy
GRAPH_RATIO = 0.9  # adaptive step >= 0.9x the resident step at batch 1 and 8


def empty_report(commit: str, device: str) -> dict[str, Any]:
    report: dict[str, Any] = dict.fromkeys(REQUIRED_KEYS)
    report.update(commit=commit, device=device, failures=[], skipped=[], details={}, goals={})
    return report


def _verdict(ok: bool | None, why: str) -> dict[str, Any]:
    return {"pass": ok, "why": why}


def judge(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pass / fail per goal from the measured figures (``None`` where a figure is missing)."""
    goals: dict[str, dict[str, Any]] = {}
    mla, floor = report.get("sparse_mla_us") or {}, report.get("sparse_mla_floor_us") or {}
    worst = [(dtype, heads, mla[dtype][heads]["128"] / floor[dtype][heads]["128"])
             for dtype in mla for heads in mla[dtype] if "128" in mla[dtype][heads]
             and floor.get(dtype, {}).get(heads, {}).get("128")]
    if worst:
        bad = [f"{d} H{h}: {r:.2f}x" for d, h, r in worst if r > MLA_FLOOR_FACTOR]
        goals["sparse_mla_within_2x_floor"] = _verdict(
            not bad and {h for _, h, _ in worst} >= {"64", "128"},
            "batch 128: " + ", ".join(f"{d} H{h} {r:.2f}x floor" for d, h, r in worst))
    else:
        goals["sparse_mla_within_2x_floor"] = _verdict(None, "not measured")
    resolver = (report.get("resolver_us") or {}).get("128")
    goals["resolver_30us"] = _verdict(None if resolver is None else resolver <= RESOLVER_US,
                                      "not measured" if resolver is None else f"{resolver:.1f} us at batch 128")
    correct = report["details"].get("resolver_equal_to_cpu_library")
    goals["resolver_equal_to_cpu_library"] = _verdict(correct, "traces at miss rates 0/10/50 %, 1 and 26 sources"
                                                      if correct is not None else "not run")
    ratios = [(rb, b, n, v["ratio"]) for rb, by_b in (report.get("gather_gbps") or {}).items()
              for b, by_n in by_b.items() for n, v in by_n.items()]
    if ratios:
        low = min(ratios, key=lambda x: x[3])
        goals["gather_80pct_of_plain_copy"] = _verdict(
            all(r >= GATHER_RATIO for *_, r in ratios),
            f"lowest {low[3]:.2f}x ({low[0]}-byte rows, batch {low[1]}, {low[2]} rows/request)")
    else:
        goals["gather_80pct_of_plain_copy"] = _verdict(None, "not measured")
    graphs = report.get("graph_adaptive_vs_resident") or {}
    exact = report["details"].get("graph_replay_exact")
    if graphs:
        goals["graph_adaptive_90pct_of_resident"] = _verdict(
            all(graphs.get(b, 0.0) >= GRAPH_RATIO for b in ("1", "8")) and bool(exact),
            ", ".join(f"batch {b}: {r:.2f}x" for b, r in graphs.items())
            + f"; replay == eager: {exact}; scope: {report['details'].get('graph_scope', '?')}")
    else:
        goals["graph_adaptive_90pct_of_resident"] = _verdict(None, "not measured")
    syncs = report.get("decode_host_syncs_bf16")
    goals["decode_constant_host_syncs"] = _verdict(None if syncs is None else syncs <= 1.0 + 1e-9,
                                                   "not measured" if syncs is None else f"{syncs:.2f} per step")
    stack = report.get("glm5_stack") or {}
    runs = stack.get("runs") or []
    goals["glm5_stack_measured"] = _verdict(
        bool(runs) and not any(r.get("error") for r in runs) if runs else None,
        f"{len(runs)} configurations" if runs else "not measured")
    auto = report["details"].get("device_auto")
    goals["device_auto_is_cuda"] = _verdict(None if auto is None else auto == "cuda", f"device='auto' -> {auto}")
    return goals


def write(out_dir: Path, stem: str, report: dict[str, Any]) -> tuple[Path, Path]:
    """``<stem>.json`` and ``<stem>.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = [k for k in REQUIRED_KEYS if k not in report]
    if missing:
        raise ValueError(f"report lacks {missing}")
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check (bench only) — {report.get('device')}", "",
             f"Commit `{report.get('commit')}`, {report.get('date', '')}, {_num(report.get('seconds'), '{:.0f}')} s.",
             "", "## Goals", "", "| goal | pass | measured |", "|---|---|---|"]
    for goal, v in report.get("goals", {}).items():
        mark = {True: "PASS", False: "FAIL", None: "not measured"}[v["pass"]]
        lines.append(f"| {goal} | {mark} | {v['why']} |")
    lines += ["", f"Plain pinned→device copy: {_num(report.get('h2d_pinned_gbps'), '{:.1f}')} GB/s.", "",
              "## Host gather vs plain copy (same bytes, same run)", "",
              "| row bytes | batch | rows/request | gather GB/s | plain GB/s | ratio |", "|---|---|---|---|---|---|"]
    for rb, by_b in (report.get("gather_gbps") or {}).items():
        for b, by_n in by_b.items():
            for n, v in by_n.items():
                lines.append(f"| {rb} | {b} | {n} | {v['gather']:.1f} | {v['plain']:.1f} | {v['ratio']:.2f} |")
    lines += ["", "## Resolver (one launch, N 2048, B 4096)", "", "| batch | µs |", "|---|---|"]
    lines += [f"| {b} | {us:.1f} |" for b, us in (report.get("resolver_us") or {}).items()]
    lines += ["", "## Sparse MLA decode (top-k 2048) against its HBM floor", "",
              "| dtype | heads | batch | µs | floor µs | × floor |", "|---|---|---|---|---|---|"]
    floor = report.get("sparse_mla_floor_us") or {}
    for dtype, by_h in (report.get("sparse_mla_us") or {}).items():
        for heads, by_b in by_h.items():
            for b, us in by_b.items():
                f = floor.get(dtype, {}).get(heads, {}).get(b)
                ratio = _num(us / f if f else None, "{:.2f}")
                lines.append(f"| {dtype} | {heads} | {b} | {us:.1f} | {_num(f)} | {ratio} |")
    graphs = report.get("graph_adaptive_vs_resident") or {}
    lines += ["", "## CUDA graphs", "", f"Scope: {report['details'].get('graph_scope', '–')}.", ""]
    lines += [f"- batch {b}: resident ÷ adaptive step time {r:.2f}" for b, r in graphs.items()]
    lines += ["", f"Decode host synchronisations per step (bf16, CUDA kernels): "
              f"{_num(report.get('decode_host_syncs_bf16'), '{:.2f}')}", ""]
    stack = report.get("glm5_stack") or {}
    lines += ["## GLM-5-shaped layer stack (per-layer step)", "",
              f"{stack.get('layers_run', '–')} layers run; pool per layer {stack.get('pool_per_layer_bytes', '–')} "
              "bytes.", "", "| policy | batch | history | queries | layer step ms | host share | staged share "
              "| resident share |", "|---|---|---|---|---|---|---|---|"]
    for r in stack.get("runs") or []:
        lines.append(f"| {r['policy']} | {r['batch']} | {r['history']} | {r['queries']} | "
                     f"{_num(r.get('layer_step_ms'), '{:.3f}')} | {_num(r.get('host_share'), '{:.4f}')} | "
                     f"{_num(r.get('staged_share'), '{:.4f}')} | {_num(r.get('resident_share'), '{:.3f}')} |"
                     + (f" {r['error']}" if r.get("error") else ""))
    lines += ["", "## Failures and skips", ""]
    lines += [f"- failure: {f}" for f in report.get("failures", [])] or ["- no failure"]
    lines += [f"- skipped: {s}" for s in report.get("skipped", [])]
    lines += ["", "## Details", "", "```json", json.dumps(report.get("details", {}), indent=1, default=str)[:6000],
              "```", ""]
    return "\n".join(lines)
