"""Engine statistics as Triton Python-backend custom metrics (Prometheus text on `/metrics`).

Every number in `EngineLoop.stats()` becomes a gauge `dhisparse_<stat>{model, version}` (cumulative
counters keep their running total, so `rate()` works on them as on Prometheus counters). A few derived
gauges are added over each metrics interval: the share of resolved rows found at each resolver step
(direct / hot cache / host), rows per resolver call, draft acceptance and tokens per verification step.
Metric families are created lazily, the first time a statistic appears, because the set of statistics
grows with the engine's features (residency, speculation). A multi-rank engine's per-rank figures
(``rank{r}_<stat>``) are the gauges ``dhisparse_rank_<stat>{…, rank="r"}``.

Only one thread may touch metrics: tritonserver 2.51 crashed in a probe when several threads updated
custom metrics at once. `LLMService` calls `update` from its single supervisor thread.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

PREFIX = "dhisparse_"

# Descriptions of the statistics users look at most (names as in `LLMEngine.stats` and docs/kv.md);
# others get a generic one.
DESCRIPTIONS = {
    "requests_waiting": "Requests queued in the engine for admission (KV pool room or a batch slot)",
    "requests_running": "Requests admitted and decoding",
    "kv_requests_waiting": "Requests the KV manager refused for now and will admit when memory frees up",
    "kv_requests_running": "Requests holding KV memory",
    "kv_requests_releasing": "Released requests whose memory is not yet free (copies or readers in flight)",
    "generated_tokens": "Tokens generated since start (cumulative)",
    "prefill_tokens": "Prompt tokens prefilled since start (cumulative)",
    "requests_aborted": "Requests cancelled or aborted since start (cumulative)",
    "requests_finished": "Requests finished since start (cumulative)",
    "requests_failed": "Requests ended by a failed engine step (cumulative)",
    "step_faults": "Engine steps in which some work failed and was rolled back (cumulative)",
    "engine_alive": "1 while the engine loop serves; 0 once it stopped after a fault it could not recover from",
    "kv_copies_failed": "KV copies that failed (cumulative)",
    "kv_steps_aborted": "KV steps rolled back after a fault (cumulative)",
    "admissions_waited": "Requests that had to wait for admission at least once (cumulative)",
    "kv_resolver_calls": "Resolver calls since start: one per step, KV source and positions tensor (cumulative)",
    "kv_resolved_rows": "Selected KV rows resolved since start (cumulative)",
    "kv_rows_direct": "Rows resolved at resolver step 1: tail or resident optional page (cumulative)",
    "kv_rows_hot": "Rows resolved at resolver step 2: hot-cache hit (cumulative)",
    "kv_rows_host": "Rows resolved at resolver step 3: copied from host memory (cumulative)",
    "kv_host_fetched_rows": "KV rows fetched from host memory since start (cumulative)",
    "kv_host_fetched_bytes": "Bytes fetched from host memory since start (cumulative)",
    "kv_optional_pages_resident": "Optional (reclaimable) prompt KV pages resident on the device",
    "kv_required_bytes": "Device KV bytes held as required memory (never lent)",
    "kv_optional_bytes": "Device KV bytes held by optional pages",
    "kv_pool_bytes": "Device KV pool budget",
    "kv_host_pages_used": "Host KV pages owned by requests",
    "kv_kernels_cuda": "1 when the CUDA kernels serve the request path (kernels=auto|cuda), else 0",
    "kv_kernels_fallback": "1 when kernels=auto had a GPU but fell back to torch (not built or self-check failed)",
    "kv_kernels_native_resolver": "1 when the KV step resolves through the native CPU library (kernels=auto on a "
                                  "CPU device, built and self-checked), else 0",
    "kv_reclaim_events": "Requests whose optional pages were reclaimed (cumulative)",
    "draft_tokens_proposed": "Draft tokens proposed by the speculative drafter (cumulative)",
    "draft_tokens_accepted": "Draft tokens accepted by verification (cumulative)",
    "draft_acceptance_rate": "Accepted / proposed draft tokens since start",
    "tokens_per_verify_step": "Tokens emitted per request per verification step since start",
    "serving_active_requests": "Requests with an open response stream in the dhisparse model",
    "serving_cancelled_requests": "Requests cancelled by their client (cumulative)",
    "kv_rows_direct_share": "Share of resolved rows found at resolver step 1 (direct), last metrics interval",
    "kv_rows_hot_share": "Share of resolved rows found at resolver step 2 (hot cache), last metrics interval",
    "kv_rows_host_share": "Share of resolved rows fetched from host (step 3), last metrics interval",
    "resolved_rows_per_resolver_call": "Rows resolved per resolver call, last metrics interval",
    "draft_acceptance_rate_interval": "Accepted / proposed draft tokens, last metrics interval",
    "tokens_per_verify_step_interval": "Tokens per request per verification step, last metrics interval",
}
# Derived gauge -> (numerator stats, denominator stats), over the last interval's increments (sums of each).
RATIOS = {
    "kv_rows_direct_share": (("kv_rows_direct",), ("kv_resolved_rows",)),
    "kv_rows_hot_share": (("kv_rows_hot",), ("kv_resolved_rows",)),
    "kv_rows_host_share": (("kv_rows_host",), ("kv_resolved_rows",)),
    "resolved_rows_per_resolver_call": (("kv_resolved_rows",), ("kv_resolver_calls",)),
    "draft_acceptance_rate_interval": (("draft_tokens_accepted",), ("draft_tokens_proposed",)),
    "tokens_per_verify_step_interval": (("draft_tokens_accepted", "verify_rows"), ("verify_rows",)),
}


def metric_name(stat: str) -> str:
    """Prometheus-safe metric name for an engine statistic key."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", stat)


