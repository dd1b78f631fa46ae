"""Verification staging: rows of a step's union of selections that the hot cache cannot take are copied from host
into staging once, never evict a row another query of the step needs, and are read through one location vector."""

from __future__ import annotations

import pytest
import torch

from dhisparse.kernels.resolver import STEP_HOST, HotCacheOverflowError, resolve
from dhisparse.kv import KVConfig, KVLayout, KVManager
from dhisparse.kv.footprint import request_footprint


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_resolver_overflow_goes_to_staging_exact_values() -> None:
    # B = 3 slots; slot 0 holds 4 (hit this step), slots 1, 2 hold 7, 8 (not selected). Misses 1, 2, 3, 5, 6
    # (ascending): 1, 2 take the evictable slots 1, 2 (equal stamps: slot order); 3, 5, 6 go to staging rows.
    res = resolve(
        positions=t([[5, 1, 4, 3, 1, 6, 2, -1]]),
        page_table=t([[-1, -1]]),
        hot_pos=t([[4, 7, 8]]),
        hot_stamp=t([[1, 1, 1]]),
        hot_loc=t([[10, 11, 12]]),
        stamp=5,
        page_rows=4,
        staging_loc=t([[90, 91, 92, 93]]),
    )
    assert res.locations.tolist() == [[91, 11, 10, 90, 11, 92, 12, -1]]
    assert res.steps.tolist() == [[STEP_HOST, STEP_HOST, 2, STEP_HOST, STEP_HOST, STEP_HOST, STEP_HOST, 0]]
    # the hot cache is exactly what a cache of 3 slots would hold: the hit and the two smallest misses
    assert res.hot_pos.tolist() == [[4, 1, 2]]
    assert res.hot_stamp.tolist() == [[5, 5, 5]]
    assert res.copy_position.tolist() == [1, 2, 3, 5, 6]
    assert res.copy_slot.tolist() == [1, 2, -1, -1, -1]
    assert res.copy_location.tolist() == [11, 12, 90, 91, 92]
    assert res.counts.tolist() == [[0, 1, 5]]
    assert res.staged.tolist() == [3]


def test_resolver_staging_too_small_names_the_fix() -> None:
    with pytest.raises(HotCacheOverflowError, match="1 staging rows"):
        resolve(t([[0, 1, 2]]), t([[-1]]), t([[-1]]), t([[0]]), t([[0]]), 1, 4, staging_loc=t([[9]]))


def _layout() -> KVLayout:
    return KVLayout(num_layers=4, source_of_layer=(0, 1, 2, 3), row_dim=4, dtype=torch.float64,
                    indexer_layers=(0, 2), index_key_dim=2, index_topk=4, index_groups=((0, 1), (2, 3)))


def test_overflow_rows_are_fetched_into_staging_once_and_evict_nothing_needed() -> None:
    layout = _layout()
    # B = index_topk = 4, five verification queries: up to 20 distinct rows, 16 of them staged
    config = KVConfig(policy="hisparse", pool_bytes=1 << 20, hot_rows=4, page_rows=4, max_query_len=5)
    m = KVManager(layout, config, torch.device("cpu"), poison_freed=True)
    assert config.staging_rows(layout) == 16 and layout.staging_slots == 2
    prompt = 40
    rows = torch.randn(4, prompt, 4, dtype=torch.float64)
    assert m.try_admit("r", prompt, 8)
    m.import_prompt("r", rows, {0: torch.randn(prompt, 2, dtype=torch.float64),
                                2: torch.randn(prompt, 2, dtype=torch.float64)})
    m.poll()  # hisparse: the prompt lives on host only
    new = torch.randn(1, 5, 4, dtype=torch.float64)
    # 12 distinct history rows over five queries; rows 0 and 1 are selected by every query
    selection = t([[[0, 1, 2, 3], [0, 1, 5, 6], [0, 1, 7, 8], [0, 1, 9, 10], [0, 1, 11, 12]]])
    before = m.stats()
    step = m.begin_step(["r"], 5)
    got = {}
    for layer in range(4):
        keys = torch.randn(1, 5, 2, dtype=torch.float64) if layer in (0, 2) else None
        step.write(layer, new, keys)
        got[layer] = step.gather(layer, selection)
    m.end_step({"r": 5})
    after = m.stats()
    distinct = 12
    fetched = after["kv_host_fetched_rows"] - before["kv_host_fetched_rows"]
    assert fetched == 4 * distinct  # once per row and source although rows 0 and 1 are selected five times
    assert after["kv_rows_staged"] - before["kv_rows_staged"] == 4 * (distinct - 4)
    assert after["kv_resolver_calls"] - before["kv_resolver_calls"] == 4
    for layer in range(4):  # each layer read its own source's rows (staging slots reused by the next group)
        assert torch.equal(got[layer][0], rows[layer][selection[0]])
    # the hot cache of every source holds the 4 smallest misses: what a cache of B rows would keep
    for s in range(4):
        assert sorted(m.requests["r"].hot_pos[s].tolist()) == [0, 1, 2, 3]
    m.check_invariants()
    m.release("r")
    m.poll()
    m.check_invariants()


