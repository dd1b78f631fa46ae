"""Soak: a few hundred short requests from concurrent clients, no error, no leak, server still ready."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from idle import IDLE, settle, wait_idle

from dhisparse_client import GenerationOptions

REQUESTS = 300
CLIENTS = 8


def _rss_kib(pid: int) -> int:
    """Resident memory of a process and its children (the Python-backend stubs), KiB."""
    total = 0
    pids = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def _one(served, i: int) -> int:
    rng = random.Random(i)
    options = GenerationOptions(max_tokens=rng.randint(1, 4))
    prompt = f"request {i}: " + rng.choice(["To be", "naïve", "the question", "🙂"])
    kind = i % 3
    if kind == 0:
        return len(b"".join(served.client("ensemble").stream(prompt, options)))
    if kind == 1:
        return len(b"".join(served.client("dhisparse_bls").stream(prompt, options)))
    return len(served.client("ensemble").generate(prompt, options))


def test_soak_hundreds_of_requests(served):
    client = served.client()
    settle(client)
    before = client.metrics()
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:  # warm-up, then measure memory
        list(pool.map(lambda i: _one(served, i), range(60)))
    rss_warm = _rss_kib(served.server.pid)
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        lengths = list(pool.map(lambda i: _one(served, i), range(60, 60 + REQUESTS)))
    assert len(lengths) == REQUESTS  # any error would have raised
    assert wait_idle(client) == IDLE
    time.sleep(0.5)
    after = client.metrics()
    assert after["requests_finished"] - before.get("requests_finished", 0.0) == REQUESTS + 60
    assert after.get("requests_aborted", 0.0) == before.get("requests_aborted", 0.0)
    assert client.is_ready()
    growth_mib = (_rss_kib(served.server.pid) - rss_warm) / 1024
    assert growth_mib < 64, f"server memory grew by {growth_mib:.0f} MiB over {REQUESTS} requests"
