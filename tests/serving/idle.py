"""Waiting for the served engine to return to idle, read through /metrics."""

from __future__ import annotations

import time

# Occupancy statistics that must come back to zero when no request is open. Cumulative counters
# (tokens, steps, fetched bytes) are excluded; KV occupancy is matched by name.
OCCUPANCY_EXACT = ("requests_running", "requests_waiting", "kv_requests", "serving_active_requests")
OCCUPANCY_WORDS = ("used_bytes", "bytes_used", "pages_in_use", "pages_used", "resident_rows", "pages_resident")


def occupancy(metrics: dict[str, float]) -> dict[str, float]:
    """The occupancy subset of a `client.metrics()` snapshot."""
    return {k: v for k, v in metrics.items() if k in OCCUPANCY_EXACT or any(w in k for w in OCCUPANCY_WORDS)}


def wait_idle(client, idle: dict[str, float], timeout_s: float = 20.0) -> dict[str, float]:
    """Poll until every occupancy metric equals its `idle` value; return the last snapshot or raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = occupancy(client.metrics())
        if all(now.get(k) == v for k, v in idle.items()) and now.get("serving_active_requests", 0.0) == 0.0:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: {now} (idle: {idle})")
        time.sleep(0.1)


def settle(client, timeout_s: float = 20.0) -> dict[str, float]:
    """Wait until no request is open anywhere, then return the idle occupancy snapshot."""
    wait_idle(client, dict.fromkeys(OCCUPANCY_EXACT, 0.0), timeout_s)
    time.sleep(0.3)  # one more metrics refresh, so KV occupancy reflects the last release
    return occupancy(client.metrics())