def test_shared_source_in_two_groups_is_resolved_again_after_its_staging_slot_is_reused() -> None:
    # layers 0 and 2 lead groups; layer 3 reads source 0 like layer 0, whose overflow rows sit in staging slot 0;
    # group 1 reuses slot 0 for source 2, so source 0 must be resolved again (into slot 1) for layer 3.
    layout = KVLayout(num_layers=4, source_of_layer=(0, 1, 2, 0), row_dim=4, dtype=torch.float64,
                      indexer_layers=(0, 2), index_key_dim=2, index_topk=2, index_groups=((0, 1), (2, 3)))
    config = KVConfig(policy="hisparse", pool_bytes=1 << 20, hot_rows=2, page_rows=4, max_query_len=3)
    m = KVManager(layout, config, torch.device("cpu"), poison_freed=True)
    prompt = 24
    rows = torch.randn(3, prompt, 4, dtype=torch.float64)
    assert m.try_admit("r", prompt, 4)
    m.import_prompt("r", rows, {0: torch.randn(prompt, 2, dtype=torch.float64),
                                2: torch.randn(prompt, 2, dtype=torch.float64)})
    m.poll()
    step = m.begin_step(["r"], 3)
    new = torch.randn(1, 3, 4, dtype=torch.float64)
    selection = t([[[0, 1], [2, 3], [4, 5]]])
    out = {}
    for layer in range(4):
        step.write(layer, new, torch.randn(1, 3, 2, dtype=torch.float64) if layer in (0, 2) else None)
        out[layer] = step.gather(layer, selection)
    m.end_step({"r": 3})
    # layer 3 reads source 0 (staged in slot 0 by group 0, then slot 0 was reused by source 2)
    assert torch.equal(out[3][0], rows[0][selection[0]])
    assert torch.equal(out[2][0], rows[2][selection[0]])
    m.release("r")
    m.poll()
    m.check_invariants()


@pytest.mark.parametrize("policy", ["resident", "hisparse", "adaptive"])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_required_bytes_with_speculation_are_without_plus_ring_plus_staging(policy: str, gamma: int) -> None:
    layout = _layout()
    ring = 1234
    plain = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=4, page_rows=4)
    spec = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=4, page_rows=4, max_query_len=gamma + 1,
                    draft_ring_bytes=ring)
    for prompt, new in ((1, 1), (7, 9), (40, 8), (41, 3)):
        a = request_footprint(layout, plain, prompt, new)
        b = request_footprint(layout, spec, prompt, new)
        assert a.speculative_bytes == 0
        staging_rows = 0 if policy == "resident" else (gamma + 1) * 4 - 4
        assert b.staging_overflow_bytes == 2 * -(-staging_rows // 4) * 4 * layout.row_bytes
        # the block's own rows: tail pages (host-backed: one more ring page whenever gamma spans one) and the
        # gamma extra positions' indexer-key pages (keys of one layer per arena page: kv/index_keys.py) /
        # page-table entries
        pages_a, pages_b = -(-(prompt + new) // 4), -(-(prompt + new + gamma) // 4)
        per_page = 4 * layout.row_bytes // layout.index_key_bytes
        key_pages = 2 * (-(-(prompt + new + gamma) // per_page) - -(-(prompt + new) // per_page))
        extra_tail = (pages_b - pages_a) if policy == "resident" else (
            min(-(-(3 + gamma + 1) // 4) + 1, pages_b) - min(2, pages_a))
        block = 4 * extra_tail * 4 * layout.row_bytes + 4 * (pages_b - pages_a) * 8 + key_pages * 4 * layout.row_bytes
        assert b.staging_block_bytes == block
        assert b.required_bytes == a.required_bytes + ring + b.staging_bytes
        assert b.speculative_bytes == ring + b.staging_bytes
