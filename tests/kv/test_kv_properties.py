"""Property-based tests: random admit / step / finish / cancel / pressure sequences against the manager.

After every operation: ``check_invariants()`` (budget rule, accounting, page ownership, every row ready on
device or with a host copy, hot-cache consistency), every gather equal to the reference rows (freed pages
are NaN-poisoned, so a page freed before its readers finished fails the data check), and no request lost.
At the end every request is released and the pool must return exactly to empty.

Prefix reuse is interleaved with all of it: token-driven requests (``admit_tokens``) extend sequences of earlier
ones, so their admissions hit cached pages (host pages, indexer keys and, under ``adaptive``, shared device
copies); the cache is evicted at random (``evict_cache``) and under host and device pressure (a small host store);
steps are rolled back (``abort_step``) and copies fail (``copy_fault``, whose owners end as the engine ends them).
The invariants then also cover the prefix cache: reference counts equal the requests holding each page, holds are
prefixes of one chain, parents stay cached, a held page's host pages are the entry's and host-valid, shared device
copies are mapped by exactly the requests that say so, and no cached page's host rows or keys ever change
(copy-on-write). Each hit is checked against the rows and keys the request's own tokens define; an admission that
waits for host pages must find no cached page nobody holds.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv.config import KVConfig
from dhisparse.kv.copies import CopyError
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
        host_scale=st.sampled_from([1.5, 3.0, 50.0]),
    )
    def setup(self, policy: str, kind: str, pool_scale: float, max_query_len: int, reserve_pages: int,
              seed: int, native: bool, host_scale: float) -> None:
        layout = make_layout(kind)
        hot_rows = layout.index_topk + 2  # B does not grow with the query length: overflow goes to staging
        probe = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=hot_rows, page_rows=4,
                         max_query_len=max_query_len)
        reserve = reserve_pages * 4 * layout.row_bytes
        smallest = request_footprint(layout, probe, MAX_PROMPT, MAX_NEW).required_bytes + reserve
        # host_scale: host pages for that many of the largest requests (cached pages must make way)
        host_pages = layout.num_sources * request_footprint(layout, probe, MAX_PROMPT, MAX_NEW).num_pages
        host_bytes = int(host_pages * host_scale) * 4 * layout.row_bytes
        manager = make_manager(layout, policy, int(smallest * pool_scale), hot_rows=hot_rows,
                               max_query_len=max_query_len, reserve_bytes=reserve, refill=2, native=native,
                               host_bytes=host_bytes)
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

    @rule(data=st.data(), new=st.integers(2, MAX_NEW), length=st.integers(1, MAX_PROMPT))
    def admit_tokens(self, data: st.DataObject, new: int, length: int) -> None:
        """A token-driven request with a fresh prompt of ``length`` tokens."""
        d = self.driver
        self._submit_tokens([d.rng.randrange(d.vocab) for _ in range(length)], new)

    @precondition(lambda self: bool(self.driver.sequences))
    @rule(data=st.data(), new=st.integers(2, MAX_NEW), drop=st.integers(0, 6), add=st.integers(0, 6))
    def continue_sequence(self, data: st.DataObject, new: int, drop: int, add: int) -> None:
        """The next turn of an earlier sequence (a prompt or a finished request's whole sequence): its first
        tokens, less ``drop`` at the end (a prefix ending mid-page or at a page boundary), plus ``add`` new ones."""
        d = self.driver
        base = data.draw(st.sampled_from(d.sequences))
        prefix = base[: max(0, min(len(base) - drop, MAX_PROMPT))]
        tail = [d.rng.randrange(d.vocab) for _ in range(max(add, 1 - len(prefix)))]
        self._submit_tokens((prefix + tail)[:MAX_PROMPT], new)

    def _submit_tokens(self, tokens: list[int], new: int) -> None:
        rid = f"t{self.next_id}"
        self.next_id += 1
        self.submitted.add(rid)
        self.driver.submit_tokens(rid, tokens, new)

    @rule()
    def evict_cache(self) -> None:
        self.driver.manager.prefix.evict_all()
        self.driver.check()

    @precondition(lambda self: bool(self.driver.steppable()))
    @rule(data=st.data())
    def abort_step(self, data: st.DataObject) -> None:
        """A step whose forward fails half way: rolled back, nothing kept."""
        d = self.driver
        m, lay = d.manager, d.layout
        batch = data.draw(st.lists(st.sampled_from(d.steppable()), min_size=1, unique=True))
        q = data.draw(st.integers(1, self.max_query_len))
        step = m.begin_step(batch, q)
        for layer in range(lay.num_layers // 2 + 1):
            keys = torch.zeros(len(batch), q, lay.index_key_dim, dtype=lay.dtype) + 7
            step.write(layer, torch.full((len(batch), q, lay.row_dim), 7.0, dtype=lay.dtype),
                       keys if layer in lay.indexer_layers else None)
            step.gather(layer, torch.zeros(len(batch), q, lay.index_topk, dtype=torch.int64))
        m.abort_step()
        d.check()

    @precondition(lambda self: self.driver.manager.copies.num_pending > 0)
    @rule()
    def copy_fault(self) -> None:
        """The oldest pending copy fails: its owners end (as the engine ends them), the rest goes on."""
        d = self.driver
        m = d.manager

        def fail_once(kind: str) -> None:
            m.copies.fault_hook = None
            raise RuntimeError(f"injected {kind} copy failure")

        m.copies.fault_hook = fail_once
        try:
            m.poll()
        except CopyError as err:
            for rid in m.owners_of(err):
                d.finish(rid, failed=True)
                self.ended.add(rid)
        finally:
            m.copies.fault_hook = None
        d.poll()

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
        releasing = {r.request_id for r, _ in m.releasing}  # its sequence is registered once its memory frees
        assert set(m.prefix.tokens) <= set(d.refs) | set(d.queued) | releasing  # nothing kept for one that ended
        for rid, ref in d.refs.items():
            assert m.requests[rid].length == ref.length

    def teardown(self) -> None:
        if not hasattr(self, "driver"):
            return
        self.driver.drain()
        m = self.driver.manager
        m.check_invariants()
        m.prefix.evict_all()  # what stays cached after the last release goes too, its device copies after readers
        self.driver.poll()
        stats = m.stats()
        assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == 0
        assert m.pool.free_pages == m.pool.num_pages and m.host.used_pages == 0
        assert m.copies.num_pending == 0 and stats["kv_requests_releasing"] == 0


KVMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVManagerProperties = KVMachine.TestCase
