"""The prefix cache in exact terms: chain keys, LRU eviction of unreferenced leaves, host memory within ``host_bytes``
under a stream of distinct prefixes, and admissions that never wait while cached pages nobody holds could make room
(host pages, and under ``adaptive`` device copies, which go before any running request's optional pages)."""

from __future__ import annotations

import torch
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv.config import KVConfig
from dhisparse.kv.footprint import request_footprint
from dhisparse.kv.prefix_cache import PrefixCache, cache_salt, page_keys

PAGE = 4


def test_page_keys_name_a_page_and_everything_before_it() -> None:
    salt = cache_salt("model", PAGE)
    tokens = list(range(13))
    keys = page_keys(tokens, PAGE, salt)
    assert len(keys) == 3  # full pages only
    assert page_keys(tokens[:8], PAGE, salt) == keys[:2]  # a prefix has the prefix's keys
    changed = page_keys(tokens[:5] + [99] + tokens[6:], PAGE, salt)  # a token of page 1 differs
    assert changed[0] == keys[0] and changed[1] != keys[1] and changed[2] != keys[2]
    assert page_keys(tokens, PAGE, cache_salt("other model", PAGE))[0] != keys[0]
    assert len(set(page_keys([0] * 12, PAGE, salt))) == 3  # equal pages at different depths are different pages


def test_eviction_takes_unreferenced_leaves_least_recently_used_first() -> None:
    cache = PrefixCache()
    none = torch.zeros(0, dtype=torch.int64)
    a0 = cache.insert(b"a0", None, none, none)
    a1 = cache.insert(b"a1", a0, none, none)
    b1 = cache.insert(b"b1", a0, none, none)  # a second branch after page 0
    c0 = cache.insert(b"c0", None, none, none)
    cache.drop([a0, a1])  # registrants give their references back, oldest chain first
    cache.drop([b1])
    cache.drop([c0])
    cache.hold([a0, a1])  # a later request hits a0, a1 (they become the most recently used) ...
    assert cache.evict_one() is b1  # ... so b1 (a leaf nobody holds) goes first, never a held or inner page
    assert cache.evict_one() is c0
    assert cache.evict_one() is None  # a0 (held) and a1 (held) stay
    cache.drop([a0, a1])
    assert [cache.evict_one(), cache.evict_one(), cache.evict_one()] == [a1, a0, None]  # leaf before its parent
    assert len(cache) == 0


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_host_memory_stays_within_host_bytes_under_distinct_prefixes() -> None:
    layout = make_layout("glm")
    probe = KVConfig(policy="hisparse", pool_bytes=1 << 20, hot_rows=6, page_rows=PAGE)
    per_request = layout.num_sources * request_footprint(layout, probe, 20, 4).num_pages
    host_bytes = 3 * per_request * PAGE * layout.row_bytes  # three requests' pages
    m = make_manager(layout, "hisparse", 1 << 20, hot_rows=6, page_rows=PAGE, host_bytes=host_bytes)
    driver = KVDriver(m, seed=1, vocab=50)
    for n in range(30):  # distinct prompts, two running at a time: the cache fills the host store, then makes way
        assert driver.submit_tokens(f"r{n}", _tokens(n, 20), 4), "an admission waited although pages were cached"
        driver.step([f"r{n}"], 1)
        if n:
            driver.finish(f"r{n - 1}")
        assert m.host.used_pages <= m.host.num_pages
        assert m.host.rows.nbytes <= host_bytes + len(m.host.rows.chunks) * layout.row_bytes
    stats = m.stats()
    assert stats["kv_prefix_evicted_pages"] > 0 and stats["kv_admission_refusals_host"] == 0
    assert stats["kv_admissions_waited"] == 0
    driver.drain()
    assert m.host.used_pages == m.stats()["kv_prefix_host_pages"]  # only the cache's pages are left
    m.prefix.evict_all()
    assert m.host.used_pages == 0


def test_cached_device_copies_go_before_an_admission_waits() -> None:
    """adaptive: finished requests leave their resident prompt pages cached on the device (nobody maps them); an
    admission that needs the memory evicts them (least recently used first) and is admitted at once."""
    layout = make_layout("deepseek")
    probe = KVConfig(policy="adaptive", pool_bytes=1 << 20, hot_rows=6, page_rows=PAGE)
    need = request_footprint(layout, probe, 20, 40).required_bytes  # the later, longer requests
    page_bytes = PAGE * layout.row_bytes
    m = make_manager(layout, "adaptive", need + 6 * page_bytes, hot_rows=6, page_rows=PAGE)
    driver = KVDriver(m, seed=2, vocab=50)
    assert driver.submit_tokens("a", _tokens(1, 20), 4)
    driver.finish("a")
    assert m.stats()["kv_prefix_device_pages"] > 6  # its resident prompt pages stay cached, mapped by nobody ...
    assert m.pool.spare_bytes < need  # ... and hold room the next request needs
    for n in range(3):  # requests of other prefixes: each admitted at once
        assert driver.submit_tokens(f"b{n}", _tokens(10 + n, 20), 40)
        driver.finish(f"b{n}")
    stats = m.stats()
    assert stats["kv_admission_refusals_device"] == 0 and stats["kv_prefix_evicted_device_pages"] > 0
    driver.drain()


def test_a_hit_maps_the_cached_copy_and_a_reclaim_unmaps_it() -> None:
    layout = make_layout("shared")
    m = make_manager(layout, "adaptive", 1 << 20, hot_rows=6, page_rows=PAGE)
    driver = KVDriver(m, seed=3, vocab=50)
    system = _tokens(5, 12)  # three complete pages
    assert driver.submit_tokens("a", system + [1, 2], 4)
    assert driver.submit_tokens("b", system + [3], 4)
    b = m.requests["b"]
    assert m.cached_prefix_tokens("b") == 12 and len(b.prefix_held) == 3
    assert [e.mappers for e in b.prefix_held] == [2, 2, 2]  # one copy, mapped by both
    driver.step(["a", "b"], 1)  # both read their prefix directly from the shared copy
    taken = m._reclaim_for(1)  # a deficit: b (most recently admitted, same remaining tokens) unmaps first
    assert taken
    m.check_invariants()
    driver.step(["a", "b"], 1)  # rows of an unmapped page come from the hot cache / host: still exact
    driver.drain()
    m.prefix.evict_all()
    m.poll()
    assert m.pool.free_pages == m.pool.num_pages and m.host.used_pages == 0
