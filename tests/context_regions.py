"""Waiting for a context worker's exported regions to be freed (shared by the disaggregation tests)."""

from __future__ import annotations

import time


def wait_regions_released(worker) -> dict[str, float]:
    """The worker's statistics once it holds no region (it frees one when every reader's READ notification arrived),
    or after ~10 s, whichever comes first (the caller asserts on ``regions_held``)."""
    for _ in range(1000):
        stats = worker.stats()
        if stats["regions_held"] == 0:
            return stats
        time.sleep(0.01)
    return worker.stats()
