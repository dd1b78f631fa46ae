"""Exact-value tests of the three-step resolver, and agreement with a plain-Python reference."""

from __future__ import annotations

import random

import pytest
import torch

from dhisparse.kernels.resolver import HotCacheOverflowError, resolve


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_three_steps_exact_locations_lru_and_copy_list() -> None:
    # P = 4; pages 0 and 3 direct (arena pages 5 and 2); hot cache of 4 slots.
    res = resolve(
        positions=t([[1, 9, 13, 5, 9, -1, 7, 12]]),
        page_table=t([[5, -1, -1, 2]]),
        hot_pos=t([[9, -1, 6, 4]]),
        hot_stamp=t([[3, 0, 1, 2]]),
        hot_loc=t([[100, 101, 102, 103]]),
        stamp=10,
        page_rows=4,
    )
    assert res.locations.tolist() == [[21, 100, 9, 101, 100, -1, 102, 8]]
    assert res.steps.tolist() == [[1, 2, 1, 3, 2, 0, 3, 1]]
    # Misses 5, 7 (ascending) go to the empty slot 1, then the oldest stamp (slot 2); slot 0 was hit.
    assert res.hot_pos.tolist() == [[9, 5, 7, 4]]
    assert res.hot_stamp.tolist() == [[10, 10, 10, 2]]
    assert res.copy_request.tolist() == [0, 0]
    assert res.copy_position.tolist() == [5, 7]
    assert res.copy_slot.tolist() == [1, 2]
    assert res.copy_location.tolist() == [101, 102]
    assert res.counts.tolist() == [[3, 1, 2]]


def test_batch_ties_by_slot_index_and_hit_slots_are_never_evicted() -> None:
    res = resolve(
        positions=t([[12, 21, 20], [-1, 3, 0]]),
        page_table=t([[-1], [-1]]),
        hot_pos=t([[10, 11, 12], [-1, 3, -1]]),
        hot_stamp=t([[5, 5, 5], [0, 7, 0]]),
        hot_loc=t([[0, 1, 2], [3, 4, 5]]),
        stamp=8,
        page_rows=2,
    )
    # Request 0: 12 hits slot 2 (protected); 20, 21 evict the tied slots 0, 1 in slot order.
    # Request 1: 3 hits slot 1; 0 takes the first empty slot, 0.
    assert res.locations.tolist() == [[2, 1, 0], [-1, 4, 3]]
    assert res.steps.tolist() == [[2, 3, 3], [0, 2, 3]]
    assert res.hot_pos.tolist() == [[20, 21, 12], [0, 3, -1]]
    assert res.hot_stamp.tolist() == [[8, 8, 8], [8, 8, 0]]
    assert res.copy_request.tolist() == [0, 0, 1]
    assert res.copy_position.tolist() == [20, 21, 0]
    assert res.copy_slot.tolist() == [0, 1, 0]
    assert res.copy_location.tolist() == [0, 1, 3]
    assert res.counts.tolist() == [[0, 1, 2], [0, 1, 1]]


def test_empty_slots_before_old_stamps_and_direct_before_hot() -> None:
    res = resolve(
        positions=t([[6, 2]]),
        page_table=t([[-1, 7]]),  # page 1 = rows 2..3 direct at arena page 7
        hot_pos=t([[2, -1, 5]]),
        hot_stamp=t([[0, 9, 1]]),
        hot_loc=t([[40, 41, 42]]),
        stamp=11,
        page_rows=2,
    )
    # 2 is direct even though slot 0 holds it: slot 0 keeps its stamp. 6 misses -> empty slot 1.
    assert res.locations.tolist() == [[41, 14]]
    assert res.steps.tolist() == [[3, 1]]
    assert res.hot_pos.tolist() == [[2, 6, 5]]
    assert res.hot_stamp.tolist() == [[0, 11, 1]]


def test_overflow_names_the_fix() -> None:
    with pytest.raises(HotCacheOverflowError, match="hot_rows"):
        resolve(t([[1, 2, 3]]), t([[-1, -1]]), t([[-1, -1]]), t([[0, 0]]), t([[0, 1]]), 1, 4)
    # A hit slot is not evictable: 2 slots, one hit, two misses -> overflow.
    with pytest.raises(HotCacheOverflowError):
        resolve(t([[1, 2, 3]]), t([[-1]]), t([[1, -1]]), t([[0, 0]]), t([[0, 1]]), 1, 4)


def test_lru_over_successive_steps() -> None:
    hot_pos, hot_stamp, hot_loc = t([[-1, -1]]), t([[0, 0]]), t([[10, 11]])
    seen = []
    for stamp, pos in enumerate([[4], [5], [4], [6], [5]], start=1):
        res = resolve(t([pos]), t([[-1]]), hot_pos, hot_stamp, hot_loc, stamp, 8)
        hot_pos, hot_stamp = res.hot_pos, res.hot_stamp
        seen.append((res.steps.tolist()[0][0], hot_pos.tolist()[0]))
    # 4->slot0, 5->slot1, 4 hit, 6 evicts LRU slot1 (5), 5 evicts LRU slot0 (4).
    assert seen == [(3, [4, -1]), (3, [4, 5]), (2, [4, 5]), (3, [4, 6]), (3, [5, 6])]


