"""The CPU build of the shared C++ resolver agrees exactly with the Python specification.

Random multi-step traces of several requests (with verification-query unions, duplicates, unused entries,
pages becoming ready or reclaimed between steps, and hot slots holding rows that became direct) are
resolved by both ``dhisparse.kernels.resolver.resolve`` and ``dhisparse.kernels.native.resolve``; every output must be
identical, step after step.
"""

from __future__ import annotations

import pytest
import torch

from dhisparse.kernels import native
from dhisparse.kernels.resolver import HotCacheOverflowError, Resolution, resolve

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason=f"native CPU library not built ({native.library_path()}); run scripts/setup_native.sh",
)

FIELDS = (
    "locations", "steps", "hot_pos", "hot_stamp", "copy_request", "copy_position", "copy_slot",
    "copy_location", "counts",
)  # fmt: skip


def assert_same(expected: Resolution, got: Resolution) -> None:
    for name in FIELDS:
        a, b = getattr(expected, name), getattr(got, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name}: python {a.tolist()} != native {b.tolist()}"


def random_trace(seed: int, steps: int = 12) -> int:
    """Runs one trace; returns how many steps overflowed (both sides must agree on those too)."""
    g = torch.Generator().manual_seed(seed)

    def ints(low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=g, dtype=torch.int64)

    requests = int(ints(1, 6))
    page_rows = int(ints(1, 9))
    num_pages = int(ints(1, 10))
    queries = int(ints(1, 5))  # gamma + 1 verification queries
    topk = int(ints(1, 9))
    hot_rows = int(ints(1, queries * topk + 4))  # sometimes too small: overflow must agree as well
    history = num_pages * page_rows
    hot_pos = torch.full((requests, hot_rows), -1, dtype=torch.int64)
    hot_stamp = ints(0, 3, requests, hot_rows)  # empty slots' stamps must be ignored
    hot_loc = torch.randperm(requests * hot_rows * 3, generator=g)[: requests * hot_rows].view(
        requests, hot_rows
    )
    overflows = 0
    for step in range(steps):
        ready = ints(0, 3, requests, num_pages) == 0
        ready[:, -1] = True  # the tail page is always direct
        arena_pages = 1000 + torch.randperm(requests * num_pages, generator=g).view(requests, num_pages)
        page_table = torch.where(ready, arena_pages, -1)
        positions = ints(0, history, requests, queries * topk)
        positions[ints(0, 5, requests, queries * topk) == 0] = -1
        stamp = 10 + step
        try:
            expected = resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
        except HotCacheOverflowError:
            with pytest.raises(HotCacheOverflowError, match="hot_rows"):
                native.resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
            overflows += 1
            continue
        got = native.resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
        assert_same(expected, got)
        hot_pos, hot_stamp = expected.hot_pos, expected.hot_stamp
    return overflows


@pytest.mark.parametrize("block", range(6))
def test_random_traces_agree(block: int) -> None:
    overflowed = sum(random_trace(seed) for seed in range(block * 40, block * 40 + 40))
    assert overflowed < 40 * 12  # most steps resolve; the comparison above is not vacuous


def test_exact_case_of_the_specification() -> None:
    """The spec's first exact-value case, through the native library."""
    def t(v: list) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64)

    res = native.resolve(
        t([[1, 9, 13, 5, 9, -1, 7, 12]]), t([[5, -1, -1, 2]]), t([[9, -1, 6, 4]]), t([[3, 0, 1, 2]]),
        t([[100, 101, 102, 103]]), 10, 4,
    )  # fmt: skip
    assert res.locations.tolist() == [[21, 100, 9, 101, 100, -1, 102, 8]]
    assert res.steps.tolist() == [[1, 2, 1, 3, 2, 0, 3, 1]]
    assert res.hot_pos.tolist() == [[9, 5, 7, 4]]
    assert res.hot_stamp.tolist() == [[10, 10, 10, 2]]
    assert res.copy_position.tolist() == [5, 7]
    assert res.copy_slot.tolist() == [1, 2]
    assert res.counts.tolist() == [[3, 1, 2]]


def test_inputs_are_not_modified() -> None:
    hot_pos = torch.tensor([[3, -1]])
    hot_stamp = torch.tensor([[1, 0]])
    native.resolve(
        torch.tensor([[3, 8]]), torch.tensor([[-1]]), hot_pos, hot_stamp, torch.tensor([[0, 1]]), 5, 4
    )
    assert hot_pos.tolist() == [[3, -1]] and hot_stamp.tolist() == [[1, 0]]


def test_copy_grid_rule() -> None:
    assert [native.copy_grid_blocks(b) for b in (1, 16, 17, 64, 128, 4096)] == [4, 4, 5, 16, 32, 32]
