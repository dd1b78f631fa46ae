"""Engine statistics as Triton Python-backend custom metrics (Prometheus text on `/metrics`).

Every number in `EngineLoop.stats()` becomes a gauge `dhisparse_<stat>{model, version}` (cumulative
counters keep their running total, so `rate()` works on them as on Prometheus counters). A few derived
gauges are added, such as rows resolved per resolver step. Metric families are created lazily, the
first time a statistic appears, because the set of statistics grows with the engine's features
(residency, speculation).

Only one thread may touch metrics: tritonserver 2.51 crashed in a probe when several threads updated
custom metrics at once. `LLMService` calls `update` from its single supervisor thread.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

PREFIX = "dhisparse_"

# Descriptions of the statistics users look at most; others get a generic one.
DESCRIPTIONS = {
    "requests_waiting": "Requests queued for admission (waiting for KV pool room or a batch slot)",
    "requests_running": "Requests admitted and decoding",
    "generated_tokens": "Tokens generated since start (cumulative)",
    "prefill_tokens": "Prompt tokens prefilled since start (cumulative)",
    "requests_aborted": "Requests cancelled or aborted since start (cumulative)",
    "admissions_waited": "Requests that had to wait for admission at least once (cumulative)",
    "resolver_steps": "Resolver steps run since start (cumulative)",
    "resolved_rows": "KV rows resolved by the resolver since start (cumulative)",
    "host_fetched_rows": "KV rows fetched from host memory since start (cumulative)",
    "host_fetched_bytes": "Bytes fetched from host memory since start (cumulative)",
    "optional_pages_resident": "Optional (reclaimable) KV pages resident on the device",
    "draft_tokens_proposed": "Draft tokens proposed by the speculative drafter (cumulative)",
    "draft_tokens_accepted": "Draft tokens accepted by verification (cumulative)",
    "serving_active_requests": "Requests with an open response stream in the dhisparse model",
    "serving_cancelled_requests": "Requests cancelled by their client (cumulative)",
    "resolved_rows_per_resolver_step": "Rows resolved per resolver step, over the last metrics interval",
    "draft_acceptance_rate": "Accepted / proposed draft tokens, over the last metrics interval",
}
# Derived gauge -> (numerator stat, denominator stat), computed over the last interval's increments.
RATIOS = {
    "resolved_rows_per_resolver_step": ("resolved_rows", "resolver_steps"),
    "draft_acceptance_rate": ("draft_tokens_accepted", "draft_tokens_proposed"),
}


def metric_name(stat: str) -> str:
    """Prometheus-safe metric name for an engine statistic key."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", stat)


def interval_ratios(previous: Mapping[str, float], current: Mapping[str, float]) -> dict[str, float]:
    """Derived ratios over the increments between two stats snapshots (absent when nothing happened)."""
    out = {}
    for name, (numerator, denominator) in RATIOS.items():
        if numerator in current and denominator in current:
            d_den = current[denominator] - previous.get(denominator, 0.0)
            if d_den > 0:
                out[name] = (current[numerator] - previous.get(numerator, 0.0)) / d_den
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
            name = metric_name(stat)
            family = self._pb.MetricFamily(
                name=name, description=DESCRIPTIONS.get(stat, f"dhisparse engine statistic '{stat}'"),
                kind=self._pb.MetricFamily.GAUGE,
            )
            self._families[stat] = family
            metric = self._metrics[stat] = family.Metric(labels=self._labels)
        return metric

    def update(self, stats: Mapping[str, float]) -> None:
        """Set every gauge from `stats` (numbers only) plus the derived ratios."""
        current = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
        for stat, value in {**current, **interval_ratios(self._previous, current)}.items():
            self._gauge(stat).set(value)
        self._previous = current
