"""Targeted tests of the residency manager: admission, reclaim order, waiting, safe free, refill, tail,
speculative rejection, GLM prefetch and shared sources (tiny sizes, exact expectations)."""

from __future__ import annotations

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.errors import ConfigError
from dhisparse.kv.config import AdmissionError, KVConfig
from dhisparse.kv.host_store import HOST_EMPTY, HOST_PENDING, HOST_VALID
from dhisparse.kv.index_keys import request_keys
from dhisparse.kv.request_state import OPT_ABSENT, OPT_BACKING_UP, OPT_READY, OPT_REFILLING, OPT_RETIRED

PAGE = 80  # deepseek layout: row_dim 5 float32 = 20 bytes, page_rows 4


def test_resident_first_admission_keeps_prompt_pages_and_defers_backup() -> None:
    m = make_manager(make_layout("deepseek"), "adaptive", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 18, 4)  # 4 complete pages + 2 rows in the tail
    req = m.requests["a"]
    assert req.opt_state.tolist() == [[OPT_READY] * 4] * 3
    assert bool((req.host_state == HOST_EMPTY).all())  # backup deferred
    assert m.copies.num_pending == 0
    assert m.stats()["kv_optional_pages_resident"] == 12
    assert m.stats()["kv_optional_bytes"] == 12 * PAGE
    d.step(["a"], 1)
    assert m.request_stats("a")["kv_rows_host"] == 0  # prompt rows direct, the new row is in the tail


