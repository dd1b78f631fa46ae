"""The host tier is bounded: ``host_bytes`` for N requests admits N, request N+1 waits until one finishes, the
store's chunks are allocated once and never move (nothing is copied when it fills), invariants hold, and rows
read back through several chunks are exact."""

from __future__ import annotations

import pytest
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv import AdmissionError

PROMPT, NEW = 10, 6


@pytest.mark.parametrize("policy", ["hisparse", "adaptive"])
@pytest.mark.parametrize("chunk_pages", [1000, 3])  # one chunk; many small chunks
def test_request_beyond_host_capacity_waits_and_is_admitted_when_one_finishes(policy, chunk_pages) -> None:
    layout = make_layout("glm")
    probe = make_manager(layout, policy, 1 << 20)
    pages_each = probe.host_pages_needed(PROMPT, NEW)
    page_bytes = probe.pool.page_bytes
    n = 3
    m = make_manager(layout, policy, 1 << 20, host_bytes=n * pages_each * page_bytes,
                     host_chunk_bytes=chunk_pages * page_bytes)
    assert m.host.num_pages == n * pages_each
    d = KVDriver(m, seed=3)
    for i in range(n):
        assert d.submit(f"r{i}", PROMPT, NEW)
    d.poll()
    chunks = [(c.data_ptr(), c.shape[0]) for c in m.host.rows.chunks]
    assert sum(rows for _, rows in chunks) == m.host.num_pages * m.config.page_rows  # full, never more
    assert not d.submit("extra", PROMPT, NEW)  # host pages are short (the device pool is not)
    stats = m.stats()
    assert stats["kv_requests_waiting"] == 1 and stats["kv_host_pages_used"] == n * pages_each
    for _ in range(3):  # the running requests keep decoding; every gather is checked against the reference
        d.step(d.steppable(), 1)
        d.poll()
    assert not d.submit("extra", PROMPT, NEW)
    d.finish("r1")
    assert d.submit("extra", PROMPT, NEW)  # admitted as soon as a request finished
    assert m.stats()["kv_admissions_waited"] == 1
    for _ in range(NEW - 1):
        if d.steppable():
            d.step(d.steppable(), 1)
        d.poll()
    # Nothing moved: the same chunks (same memory) hold every row from the first admission to the last.
    assert [(c.data_ptr(), c.shape[0]) for c in m.host.rows.chunks] == chunks
    if chunk_pages == 3:
        assert len(chunks) > 1
    d.drain()


def test_a_request_larger_than_the_host_store_is_refused_with_the_field_named() -> None:
    layout = make_layout("deepseek")
    probe = make_manager(layout, "hisparse", 1 << 20)
    page_bytes = probe.pool.page_bytes
    m = make_manager(layout, "hisparse", 1 << 20, host_bytes=probe.host_pages_needed(PROMPT, NEW) * page_bytes - 1)
    with pytest.raises(AdmissionError, match="host_bytes"):
        m.try_admit("big", PROMPT, NEW)
    resident = make_manager(layout, "resident", 1 << 20, host_bytes=page_bytes)  # no host pages needed
    assert resident.try_admit("a", PROMPT, NEW)
