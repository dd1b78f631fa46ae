"""Planner runs over a grid, their table (Markdown + CSV), PNG plots and the recommended configuration.

A *configuration* is ``policy[+drafter]`` (``resident``, ``hisparse``, ``adaptive``, ``adaptive+dflash2``,
``resident+dspark`` ...) at one concurrency and one locality ``overlap``. Every row of the table is one
:func:`dhisparse_planner.simulate` run. Throughput is reported per GPU: the simulated instance is the model's
``gpus`` GPUs (TP) decoding one batch, so ``output_tok_per_s_per_gpu = output_tok_per_s / gpus``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dhisparse.kv.policies import KV_POLICIES, policy_named
from dhisparse_planner.admission import TokenBudget
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import AHEAD_WALL_S, SimResult, simulate
from dhisparse_planner.specs import HardwareSpec, ModelSpec
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import ServingSpec, WorkloadSpec

COLUMNS = ("label", "concurrency", "overlap", "output_tok_per_s_per_gpu", "decode_tok_per_s", "mean_ttft_s",
           "mean_tpot_s", "host_share", "hot_share", "direct_share", "host_overlap", "mean_batch", "max_batch",
           "admissions_waited", "waited_for_device", "waited_for_host", "waited_for_budget", "reclaim_events",
           "requests_done", "makespan_s", "wall_s")


@dataclass(frozen=True)
class PlanGrid:
    """What to simulate: every ``config x concurrency x overlap`` (real units).

    Attributes:
        configs: ``policy[+drafter]`` labels.
        concurrencies: closed-loop client counts.
        overlaps: locality overlaps (fractions).
        input_tokens / output_tokens: per request.
        requests_per_client: requests per run = ``concurrency x requests_per_client``.
        base_serving: knobs shared by every config (policy and speculation are replaced per config).
        speculation: the drafter model used by ``+drafter`` configs (its ``drafter`` is replaced by the label's).
        admission: ``(policy, rule)`` pairs: the admission rule a policy's baseline follows (see
            :func:`parse_config`).
        scale: the scale model.
        seed: RNG seed of every run.
    """

    configs: tuple[str, ...]
    concurrencies: tuple[int, ...]
    overlaps: tuple[float, ...]
    input_tokens: int
    output_tokens: int
    requests_per_client: int = 1
    base_serving: ServingSpec = ServingSpec()
    speculation: SpeculationModel = SpeculationModel()
    admission: tuple[tuple[str, TokenBudget], ...] = ()
    scale: ScaleSpec = ScaleSpec(token_scale=64)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.configs or not self.concurrencies or not self.overlaps:
            raise ValueError("configs, concurrencies and overlaps must not be empty")
        if min(self.concurrencies) < 1 or self.requests_per_client < 1:
            raise ValueError("concurrencies and requests_per_client must be >= 1")
        for label in self.configs:
            parse_config(label, self.base_serving, self.speculation, self.admission)


def parse_config(label: str, base: ServingSpec, speculation: SpeculationModel,
                 admission: tuple[tuple[str, TokenBudget], ...] = ()) -> ServingSpec:
    """``policy[+drafter]`` -> a :class:`ServingSpec` (ValueError on an unknown policy or drafter). ``B`` is the
    same with and without a drafter: the rows of a verification step's union of selections that the hot cache
    cannot take go to verification staging. ``admission`` pairs a policy with the admission rule of the system a
    baseline of that policy stands for (the paper's HiSparse is SGLang's: :mod:`dhisparse_planner.admission`)."""
    policy, _, drafter = label.partition("+")
    spec = speculation.with_drafter(drafter) if drafter else None
    rule = dict(admission).get(policy, base.admission)
    return dataclasses.replace(base, policy=policy, speculation=spec, admission=rule)


def uses_locality(serving: ServingSpec) -> bool:
    """A policy without the host store never fetches from it, so its result does not depend on the locality."""
    return serving.uses_host


def label_uses_host(label: str) -> bool:
    """Whether the policy of ``policy[+drafter]`` uses the host store (and so depends on the locality model)."""
    return policy_named(label.partition("+")[0], "config label", KV_POLICIES).uses_host


def decode_tok_per_s(result: SimResult) -> float:
    """Steady decode throughput of the instance: tokens produced by decode steps over decode time (tok/s)."""
    decode_s = sum(p.step_s for p in result.timeline)
    done = sum(1 for r in result.requests if r.finish_s is not None)
    return (result.output_tokens - done) / decode_s if decode_s > 0 else 0.0


def run_one(hw: HardwareSpec, model: ModelSpec, serving: ServingSpec, workload: WorkloadSpec,
            scale: ScaleSpec) -> tuple[dict[str, float | str], SimResult]:
    """One simulation -> (table row, result). Rows carry the label, concurrency, overlap and wall time (s)."""
    start = time.perf_counter()
    result = simulate(hw, model, serving, workload, scale)
    row = result_row(result, serving.label, workload.concurrency, serving.locality.overlap, model.attn_tp)
    row["wall_s"] = AHEAD_WALL_S.get(id(result), time.perf_counter() - start)
    return row, result


def result_row(result: SimResult, label: str, concurrency: int, overlap: float, gpus: int) -> dict[str, float | str]:
    """The table row of one result. ``output_tok_per_s_per_gpu``, ``mean_ttft_s`` and ``mean_tpot_s`` are the
    closed loop's steady state (:mod:`dhisparse_planner.metrics`; the whole run's with one request per client), the
    whole run's are kept as ``run_*``; ``decode_tok_per_s`` is the decode steps' throughput (prefill excluded)."""
    s = result.summary()
    row: dict[str, float | str] = {"label": label, "concurrency": concurrency, "overlap": overlap}
    row.update(s)
    row["run_output_tok_per_s_per_gpu"] = s["output_tok_per_s"] / gpus
    row["run_mean_ttft_s"], row["run_mean_tpot_s"] = s["mean_ttft_s"], s["mean_tpot_s"]
    row["output_tok_per_s_per_gpu"] = s["steady_output_tok_per_s"] / gpus
    row["mean_ttft_s"], row["mean_tpot_s"] = s["steady_mean_ttft_s"], s["steady_mean_tpot_s"]
    row["decode_tok_per_s"] = decode_tok_per_s(result)
    row["decode_tok_per_s_per_gpu"] = row["decode_tok_per_s"] / gpus
    return row


def grid_points(grid: PlanGrid, model: ModelSpec) -> Iterator[tuple[str, int, float, ServingSpec, WorkloadSpec, bool]]:
    """Every grid point in table order: ``(label, concurrency, overlap, serving, workload, new)``; ``new`` is False
    where the point's run is the previous one's (``resident`` does not depend on the overlap)."""
    for label in grid.configs:
        base = parse_config(label, grid.base_serving, grid.speculation, grid.admission)
        for c in grid.concurrencies:
            workload = WorkloadSpec(grid.input_tokens, grid.output_tokens, concurrency=c,
                                    num_requests=c * grid.requests_per_client, seed=grid.seed)
            for i, overlap in enumerate(grid.overlaps):
                serving = dataclasses.replace(base, locality=dataclasses.replace(base.locality, overlap=overlap))
                yield label, c, overlap, serving, workload, i == 0 or uses_locality(serving)


def run_grid(hw: HardwareSpec, model: ModelSpec, grid: PlanGrid,
             log: bool = False) -> tuple[list[dict[str, float | str]], dict[tuple[str, int, float], SimResult]]:
    """Every grid point; ``resident`` configs run once (overlap-independent) and are reported for each overlap."""
    rows: list[dict[str, float | str]] = []
    results: dict[tuple[str, int, float], SimResult] = {}
    cached: tuple[dict[str, float | str], SimResult] | None = None
    for label, c, overlap, serving, workload, new in grid_points(grid, model):
        if cached is None or new:
            cached = run_one(hw, model, serving, workload, grid.scale)
        row = dict(cached[0], overlap=overlap)
        rows.append(row)
        results[(label, c, overlap)] = cached[1]
        if log:
            print(f"  {label:>18} C{c:<4} overlap {overlap:.2f}: {row['output_tok_per_s_per_gpu']:8.1f} "
                  f"tok/s/GPU, TPOT {1e3 * float(row['mean_tpot_s']):6.1f} ms, "
                  f"host {100 * float(row['host_share']):5.1f}% ({float(row['wall_s']):.1f} s)", flush=True)
    return rows, results


def recommend(rows: Iterable[dict[str, float | str]], tpot_bound_s: float) -> dict[str, float | str] | None:
    """The (config, concurrency) with the highest per-GPU output whose mean TPOT is within ``tpot_bound_s`` (s);
    None if none is. With several overlaps each point counts with its *worst* overlap (lowest output, highest
    TPOT), so a recommendation never rests on favourable locality alone."""
    worst: dict[tuple[str, float], dict[str, float | str]] = {}
    for row in rows:
        key = (str(row["label"]), float(row["concurrency"]))
        prev = worst.get(key)
        if prev is None:
            worst[key] = dict(row)
            continue
        prev["output_tok_per_s_per_gpu"] = min(float(prev["output_tok_per_s_per_gpu"]),
                                               float(row["output_tok_per_s_per_gpu"]))
        prev["mean_tpot_s"] = max(float(prev["mean_tpot_s"]), float(row["mean_tpot_s"]))
        prev["host_share"] = max(float(prev["host_share"]), float(row["host_share"]))
        prev["overlap"] = "worst"
    ok = [r for r in worst.values() if not math.isnan(float(r["mean_tpot_s"]))
          and float(r["mean_tpot_s"]) <= tpot_bound_s and float(r["requests_done"]) > 0]
    return max(ok, key=lambda r: float(r["output_tok_per_s_per_gpu"]), default=None)


def _fmt(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def markdown_table(rows: Sequence[dict[str, float | str]], columns: Sequence[str] = COLUMNS) -> str:
    """A Markdown table of ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: Sequence[dict[str, float | str]], path: Path, columns: Sequence[str] = COLUMNS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_fmt(r.get(c, "")) for c in columns])


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grid(rows: Sequence[dict[str, float | str]], out_dir: Path, prefix: str = "") -> list[Path]:
    """Per-GPU output, mean TTFT, mean TPOT and host-fetched share against concurrency, one line per
    config and overlap (PNG files in ``out_dir``)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = (("output_tok_per_s_per_gpu", "output tokens/s per GPU", 1.0),
               ("mean_ttft_s", "mean TTFT (s)", 1.0), ("mean_tpot_s", "mean TPOT (ms)", 1e3),
               ("host_share", "host-fetched share of selected rows (%)", 100.0))
    keys = sorted({(str(r["label"]), float(r["overlap"])) for r in rows})
    paths = []
    for metric, title, mult in metrics:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for label, overlap in keys:
            pts = sorted((float(r["concurrency"]), float(r[metric]) * mult) for r in rows
                         if r["label"] == label and float(r["overlap"]) == overlap)
            host = label_uses_host(label)
            if not host and overlap != keys[0][1] and len({k[1] for k in keys}) > 1:
                continue  # identical for every overlap
            name = label if not host else f"{label} (overlap {overlap:g})"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / f"{prefix}{metric}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_memory(results: dict[str, SimResult], path: Path) -> Path:
    """Memory split over time (required / optional / reserve, GiB) and batch, one panel per run."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(results), 1, figsize=(6.4, 2.2 * len(results)), squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items(), strict=True):
        t = [p.time_s for p in res.timeline]
        gib = 2.0**30
        ax.stackplot(t, [p.required_bytes / gib for p in res.timeline], [p.optional_bytes / gib for p in res.timeline],
                     [p.reserve_bytes / gib for p in res.timeline], labels=["required", "optional", "reserve"])
        if res.timeline:
            ax.axhline(res.timeline[0].pool_bytes / gib, color="k", lw=0.8, ls="--", label="pool")
        ax2 = ax.twinx()
        ax2.plot(t, [p.batch for p in res.timeline], color="tab:red", lw=0.8, label="batch")
        ax2.set_ylabel("batch", fontsize=7)
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("GiB", fontsize=7)
        ax.legend(fontsize=6, loc="upper left")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