def test_hisparse_backs_up_the_prompt_eagerly_and_keeps_no_optional_pages() -> None:
    m = make_manager(make_layout("deepseek"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 18, 4)
    req = m.requests["a"]
    assert req.prompt_pages == 0 and m.stats()["kv_optional_bytes"] == 0
    assert m.copies.pending_kinds() == ["import"]
    assert bool((req.host_state[:, :4] == HOST_PENDING).all())
    d.poll()
    assert bool((req.host_state[:, :4] == HOST_VALID).all())
    d.step(["a"], 1)


def test_configurations_that_cannot_work_are_refused_with_the_fix() -> None:
    layout = make_layout("deepseek", topk=4)
    with pytest.raises(ConfigError, match="raise hot_rows to >= 4"):  # one query's selection; staging takes the rest
        make_manager(layout, "hisparse", 100_000, hot_rows=3, max_query_len=2)
    m = make_manager(layout, "resident", 2000)
    with pytest.raises(AdmissionError, match="raise pool_bytes"):
        m.try_admit("big", 500, 10)
    with pytest.raises(ConfigError, match="reserve_bytes"):
        KVConfig(pool_bytes=100, reserve_bytes=100)
    with pytest.raises(ConfigError, match="policy"):
        KVConfig(policy="lru")


def _two_full_requests(extra: int, max_new_a: int = 8, max_new_b: int = 3):
    """Requests a and b with all 12 prompt pages optional each, and ``extra`` bytes spare after them."""
    layout = make_layout("deepseek")
    probe = make_manager(layout, "adaptive", 1 << 20)
    req_a, req_b = probe.required_bytes(16, max_new_a), probe.required_bytes(16, max_new_b)
    pool = req_a + req_b + 24 * PAGE + extra
    m = make_manager(layout, "adaptive", pool)
    d = KVDriver(m)
    assert d.submit("a", 16, max_new_a) and d.submit("b", 16, max_new_b)
    assert m.stats()["kv_optional_pages_resident"] == 24
    return m, d


def test_reclaim_takes_whole_requests_in_reclaim_order_and_admits_between_steps() -> None:
    layout = make_layout("deepseek")
    need_c = make_manager(layout, "adaptive", 1 << 20).required_bytes(4, 4)
    m, d = _two_full_requests(extra=need_c - 100)
    # Deficit 100 bytes: b has fewer remaining tokens -> all of b's pages are reclaimed, a keeps its own.
    # No step is open, so the deferred backup is completed inside try_admit and c is admitted at once.
    assert d.submit("c", 4, 4)
    assert m.requests["b"].opt_state.tolist() == [[OPT_ABSENT] * 4] * 3
    assert bool((m.requests["b"].host_state[:, :4] == HOST_VALID).all())
    assert m.requests["a"].opt_state.tolist() == [[OPT_READY] * 4] * 3
    stats = m.stats()
    assert stats["kv_optional_pages_reclaimed"] == 12 and stats["kv_reclaim_events"] == 1
    assert stats["kv_admissions_waited"] == 0
    d.step(["a", "b", "c"], 1)
    d.drain()


def test_a_reclaim_during_a_step_keeps_pages_readable_and_the_admission_waits() -> None:
    layout = make_layout("deepseek")
    need_c = make_manager(layout, "adaptive", 1 << 20).required_bytes(4, 4)
    m, d = _two_full_requests(extra=need_c - 100)
    seen = {}

    def admit_mid_step() -> None:
        seen["admitted"] = d.submit("c", 4, 4)
        seen["b"] = m.requests["b"].opt_state.clone()
        seen["kinds"] = m.copies.pending_kinds()

    d.step(["a", "b"], 1, mid_step=admit_mid_step)  # b's pages stay readable while the backup runs
    assert not seen["admitted"] and seen["kinds"] == ["reclaim_backup"]
    assert seen["b"].tolist() == [[OPT_BACKING_UP] * 4] * 3
    assert m.stats()["kv_requests_waiting"] == 1
    d.poll()  # backup done -> retired -> freed (the step's readers finished)
    assert m.requests["b"].opt_state.tolist() == [[OPT_ABSENT] * 4] * 3
    assert d.submit("c", 4, 4)
    stats = m.stats()
    assert stats["kv_admissions_waited"] == 1 and stats["kv_admission_wait_steps"] == 0
    d.step(["a", "b", "c"], 1)
    d.drain()


def test_ties_in_remaining_tokens_reclaim_the_most_recent_admission_first() -> None:
    layout = make_layout("deepseek")
    need_c = make_manager(layout, "adaptive", 1 << 20).required_bytes(4, 4)
    m, d = _two_full_requests(extra=need_c - 100, max_new_a=5, max_new_b=5)
    assert d.submit("c", 4, 4)
    assert int((m.requests["b"].opt_state == OPT_ABSENT).sum()) == 12
    assert int((m.requests["a"].opt_state == OPT_READY).sum()) == 12


def test_an_admission_that_optional_pages_cannot_cover_waits_without_reclaiming() -> None:
    layout = make_layout("deepseek")
    m, d = _two_full_requests(extra=0)
    need = m.required_bytes(60, 40)
    assert need + 0 <= m.config.pool_bytes  # admissible on an empty pool
    assert not d.submit("huge", 60, 40)
    assert m.copies.num_pending == 0 and m.stats()["kv_optional_pages_reclaimed"] == 0
    d.finish("a")
    d.finish("b")
    assert d.submit("huge", 60, 40)
    d.drain()
    del layout


def test_safe_free_keeps_a_reclaimed_page_readable_until_earlier_readers_finish() -> None:
    layout = make_layout("deepseek")
    need_c = make_manager(layout, "adaptive", 1 << 20).required_bytes(4, 4)
    m, d = _two_full_requests(extra=need_c - 100)
    # Make b's pages host-valid so a reclaim retires them at once (no backup needed).
    m.requests["b"].host_state[:, :4] = HOST_VALID
    m.host.rows.zero_()
    free_before = m.pool.free_pages
    seen = {}

    def admit_mid_step() -> None:
        seen["admitted"] = d.submit("c", 4, 4)
        seen["state"] = m.requests["b"].opt_state.clone()
        seen["free"] = m.pool.free_pages

    # Positions of b's prompt must still read b's rows after the reclaim decision inside the step
    # (the host copy was zeroed above, so a read of host or of a freed, NaN-poisoned page would fail).
    d.step(["a", "b"], 1, mid_step=admit_mid_step)
    assert not seen["admitted"]  # the retired pages are not free while the step's readers may run
    assert bool((seen["state"] == OPT_RETIRED).all()) and seen["free"] == free_before
    d.poll()  # the step ended: its readers finished -> pages freed
    assert bool((m.requests["b"].opt_state == OPT_ABSENT).all())
    assert m.pool.free_pages == free_before + 12
    d.finish("a")
    d.finish("b")
    d.drain()


def test_refill_is_bounded_round_robin_and_visible_only_when_the_copy_is_done() -> None:
    layout = make_layout("deepseek")
    probe = make_manager(layout, "adaptive", 1 << 20)
    need = probe.required_bytes(8, 4)
    m = make_manager(layout, "adaptive", 3 * need, refill=3)
    d = KVDriver(m)
    for rid in ("hog", "x", "y"):  # admitted before any prefill is imported: the pool is all required
        assert d.submit(rid, 8, 4, import_now=False)
    for rid in ("hog", "x", "y"):
        d.import_prompt(rid, 8, 4)
    # No memory was spare at import: every prompt page went to host.
    assert m.stats()["kv_optional_pages_resident"] == 0 and m.copies.pending_kinds() == ["import"] * 3
    d.finish("hog")
    d.poll()  # imports done; refill issues 3 pages: x, y, x (round-robin), page-major within a request
    x, y = m.requests["x"], m.requests["y"]
    assert x.opt_state.tolist() == [[OPT_REFILLING, OPT_ABSENT], [OPT_REFILLING, OPT_ABSENT], [0, 0]]
    assert y.opt_state.tolist() == [[OPT_REFILLING, OPT_ABSENT], [0, 0], [0, 0]]
    assert bool((x.page_table[:, :2] == -1).all())  # not visible yet
    d.poll()  # copies done -> visible; 3 more issued (y, x, y)
    assert x.opt_state[:, 0].tolist() == [OPT_READY, OPT_READY, OPT_REFILLING]
    assert y.opt_state[:, 0].tolist() == [OPT_READY, OPT_REFILLING, OPT_REFILLING]
    assert int(x.page_table[0, 0]) == int(x.opt_page[0, 0])
    assert m.stats()["kv_optional_pages_refilled"] == 3
    for _ in range(4):
        d.poll()
    assert m.stats()["kv_optional_pages_resident"] == 12
    d.step(["x", "y"], 1)
    assert m.request_stats("x")["kv_rows_host"] == 0
    d.drain()


def test_tail_page_is_backed_up_when_complete_and_leaves_the_tail_when_the_backup_is_done() -> None:
    m = make_manager(make_layout("deepseek"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 6, 9)
    d.poll()
    req = m.requests["a"]
    d.step(["a"], 1, accept={"a": 1})
    assert m.copies.num_pending == 0 and req.tail_first == 1
    d.step(["a"], 1, accept={"a": 1})  # length 8: page 1 complete -> backup issued, still mapped
    assert m.copies.pending_kinds() == ["tail_backup"] and int(req.page_table[0, 1]) >= 0
    d.poll()
    assert req.tail_first == 2 and int(req.page_table[0, 1]) == -1
    assert bool((req.host_state[:, 1] == HOST_VALID).all())
    d.step(["a"], 1)
    d.drain()


def test_rejected_speculative_rows_leave_no_trace() -> None:
    m = make_manager(make_layout("glm"), "adaptive", 100_000, hot_rows=12, max_query_len=3, debug_checks=True)
    d = KVDriver(m)
    assert d.submit("a", 7, 9)
    d.step(["a"], 3, accept={"a": 1})  # positions 7, 8, 9 written; only 7 kept
    req = m.requests["a"]
    assert req.length == 8 and int(req.page_table[0, 2]) == -1
    assert not bool(request_keys(m.pool, req.key_pages, req.footprint.key_blocks * m.pool.keys_per_page)[0, 8:].any())
    step = m.begin_step(["a"], 1)
    with pytest.raises(ValueError, match="past the request's length"):
        step.gather(0, torch.tensor([[[9, -1, -1, -1]]]))
    m.end_step({"a": 0})
    d.step(["a"], 3)
    d.drain()


def test_glm_group_prefetches_the_shared_layer_rows() -> None:
    m = make_manager(make_layout("glm"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 12, 4)
    d.poll()
    step = m.begin_step(["a"], 1)
    rows = torch.randn(1, 1, 5)
    step.write(0, rows, torch.randn(1, 1, 3))
    positions = torch.tensor([[[0, 5, 9, -1]]])
    step.gather(0, positions)
    assert m.copies.pending_kinds() == ["fetch"]  # source 1's rows issued ahead, not yet waited for
    step.write(1, rows, None)
    step.gather(1, positions)
    assert m.copies.num_pending == 0
    assert step.counts.tolist() == [[0, 0, 6]]  # 3 host rows for each of sources 0 and 1
    m.end_step({"a": 1})
    d.drain()


def test_shared_source_is_resolved_once_and_its_locations_reused() -> None:
    m = make_manager(make_layout("shared"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 12, 4)
    d.poll()
    d.step(["a"], 1)
    assert m.stats()["kv_resolver_calls"] == 2  # two sources, four layers: one resolution per source
    stats = m.request_stats("a")
    assert stats["kv_resolved_rows"] <= 2 * 4  # at most index_topk distinct rows per source
    d.drain()


def test_release_while_copies_are_in_flight_defers_the_free() -> None:
    m = make_manager(make_layout("deepseek"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 16, 4)
    assert m.copies.pending_kinds() == ["import"]
    d.finish("a")
    assert m.stats()["kv_requests_releasing"] == 1 and m.stats()["kv_required_bytes"] > 0
    d.poll()
    assert m.stats()["kv_requests_releasing"] == 0 and m.stats()["kv_required_bytes"] == 0
    m.check_invariants()


def test_waiting_request_can_be_cancelled() -> None:
    m = make_manager(make_layout("deepseek"), "resident", 2000)
    d = KVDriver(m)
    assert d.submit("a", 8, 4)
    assert not d.submit("b", 8, 4)
    d.finish("b")
    assert m.stats()["kv_requests_waiting"] == 0
    d.drain()


def test_a_prefetch_the_model_never_consumes_is_completed_by_end_step() -> None:
    m = make_manager(make_layout("glm"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 12, 4)
    d.poll()
    step = m.begin_step(["a"], 1)
    step.write(0, torch.randn(1, 1, 5), torch.randn(1, 1, 3))
    step.gather(0, torch.tensor([[[0, 5, 9, -1]]]))
    assert m.copies.pending_kinds() == ["fetch"]
    m.end_step({"a": 0})
    assert m.copies.num_pending == 0
    d.finish("a")
    d.drain()