def reference_resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows):
    """Plain-Python statement of the resolver's semantics, one request at a time."""
    out_loc, out_step, copies = [], [], []
    new_pos, new_stamp = [list(r) for r in hot_pos], [list(r) for r in hot_stamp]
    for r, row in enumerate(positions):
        loc_of, step_of, misses, hit_slots = {}, {}, [], set()
        for p in sorted({p for p in row if p >= 0}):
            i = p // page_rows
            if i < len(page_table[r]) and page_table[r][i] >= 0:
                loc_of[p], step_of[p] = page_table[r][i] * page_rows + p % page_rows, 1
            elif p in hot_pos[r]:
                j = hot_pos[r].index(p)
                loc_of[p], step_of[p] = hot_loc[r][j], 2
                new_stamp[r][j] = stamp
                hit_slots.add(j)
            else:
                misses.append(p)
        candidates = [j for j in range(len(hot_pos[r])) if j not in hit_slots]
        candidates.sort(key=lambda j: (-1 if hot_pos[r][j] < 0 else hot_stamp[r][j], j))
        if len(misses) > len(candidates):
            raise HotCacheOverflowError("overflow")
        for p, j in zip(misses, candidates, strict=False):
            loc_of[p], step_of[p] = hot_loc[r][j], 3
            new_pos[r][j], new_stamp[r][j] = p, stamp
            copies.append((r, p, j, hot_loc[r][j]))
        out_loc.append([loc_of.get(p, -1) for p in row])
        out_step.append([step_of.get(p, 0) for p in row])
    return out_loc, out_step, new_pos, new_stamp, copies


@pytest.mark.parametrize("seed", range(40))
def test_matches_reference_on_random_multi_step_inputs(seed: int) -> None:
    rng = random.Random(seed)
    num_requests, page_rows = rng.randint(1, 4), rng.choice([1, 2, 4])
    num_slots, length = rng.randint(0, 8), rng.randint(1, 40)
    num_pages = -(-length // page_rows)
    page_table = [[rng.choice([-1, -1, rng.randint(0, 50)]) for _ in range(num_pages)] for _ in range(num_requests)]
    hot_pos = [[-1] * num_slots for _ in range(num_requests)]
    hot_stamp = [[0] * num_slots for _ in range(num_requests)]
    hot_loc = [[1000 + r * 100 + j for j in range(num_slots)] for r in range(num_requests)]
    for stamp in range(1, 6):
        n = rng.randint(0, 12)
        positions = [[rng.choice([-1, rng.randrange(length)]) for _ in range(n)] for _ in range(num_requests)]
        try:
            expected = reference_resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
        except HotCacheOverflowError:
            with pytest.raises(HotCacheOverflowError):
                resolve(t(positions).reshape(num_requests, n), t(page_table), t(hot_pos).reshape(
                    num_requests, num_slots), t(hot_stamp).reshape(num_requests, num_slots),
                    t(hot_loc).reshape(num_requests, num_slots), stamp, page_rows)
            return
        res = resolve(
            t(positions).reshape(num_requests, n),
            t(page_table),
            t(hot_pos).reshape(num_requests, num_slots),
            t(hot_stamp).reshape(num_requests, num_slots),
            t(hot_loc).reshape(num_requests, num_slots),
            stamp,
            page_rows,
        )
        loc, step, new_pos, new_stamp, copies = expected
        assert res.locations.tolist() == loc
        assert res.steps.tolist() == step
        assert res.hot_pos.tolist() == new_pos
        assert res.hot_stamp.tolist() == new_stamp
        got = list(zip(res.copy_request.tolist(), res.copy_position.tolist(), res.copy_slot.tolist(),
                       res.copy_location.tolist(), strict=True))
        assert got == copies
        hot_pos, hot_stamp = new_pos, new_stamp


def test_inputs_are_not_modified() -> None:
    args = [t([[3, 1]]), t([[-1, -1]]), t([[1, -1]]), t([[2, 0]]), t([[7, 8]])]
    before = [a.clone() for a in args]
    resolve(*args, stamp=5, page_rows=2)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_leading_dimensions_resolve_each_row_on_its_own(seed: int) -> None:
    """``[B, G, ...]`` inputs (a step's index group) give, row by row, what the 2-D call gives, with and without
    staging."""
    rng = random.Random(seed)
    batch, groups, page_rows, slots, length, n = 3, 2, 4, 5, 40, 9
    pages = length // page_rows
    page_table = t([[[rng.choice([-1, rng.randint(0, 50)]) for _ in range(pages)] for _ in range(groups)]
                    for _ in range(batch)])
    hot_pos = torch.stack([torch.randperm(length, generator=torch.Generator().manual_seed(seed * 10 + i))[:slots]
                           for i in range(batch * groups)]).view(batch, groups, slots)
    hot_pos[0, 0, 0] = -1
    hot_stamp = torch.randint(0, 5, (batch, groups, slots), generator=torch.Generator().manual_seed(seed))
    hot_loc = torch.arange(batch * groups * slots).view(batch, groups, slots) + 100
    positions = t([[rng.choice([-1, rng.randrange(length)]) for _ in range(n)] for _ in range(batch)])
    positions = positions.unsqueeze(1).expand(batch, groups, n)
    staging = torch.arange(batch * groups * 4).view(batch, groups, 4) + 500
    for stage in (None, staging):
        got = resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, 9, page_rows, stage, on_device=True)
        flat = [x.reshape(batch * groups, -1) for x in (positions, page_table, hot_pos, hot_stamp, hot_loc)]
        want = resolve(*flat, 9, page_rows, None if stage is None else stage.reshape(batch * groups, -1),
                       on_device=True)
        for name in ("locations", "hot_pos", "hot_stamp", "counts", "staged", "overflow", "fetch_mask"):
            a, b = getattr(got, name), getattr(want, name)
            assert torch.equal(a.reshape(b.shape), b), name
