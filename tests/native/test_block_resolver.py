"""The resolver kernels' block code (``plugins/common/include/dhisparse/block_resolver.h``), run on the CPU by the
CPU library (``dhs_emulate_launch``: every block of the grid in turn, one thread), against the Python
specification and the CPU library's serial resolver.

What the GPU runs is this code with one thread block per row (its hash-table lookup, bitonic sorts, scan and
victim assignment); only the interleaving of threads is not exercised here (``scripts/gpu_check.py`` runs the
kernel itself against the CPU library on the same traces).
"""

from __future__ import annotations

import pytest
import torch

from dhisparse.kernels import abi, native
from dhisparse.kernels.reference import padded_resolution
from dhisparse.kernels.resolver import HotCacheOverflowError, resolve
from dhisparse.kernels.resolver_traces import expected_step, mismatch, step_outputs, step_trace
from dhisparse.kernels.self_check import resolver_case

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason=f"native CPU library not built ({native.library_path()}); run scripts/setup_native.sh",
)


def emulate_step(t, staged: bool = True) -> dict[str, torch.Tensor]:
    out = step_outputs(t, staged)
    stamp = torch.tensor([t.stamp])  # alive until the launch ran: the struct holds its address only
    args = abi.pack_step_resolver(stamp, t.positions, t.lengths, t.sources, t.slots,
                                  t.page_table, t.hot_pos, t.hot_stamp, t.hot_loc, t.host_pages, t.staging,
                                  t.page_rows, out)
    assert abi.emulate_launch(abi.KIND_STEP_RESOLVER, args) == abi.PLAN_OK
    return out