_RANK_STAT = re.compile(r"rank(\d+)_(.+)")


def per_rank(stat: str, labels: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """A multi-rank engine's ``rank{r}_<name>`` statistic is the gauge ``rank_<name>`` labelled ``rank="r"``
    (its own family: the engine-wide ``<name>`` is not mixed with per-rank series); others are unchanged."""
    match = _RANK_STAT.fullmatch(stat)
    if match is None:
        return stat, dict(labels)
    return f"rank_{match.group(2)}", {**labels, "rank": match.group(1)}


def interval_ratios(previous: Mapping[str, float], current: Mapping[str, float]) -> dict[str, float]:
    """Derived ratios over the increments between two stats snapshots (absent when nothing happened)."""
    out = {}
    for name, (numerator, denominator) in RATIOS.items():
        if all(k in current for k in (*numerator, *denominator)):
            d_den = sum(current[k] - previous.get(k, 0.0) for k in denominator)
            if d_den > 0:
                out[name] = sum(current[k] - previous.get(k, 0.0) for k in numerator) / d_den
    return out


class EngineMetrics:
    """Gauges on Triton's metrics endpoint, fed from stats snapshots.

    Args:
        pb: the `triton_python_backend_utils` module.
        labels: labels put on every metric, e.g. `{"model": "dhisparse", "version": "1"}`.
    """

    def __init__(self, pb: Any, labels: Mapping[str, str]) -> None:
        self._pb = pb
        self._labels = dict(labels)
        self._families: dict[str, Any] = {}
        self._metrics: dict[str, Any] = {}
        self._previous: dict[str, float] = {}

    def _gauge(self, stat: str) -> Any:
        metric = self._metrics.get(stat)
        if metric is None:
            family_stat, labels = per_rank(stat, self._labels)
            family = self._families.get(family_stat)
            if family is None:
                family = self._families[family_stat] = self._pb.MetricFamily(
                    name=metric_name(family_stat),
                    description=DESCRIPTIONS.get(family_stat, f"dhisparse engine statistic '{family_stat}'"),
                    kind=self._pb.MetricFamily.GAUGE,
                )
            metric = self._metrics[stat] = family.Metric(labels=labels)
        return metric

    def update(self, stats: Mapping[str, float]) -> None:
        """Set every gauge from `stats` (numbers only) plus the derived ratios."""
        current = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
        for stat, value in {**current, **interval_ratios(self._previous, current)}.items():
            self._gauge(stat).set(value)
        self._previous = current
