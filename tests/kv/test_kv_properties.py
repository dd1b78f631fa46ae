"""Property-based tests: random admit / step / finish / cancel / pressure sequences against the manager.

After every operation: ``check_invariants()`` (budget rule, accounting, page ownership, every row ready on
device or with a host copy, hot-cache consistency), every gather equal to the reference rows (freed pages
are NaN-poisoned, so a page freed before its readers finished fails the data check), and no request lost.
At the end every request is released and the pool must return exactly to empty.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv.config import KVConfig
from dhisparse.kv.footprint import request_footprint

MAX_PROMPT, MAX_NEW = 20, 8


class KVMachine(RuleBasedStateMachine):
    driver: KVDriver

    @initialize(
        policy=st.sampled_from(["resident", "hisparse", "adaptive"]),
        kind=st.sampled_from(["deepseek", "glm", "shared"]),
        pool_scale=st.sampled_from([1.0, 1.6, 3.0, 8.0]),
        max_query_len=st.sampled_from([1, 2]),
        reserve_pages=st.sampled_from([0, 2]),
        seed=st.integers(0, 10_000),
        native=st.booleans(),
    )
    def setup(self, policy: str, kind: str, pool_scale: float, max_query_len: int, reserve_pages: int,
              seed: int, native: bool) -> None:
        layout = make_layout(kind)
        hot_rows = layout.index_topk + 2  # B does not grow with the query length: overflow goes to staging
        probe = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=hot_rows, page_rows=4,
                         max_query_len=max_query_len)
        reserve = reserve_pages * 4 * layout.row_bytes
        smallest = request_footprint(layout, probe, MAX_PROMPT, MAX_NEW).required_bytes + reserve
        manager = make_manager(layout, policy, int(smallest * pool_scale), hot_rows=hot_rows,
                               max_query_len=max_query_len, reserve_bytes=reserve, refill=2, native=native)
        self.driver = KVDriver(manager, seed=seed)
        self.max_query_len = max_query_len
        self.next_id = 0
        self.submitted: set[str] = set()
        self.ended: set[str] = set()

    @rule(prompt=st.integers(1, MAX_PROMPT), new=st.integers(2, MAX_NEW))
    def admit(self, prompt: int, new: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.submitted.add(rid)
        self.driver.submit(rid, prompt, new)

    @rule()
    def pressure(self) -> None:
        """A request of the largest size: under a tight budget this forces reclaim or waiting."""
        self.admit(MAX_PROMPT, MAX_NEW)

    @rule()
    def retry(self) -> None:
        self.driver.retry_queued()

    @rule()
    def poll(self) -> None:
        self.driver.poll()

    @precondition(lambda self: bool(self.driver.steppable()))
    @rule(data=st.data(), mid_admit=st.booleans())
    def step(self, data: st.DataObject, mid_admit: bool) -> None:
        ready = self.driver.steppable()
        batch = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        q = data.draw(st.integers(1, self.max_query_len))

        def admit_mid_step() -> None:  # admission (and possibly reclaim) while the step's readers run
            self.driver.retry_queued()

        self.driver.step(batch, q, mid_step=admit_mid_step if mid_admit else None)

    @precondition(lambda self: bool(self.driver.steppable()))
    @rule(data=st.data(), iterations=st.integers(1, 6))
    def run_engine(self, data: st.DataObject, iterations: int) -> None:
        """A few engine iterations: poll, retry queued admissions, step every steppable request."""
        for _ in range(iterations):
            self.driver.poll()
            self.driver.retry_queued()
            ready = self.driver.steppable()
            if not ready:
                break
            self.driver.step(ready, data.draw(st.integers(1, self.max_query_len)))

    @precondition(lambda self: bool(self.driver.refs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.driver.refs)))
        self.driver.finish(rid)
        self.ended.add(rid)

    @precondition(lambda self: bool(self.driver.queued))
    @rule(data=st.data())
    def cancel_waiting(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.driver.queued)))
        self.driver.finish(rid)
        self.ended.add(rid)

    @invariant()
    def no_request_lost(self) -> None:
        if not hasattr(self, "driver"):
            return
        m, d = self.driver.manager, self.driver
        assert set(m.requests) == set(d.refs)
        assert set(m.waiting) == set(d.queued)
        assert self.submitted == set(d.refs) | set(d.queued) | self.ended
        for rid, ref in d.refs.items():
            assert m.requests[rid].length == ref.length

    def teardown(self) -> None:
        if not hasattr(self, "driver"):
            return
        self.driver.drain()
        m = self.driver.manager
        m.check_invariants()
        stats = m.stats()
        assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == 0
        assert m.pool.free_pages == m.pool.num_pages and m.host.used_pages == 0
        assert m.copies.num_pending == 0 and stats["kv_requests_releasing"] == 0


KVMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVManagerProperties = KVMachine.TestCase