@pytest.mark.parametrize("miss_rate", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("sources,groups", [(1, 1), (30, 26)])
def test_step_resolver_block_code_equals_the_specification(miss_rate: float, sources: int, groups: int) -> None:
    for seed in range(3):
        t = step_trace(seed, batch=3 + seed, sources=sources, groups=groups, queries=1 + seed, topk=37 + 11 * seed,
                       hot_rows=160, miss_rate=miss_rate, page_rows=8 + seed)
        want = expected_step(t)
        union_misses = want.misses / max(want.union - int(want.counts[:, 0].sum()), 1)
        assert abs(union_misses - miss_rate) < 0.15  # the trace has the miss rate it was made for
        state = t.clone()
        got = emulate_step(state)
        assert mismatch(got, state, want) is None, mismatch(got, state, want)


@pytest.mark.parametrize("miss_rate", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("sources,groups", [(1, 1), (30, 26)])
def test_step_resolver_block_code_equals_the_cpu_library(miss_rate: float, sources: int, groups: int) -> None:
    lib = native.load()
    t = step_trace(7, batch=4, sources=sources, groups=groups, queries=2, topk=41, hot_rows=128,
                   miss_rate=miss_rate, page_rows=16)
    ours = t.clone()
    got = emulate_step(ours)
    theirs = t.clone()
    counts = torch.zeros(4, 3, dtype=torch.int64)
    out = native.resolve_step(lib, theirs.positions, theirs.lengths, theirs.sources, theirs.slots, theirs.page_table,
                              theirs.hot_pos, theirs.hot_stamp, theirs.hot_loc, theirs.host_pages, counts, t.stamp,
                              t.page_rows)
    assert out.flags == 0 and int(got["flags"][0]) == 0
    assert torch.equal(got["locations"], out.locations)
    assert torch.equal(got["counts"], counts)
    assert torch.equal(ours.hot_pos, theirs.hot_pos) and torch.equal(ours.hot_stamp, theirs.hot_stamp)
    for g in range(groups):
        src, dst = got["fetch_src"][g].reshape(-1), got["fetch_dst"][g].reshape(-1)
        assert torch.equal(src[src >= 0], out.fetch_src[g, : out.fetch_count[g]])
        assert torch.equal(dst[dst >= 0], out.fetch_dst[g, : out.fetch_count[g]])


def test_step_resolver_verification_staging_equals_the_specification() -> None:
    """Misses past the evictable slots go to staging rows (hot state unchanged for them), as ``resolve`` does."""
    for seed in range(4):
        t = step_trace(20 + seed, batch=3, sources=4, groups=2, queries=4, topk=30, hot_rows=24, miss_rate=0.5,
                       staging_rows=90)
        want = expected_step(t)
        assert int(want.staged.sum()) > 0  # the case is real: some rows go to staging
        state = t.clone()
        got = emulate_step(state)
        assert mismatch(got, state, want) is None, mismatch(got, state, want)


def test_step_resolver_flags_overflow_bad_positions_and_bad_slots() -> None:
    t = step_trace(3, batch=3, sources=2, groups=2, queries=3, topk=40, hot_rows=20, miss_rate=0.5)
    with pytest.raises(HotCacheOverflowError):
        expected_step(t)
    state = t.clone()
    got = emulate_step(state)
    assert int(got["flags"][0]) & native.STEP_HOT_CACHE_OVERFLOW
    assert torch.equal(state.hot_pos, t.hot_pos) and torch.equal(state.hot_stamp, t.hot_stamp)  # untouched
    t = step_trace(4, batch=3, sources=2, groups=1, queries=1, topk=20, hot_rows=64, miss_rate=0.1)
    t.positions[1, 3] = int(t.lengths[1])  # at the length: not a row of the history
    got = emulate_step(t)
    assert int(got["flags"][0]) == native.STEP_BAD_POSITION
    assert bool((got["locations"][0, 1] == -1).all()) and bool((got["fetch_src"][0, 1] == -1).all())
    t = step_trace(5, batch=2, sources=2, groups=1, queries=1, topk=20, hot_rows=64, miss_rate=0.1)
    t.slots[0] = 99
    got = emulate_step(t)
    assert int(got["flags"][0]) & 16 and bool((got["locations"][0, 0] == -1).all())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_batched_resolver_block_code_equals_the_specification(dtype: torch.dtype) -> None:
    """``ResolverArgs`` (the TensorRT plugin's resolver and the self-check's): padded outputs equal ``resolve``'s,
    including a row whose scratch exceeds shared memory (the global-workspace layout) and an overflowing row."""
    g = torch.Generator().manual_seed(11)
    for r, n, pages, page_rows, slots in ((3, 211, 17, 16, 260), (2, 1, 1, 1, 1), (2, 2500, 40, 64, 5000),
                                           (4, 90, 9, 7, 90)):
        case = resolver_case(g, r, n, pages, page_rows, slots)
        want = padded_resolution(resolve(*case, stamp=7, page_rows=page_rows), r, n)
        got = run_batched(case, page_rows, dtype)
        for name, value in want.items():
            assert torch.equal(got[name].long(), value.long()), name
    case = resolver_case(g, 2, 60, 4, 4, 60)
    case[2][1] = -1  # request 1: nothing direct, a tiny hot cache
    case = (*case[:2], case[2][:, :5].contiguous(), case[3][:, :5].contiguous(), case[4][:, :5].contiguous())
    got = run_batched(case, 4, dtype)
    assert int(got["summary"][1, 0]) == 1 and torch.equal(got["hot_pos"][1].long(), case[2][1])


def run_batched(case: tuple[torch.Tensor, ...], page_rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    positions, page_table, hot_pos, hot_stamp, hot_loc = (t.to(dtype) for t in case)
    r, n = positions.shape
    out = {"locations": torch.empty_like(positions), "steps": torch.empty(r, n, dtype=torch.int8),
           "hot_pos": torch.empty_like(hot_pos), "hot_stamp": torch.empty_like(hot_stamp),
           "copy_position": torch.empty_like(positions), "copy_slot": torch.empty_like(positions),
           "copy_location": torch.empty_like(positions), "summary": torch.zeros(r, 6, dtype=torch.int32)}
    stamp = torch.tensor([7], dtype=dtype)  # alive until the launch ran
    args = abi.pack_resolver(stamp, positions, page_table, hot_pos, hot_stamp, hot_loc, page_rows, out)
    assert abi.emulate_launch(abi.KIND_RESOLVER, args) == abi.PLAN_OK
    return out


def test_the_kernel_block_code_passes_the_engine_start_up_self_check() -> None:
    """What the engine runs before serving on a GPU, with the block code in place of the GPU: every check passes."""
    from dhisparse.kernels.emulated import EmulatedKernels
    from dhisparse.kernels.self_check import failures, run_self_check

    results = run_self_check(EmulatedKernels(), torch.device("cpu"), seed=4)
    assert "step_resolver" in {r.kernel for r in results} and failures(results) is None
