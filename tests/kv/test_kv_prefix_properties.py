"""Property tests focused on prefix reuse: the KV state machine of ``test_kv_properties.py`` with only token-driven
requests, host-store policies and pools where several requests run at once, so most admissions continue an earlier
sequence (hits of whole cached prefixes, ending mid-page and at page boundaries) while evictions, reclaims of shared
device copies, refills, aborted steps and failed copies interleave. Every operation is followed by the manager's
invariants (prefix cache included: reference counts, safe free, copy-on-write) and every gather and cached prefix is
checked against the rows the request's own tokens define (``kv_driver.py``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from kv_driver import KVDriver, make_layout, make_manager
from test_kv_properties import MAX_NEW, MAX_PROMPT, KVMachine

from dhisparse.kv.config import KVConfig
from dhisparse.kv.footprint import request_footprint

SYSTEM = [1, 2, 0, 1, 1, 2, 0, 0, 2, 1, 0, 2, 1]  # a shared "system prompt" (vocabulary of the driver: 0 .. 2)


class PrefixMachine(KVMachine):
    @initialize(
        policy=st.sampled_from(["hisparse", "adaptive"]),
        kind=st.sampled_from(["deepseek", "glm", "shared"]),
        pool_scale=st.sampled_from([2.2, 4.0, 12.0]),
        max_query_len=st.sampled_from([1, 2]),
        seed=st.integers(0, 10_000),
        native=st.booleans(),
        host_scale=st.sampled_from([2.5, 4.0, 50.0]),
    )
    def setup_prefix(self, policy: str, kind: str, pool_scale: float, max_query_len: int, seed: int, native: bool,
                     host_scale: float) -> None:
        layout = make_layout(kind)
        hot_rows = layout.index_topk + 2
        probe = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=hot_rows, page_rows=4,
                         max_query_len=max_query_len)
        fp = request_footprint(layout, probe, MAX_PROMPT, MAX_NEW)
        host_bytes = int(layout.num_sources * fp.num_pages * host_scale) * 4 * layout.row_bytes
        manager = make_manager(layout, policy, int(fp.required_bytes * pool_scale), hot_rows=hot_rows,
                               max_query_len=max_query_len, refill=2, native=native, host_bytes=host_bytes)
        self.driver = KVDriver(manager, seed=seed)
        self.max_query_len = max_query_len
        self.next_id = 0
        self.submitted: set[str] = set()
        self.ended: set[str] = set()

    @rule(new=st.integers(2, MAX_NEW), shared=st.integers(0, len(SYSTEM)), extra=st.integers(1, 8))
    def admit_tokens(self, new: int, shared: int, extra: int) -> None:  # type: ignore[override]
        """A request whose prompt starts with ``shared`` tokens of one system prompt (hits ending anywhere)."""
        d = self.driver
        self._submit_tokens(SYSTEM[:shared] + [d.rng.randrange(d.vocab) for _ in range(extra)], new)

    # Only token-driven admissions here (the parent's random-row admissions are not rules of this machine).
    def setup(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        raise AssertionError("not a rule of this machine")

    def admit(self, prompt: int, new: int) -> None:  # type: ignore[override]
        raise AssertionError("not a rule of this machine")

    def pressure(self) -> None:  # type: ignore[override]
        raise AssertionError("not a rule of this machine")


PrefixMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixReuseProperties = PrefixMachine.TestCase
