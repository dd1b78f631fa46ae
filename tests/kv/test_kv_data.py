"""Data-level exactness: gather returns exactly the rows that were written, under every policy and budget.

This is what makes the engine's tokens exact: any resolver, copy, tail, reclaim or refill error shows up
as a wrong row (freed pages are poisoned with NaN, so a read of freed memory cannot pass either).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv.footprint import request_footprint
from dhisparse.kv.request_state import OPT_READY

MAX_PROMPT, MAX_NEW = 23, 9


def smallest_pool(layout, policy: str, hot_rows: int, max_query_len: int, reserve: int = 0) -> int:
    from dhisparse.kv.config import KVConfig

    cfg = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=hot_rows, page_rows=4,
                   max_query_len=max_query_len)
    return request_footprint(layout, cfg, MAX_PROMPT, MAX_NEW).required_bytes + reserve


def run_engine_loop(driver: KVDriver, seed: int, num_requests: int, max_query_len: int) -> None:
    """Random arrivals with irregular lengths, batched steps, finishes and cancels, until all are done."""
    rng = random.Random(seed)
    arrivals = [(f"r{i}", rng.randint(1, MAX_PROMPT), rng.randint(2, MAX_NEW)) for i in range(num_requests)]
    it = 0
    while arrivals or driver.refs or driver.queued:
        it += 1
        assert it < 500, "engine loop did not make progress"
        driver.poll()
        driver.retry_queued()
        if arrivals and rng.random() < 0.6:
            driver.submit(*arrivals.pop(0))
        ready = driver.steppable()
        if ready:
            batch = rng.sample(ready, rng.randint(1, len(ready)))
            driver.step(batch, rng.randint(1, max_query_len))
        for rid in list(driver.refs):
            ref = driver.refs[rid]
            if ref.length >= ref.last_length or rng.random() < 0.03:  # finished or cancelled
                driver.finish(rid)
    driver.drain()
    stats = driver.manager.stats()
    assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == 0 and stats["kv_host_pages_used"] == 0
    driver.manager.check_invariants()


@pytest.mark.parametrize("policy", ["resident", "hisparse", "adaptive"])
@pytest.mark.parametrize("kind", ["deepseek", "glm", "shared"])
@pytest.mark.parametrize("budget", ["generous", "tight", "middle"])
def test_gather_returns_exactly_the_written_rows(policy: str, kind: str, budget: str) -> None:
    seed = zlib.crc32(f"{policy}/{kind}/{budget}".encode()) % 1000  # stable across processes
    layout = make_layout(kind)
    max_query_len = 1 if kind == "deepseek" else 3
    # tight: B = index_topk, so the rows of a step's union that the hot cache cannot take go to staging
    hot_rows = layout.index_topk if budget == "tight" else layout.index_topk * max_query_len + 3
    smallest = smallest_pool(layout, policy, hot_rows, max_query_len)
    pool = {"generous": 40 * smallest, "tight": smallest, "middle": 3 * smallest}[budget]
    manager = make_manager(layout, policy, pool, hot_rows=hot_rows, max_query_len=max_query_len)
    driver = KVDriver(manager, seed=seed)
    run_engine_loop(driver, seed, num_requests=7, max_query_len=max_query_len)
    stats = manager.stats()
    assert stats["kv_admissions"] == stats["kv_releases"] == 7
    if policy == "resident":
        assert stats["kv_rows_hot"] == stats["kv_rows_host"] == 0
    else:
        assert stats["kv_rows_host"] > 0  # decode rows always follow hot-cache rules
    if policy == "adaptive" and budget == "generous":
        assert stats["kv_rows_direct"] > stats["kv_rows_host"]
    if policy == "hisparse" and budget == "tight" and max_query_len > 1:
        assert stats["kv_rows_staged"] > 0
    elif budget != "tight":
        assert stats["kv_rows_staged"] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_and_long_prompts(dtype: torch.dtype) -> None:
    layout = make_layout("deepseek", dtype=dtype, topk=6)
    manager = make_manager(layout, "adaptive", 6000 if dtype == torch.bfloat16 else 12000, hot_rows=6,
                           page_rows=4)
    driver = KVDriver(manager, seed=3)
    assert driver.submit("long", 60, 6)  # prompt 10x index_topk
    for _ in range(3):  # may need a reclaim of "long"'s optional pages, which completes at the next poll
        if driver.submit("short", 5, 6):
            break
        driver.poll()
    assert "short" in driver.refs
    while driver.steppable():
        driver.poll()
        driver.step(driver.steppable(), 1)
    driver.drain()


def test_load_step_reclaims_under_pressure_and_refills_after_the_drain() -> None:
    """Low load (pages resident) -> high load (reclaimed, fetched from host) -> drain (refilled),
    with every gather checked against the written rows throughout."""
    layout = make_layout("deepseek")
    probe = make_manager(layout, "adaptive", 1 << 20)
    need = probe.required_bytes(16, 30)
    manager = make_manager(layout, "adaptive", 2 * need + 12 * 80 + need // 2, refill=4)
    driver = KVDriver(manager, seed=11)
    assert driver.submit("a", 16, 30) and driver.submit("b", 16, 30)
    for _ in range(3):
        driver.step(["a", "b"], 1, accept={"a": 1, "b": 1})
        driver.poll()
    # High load: c does not fit next to a's and b's optional pages -> b (most recent) is reclaimed.
    for _ in range(3):
        if driver.submit("c", 16, 8):
            break
        driver.step(["a", "b"], 1, accept={"a": 1, "b": 1})
        driver.poll()
    assert "c" in driver.refs and manager.stats()["kv_reclaim_events"] >= 1
    resident_under_pressure = manager.stats()["kv_optional_pages_resident"]
    host_before = manager.request_stats("b")["kv_rows_host"]
    for _ in range(3):
        driver.step(["a", "b", "c"], 1, accept={"a": 1, "b": 1, "c": 1})
        driver.poll()
    assert manager.request_stats("b")["kv_rows_host"] > host_before  # b's prompt now comes from host
    driver.finish("c")
    for _ in range(6):  # drain: refill repopulates b's pages, bounded per poll
        driver.poll()
        driver.step(["a", "b"], 1, accept={"a": 1, "b": 1})
    stats = manager.stats()
    assert stats["kv_optional_pages_refilled"] >= 12
    assert stats["kv_optional_pages_resident"] > resident_under_pressure
    assert manager.requests["b"].opt_state.tolist() == [[OPT_READY] * 4] * 3  # whole prompt back on device
    driver.drain()
