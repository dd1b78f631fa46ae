"""Waiting for the served engine to return to idle, read through /metrics.

Idle is defined by the KV manager's real occupancy statistics (`KVManager.stats`, docs/kv.md) plus the
engine's and the serving layer's request gauges: with no request open, every tier is empty but for the pages the
prefix cache keeps (subtracted). A released
request's pages are freed at the loop's next poll, so `kv_requests_releasing` may stay at 1 for a moment.
"""

from __future__ import annotations

import time

# Gauges that are 0 when no request is open (cumulative counters are excluded on purpose).
KV_OCCUPANCY = (
    "kv_required_bytes", "kv_optional_bytes", "kv_optional_pages_resident", "kv_requests_running",
    "kv_requests_waiting", "kv_requests_releasing", "kv_copies_pending", "kv_host_pages_used",
)
REQUEST_GAUGES = ("requests_running", "requests_waiting", "serving_active_requests")
IDLE = dict.fromkeys(KV_OCCUPANCY + REQUEST_GAUGES, 0.0)


# What the prefix cache keeps after its requests are gone (docs/prefix_reuse.md): not occupancy by a request.
PREFIX_CACHE = {"kv_optional_bytes": "kv_prefix_device_bytes", "kv_host_pages_used": "kv_prefix_host_pages"}


def occupancy(metrics: dict[str, float]) -> dict[str, float]:
    """The occupancy subset of a `client.metrics()` snapshot (absent gauges read as missing, not 0), less what the
    prefix cache holds."""
    return {k: metrics[k] - metrics.get(PREFIX_CACHE.get(k, ""), 0.0) for k in IDLE if k in metrics}


def wait_idle(client, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll until every occupancy gauge is present and at its idle value; return that snapshot or raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = occupancy(client.metrics())
        if now == IDLE:
            return now
        if time.monotonic() > deadline:
            busy = {k: now.get(k) for k in IDLE if now.get(k) != 0.0}
            raise AssertionError(f"not idle after {timeout_s} s; non-idle gauges: {busy}")
        time.sleep(0.1)


def settle(client, timeout_s: float = 20.0) -> dict[str, float]:
    """Wait until nothing is open, then one more metrics refresh (so cumulative counters are current)."""
    wait_idle(client, timeout_s)
    time.sleep(0.3)
    return wait_idle(client, timeout_s)
