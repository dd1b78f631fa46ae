"""`dhisparse-bench` results: one row per (KV policy, concurrency), ratios to a baseline, table, CSV, plot.

Ratios compare each policy with the baseline policy measured in the same run at the same concurrency
(these machines are noisy: absolute numbers from different runs are not comparable). Every ratio is
policy / baseline: above 1 is better for throughput, below 1 is better for TTFT and ITL.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dhisparse_client.perf import LevelResult, median_result


@dataclass(frozen=True)
class BenchRow:
    """One measured level, with the residency statistics the server reported over it.

    Attributes:
        host_share: rows fetched from host / rows resolved, over this level (NaN without resolver work).
        admissions_waited, reclaim_events: increments over this level.
        ratios: metric -> policy / baseline at the same concurrency (filled by `add_ratios`).
        genai_perf: genai-perf's figures at the same level (`run_genai_perf` keys), when it was run.
    """

    policy: str
    result: LevelResult
    host_share: float = math.nan
    admissions_waited: float = math.nan
    reclaim_events: float = math.nan
    ratios: Mapping[str, float] = field(default_factory=dict)
    genai_perf: Mapping[str, float] = field(default_factory=dict)


RATIO_METRICS = ("token_throughput", "ttft_ms", "itl_ms")


def residency_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Residency statistics over an interval, from two `/metrics` snapshots (`DHiSparseClient.metrics`)."""
    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0) if name in after else math.nan

    resolved = delta("kv_resolved_rows")
    return {"host_share": delta("kv_rows_host") / resolved if resolved and resolved > 0 else math.nan,
            "admissions_waited": delta("kv_admissions_waited"), "reclaim_events": delta("kv_reclaim_events")}


def combine_repeats(rows: Sequence[BenchRow]) -> BenchRow:
    """One row from repeated measurements of one (policy, concurrency): medians of every figure."""
    def median(values: list[float]) -> float:
        finite = [v for v in values if not math.isnan(v)]
        return statistics.median(finite) if finite else math.nan

    return BenchRow(rows[0].policy, median_result([r.result for r in rows]),
                    median([r.host_share for r in rows]), median([r.admissions_waited for r in rows]),
                    median([r.reclaim_events for r in rows]),
                    genai_perf=next((r.genai_perf for r in rows if r.genai_perf), {}))


def add_ratios(rows: Sequence[BenchRow], baseline: str) -> list[BenchRow]:
    """Rows with `ratios` filled against the baseline policy's row at the same concurrency (if measured)."""
    base = {row.result.concurrency: row.result for row in rows if row.policy == baseline}
    out = []
    for row in rows:
        reference = base.get(row.result.concurrency)
        ratios = {}
        if reference is not None:
            for metric in RATIO_METRICS:
                denominator = getattr(reference, metric)
                ratios[metric] = getattr(row.result, metric) / denominator if denominator else math.nan
        out.append(BenchRow(row.policy, row.result, row.host_share, row.admissions_waited, row.reclaim_events,
                            ratios, row.genai_perf))
    return out


COLUMNS = (  # header, value getter, format
    ("policy", lambda r: r.policy, "{}"),
    ("conc", lambda r: r.result.concurrency, "{}"),
    ("reqs", lambda r: r.result.requests, "{}"),
    ("req/s", lambda r: r.result.request_throughput, "{:.2f}"),
    ("tok/s", lambda r: r.result.token_throughput, "{:.1f}"),
    ("TTFT ms", lambda r: r.result.ttft_ms, "{:.0f}"),
    ("TTFT p90", lambda r: r.result.ttft_p90_ms, "{:.0f}"),
    ("ITL ms", lambda r: r.result.itl_ms, "{:.1f}"),
    ("p50 lat ms", lambda r: r.result.latency_p50_ms, "{:.0f}"),
    ("host %", lambda r: 100 * r.host_share, "{:.1f}"),
    ("waited", lambda r: r.admissions_waited, "{:.0f}"),
    ("reclaims", lambda r: r.reclaim_events, "{:.0f}"),
    ("tok/s x", lambda r: r.ratios.get("token_throughput", math.nan), "{:.2f}"),
    ("TTFT x", lambda r: r.ratios.get("ttft_ms", math.nan), "{:.2f}"),
    ("ITL x", lambda r: r.ratios.get("itl_ms", math.nan), "{:.2f}"),
)
GENAI_PERF_COLUMNS = (  # shown when genai-perf ran
    ("gp tok/s", lambda r: r.genai_perf.get("gp_token_throughput", math.nan), "{:.1f}"),
    ("gp TTFT", lambda r: r.genai_perf.get("gp_ttft_ms", math.nan), "{:.0f}"),
    ("gp ITL", lambda r: r.genai_perf.get("gp_itl_ms", math.nan), "{:.1f}"),
)
GENAI_PERF_KEYS = ("gp_token_throughput", "gp_request_throughput", "gp_ttft_ms", "gp_itl_ms")


def format_table(rows: Sequence[BenchRow], baseline: str) -> str:
    """Aligned text table; the `x` columns are ratios to `baseline`, `gp` columns genai-perf's (p50) figures."""
    columns = COLUMNS + (GENAI_PERF_COLUMNS if any(row.genai_perf for row in rows) else ())
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        values = [getter(row) for _, getter, _ in columns]
        cells.append(["-" if isinstance(v, float) and math.isnan(v) else fmt.format(v)
                      for v, (_, _, fmt) in zip(values, columns, strict=True)])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    text = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text) + f"\n(x = policy / {baseline} at the same concurrency, same run)"


def write_csv(rows: Sequence[BenchRow], path: Path) -> Path:
    """One CSV line per row: every LevelResult field, residency deltas and ratios."""
    fields = ["policy", *asdict(rows[0].result), "host_share", "admissions_waited", "reclaim_events",
              *(f"{m}_vs_baseline" for m in RATIO_METRICS), *GENAI_PERF_KEYS] if rows else ["policy"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({"policy": row.policy, **asdict(row.result), "host_share": row.host_share,
                             "admissions_waited": row.admissions_waited, "reclaim_events": row.reclaim_events,
                             **{f"{m}_vs_baseline": row.ratios.get(m, math.nan) for m in RATIO_METRICS},
                             **{k: row.genai_perf.get(k, math.nan) for k in GENAI_PERF_KEYS}})
    return path


def plot(rows: Sequence[BenchRow], path: Path, title: str,
         xlabel: str = "concurrency (perf_analyzer --streaming, gRPC)") -> Path:
    """PNG with three panels against concurrency: output tokens/s, median TTFT, median ITL; a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("token_throughput", "output tokens / s"), ("ttft_ms", "median TTFT (ms)"),
              ("itl_ms", "median inter-token latency (ms)"))
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy in dict.fromkeys(row.policy for row in rows):
        mine = sorted((r.result for r in rows if r.policy == policy), key=lambda r: r.concurrency)
        for axis, (metric, label) in zip(axes, panels, strict=True):
            axis.plot([r.concurrency for r in mine], [getattr(r, metric) for r in mine], marker="o", label=policy)
            axis.set_xlabel(xlabel)
            axis.set_ylabel(label)
            axis.set_xscale("log", base=2)
            axis.set_xticks([r.concurrency for r in mine], [str(r.concurrency) for r in mine])
            axis.grid(True, alpha=0.3)
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
