"""The step's checks are accumulated on the device and raised once its single host read sees them."""

from __future__ import annotations

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv.config import KVLayout


def test_a_bad_position_is_reported_at_the_end_of_the_step() -> None:
    m = make_manager(make_layout("deepseek"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 6, 4)
    step = m.begin_step(["a"], 1)
    step.gather(0, torch.tensor([[[9, -1, -1, -1]]]))  # past the length: not read here
    assert m.sync.reads == 0
    with pytest.raises(ValueError, match="past the request's length"):
        m.end_step({"a": 1})
    assert m.sync.reads == 1


@pytest.mark.parametrize("layers", [2, 12])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("query_len", [1, 3])
@pytest.mark.parametrize("native", [False, True], ids=["torch-resolver", "native-resolver"])
def test_a_step_reads_the_host_once_whatever_the_layers_and_requests(layers, batch, query_len, native) -> None:
    """Decode (Q=1) and verification (Q=3) steps with host fetches: exactly one counted read per step."""
    layout = KVLayout(layers, list(range(layers)), 5, torch.float32, list(range(0, layers, 2)), 3, 4,
                      [[i, i + 1] for i in range(0, layers, 2)])
    m = make_manager(layout, "hisparse", 1 << 22, hot_rows=12, max_query_len=query_len, native=native)
    d = KVDriver(m, seed=layers + batch)
    for i in range(batch):
        assert d.submit(f"r{i}", 9 + i, 8)
    per_step = set()
    rows_host = 0.0
    for _ in range(3):
        before = m.sync.reads
        d.step(d.steppable(), query_len)
        per_step.add(m.sync.reads - before)
        d.poll()
        rows_host = m.stats()["kv_rows_host"]
    assert per_step == {1} and rows_host > 0
    d.drain()



@pytest.mark.parametrize("policy", ["resident", "adaptive"])
def test_all_direct_steps_resolve_like_the_full_resolver(policy, monkeypatch) -> None:
    """Steps whose whole history is direct skip to a page-table lookup: same rows (checked by the driver), same
    counts and hot-cache state as the three-step resolver."""
    from dhisparse.kv import step as step_module

    def run(fast: bool) -> tuple[dict[str, float], int, list[torch.Tensor]]:
        if not fast:
            monkeypatch.setattr(step_module, "_history_direct", lambda req: False)
        m = make_manager(make_layout("glm"), policy, 1 << 22, hot_rows=12, max_query_len=3)
        seen: list[bool] = []
        begin = m.begin_step

        def recording_begin(ids, q):
            step = begin(ids, q)
            seen.append(step.all_direct)
            return step
        m.begin_step = recording_begin
        d = KVDriver(m, seed=5)
        for i in range(3):
            assert d.submit(f"r{i}", 9 + 3 * i, 10)
        for _ in range(5):
            d.step(d.steppable(), 2)
            d.poll()
        stats = m.stats()
        monkeypatch.undo()
        names = ("kv_rows_direct", "kv_rows_hot", "kv_rows_host", "kv_resolver_calls")
        return {k: stats[k] for k in names}, sum(seen), [r.hot_pos.clone() for r in m.requests.values()]

    fast, fast_steps, fast_hot = run(True)
    full, full_steps, full_hot = run(False)
    assert fast == full and fast["kv_rows_direct"] > 0
    assert fast_steps > 0 and full_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(fast_hot, full_hot, strict=True))


def test_verification_staging_costs_no_extra_host_read() -> None:
    """Hot cache smaller than a verification step's union of selections: the overflow goes to staging through
    the same fixed-shape copy list, rows stay exact (the driver checks every gather), one read per step."""
    layout = KVLayout(4, list(range(4)), 5, torch.float32, [0, 2], 3, 4, [[0, 1], [2, 3]])
    m = make_manager(layout, "hisparse", 1 << 22, hot_rows=4, max_query_len=3)
    d = KVDriver(m, seed=5)
    for i in range(4):
        assert d.submit(f"r{i}", 11 + i, 8)
    per_step = set()
    for _ in range(3):
        before = m.sync.reads
        d.step(d.steppable(), 3)
        per_step.add(m.sync.reads - before)
        d.poll()
    assert per_step == {1} and m.stats()["kv_rows_staged"] > 0
    d.drain()


def test_abort_step_clears_the_deferred_checks() -> None:
    """A rolled-back step's device flags are cleared unread: abort raises nothing, counts nothing, and the next
    step of the same requests ends cleanly with its one read."""
    m = make_manager(make_layout("deepseek"), "hisparse", 100_000)
    d = KVDriver(m)
    assert d.submit("a", 6, 4)
    step = m.begin_step(["a"], 1)
    step.gather(0, torch.tensor([[[9, -1, -1, -1]]]))  # sets the bad-position flag on the device
    before = m.stats()
    m.abort_step()
    assert not bool(step.flags.any()) and int(step.counts.sum()) == 0
    assert m.stats()["kv_steps_aborted"] == before["kv_steps_aborted"] + 1
    assert m.stats()["kv_resolved_rows"] == before["kv_resolved_rows"]
    reads = m.sync.reads
    d.step(["a"], 1)
    assert m.sync.reads == reads + 1
    d.drain()
