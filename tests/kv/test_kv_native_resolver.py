"""The KV step's native CPU resolution (``kernels="auto"`` on a CPU device): the step resolves a source, or an index
group's sources, with one call of ``libdhisparse_cpu.so`` (the resolver shared with the CUDA kernel) instead of
dozens of torch operations. Checked here: the selection and its start-up self-check, the failed-check fallback,
the deferred overflow check, and whole engine runs against the torch resolver — same greedy tokens and the same
residency statistics (direct / hot / host rows) on random prompts of irregular lengths, with host fetches.
The KV-level property test (tests/kv/test_kv_properties.py) and the per-step host-read test draw the native path
too."""

from __future__ import annotations

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager
from tiny_models import build_spec_engine, make_checkpoint, random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.kernels import native
from dhisparse.kernels.resolver import HotCacheOverflowError
from dhisparse.kernels.selection import check_native_resolver, select_kernels
from dhisparse.kernels.self_check import CheckResult

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU library not built (setup_native.sh)")


def test_auto_on_cpu_resolves_natively_after_its_self_check() -> None:
    sel = select_kernels("auto", "cpu")
    assert sel.native_resolver is not None and sel.name == "torch" and not sel.on_device
    assert sel.self_check and all(r.ok for r in sel.self_check)
    assert sel.stats()["kernels_native_resolver"] == 1.0
    assert select_kernels("torch", "cpu").native_resolver is None  # torch means the torch resolver
    assert all(r.ok for r in check_native_resolver(native.load(), seed=3))


def test_a_failed_self_check_falls_back_to_the_torch_resolver(caplog) -> None:
    bad = [CheckResult("resolver", "R=1", "locations differ at [0, 0]")]
    sel = select_kernels("auto", "cpu", native_check=lambda lib: bad)
    assert sel.native_resolver is None and "self-check failed" in sel.reason
    assert "disagrees" in caplog.text


@pytest.mark.parametrize("native_path", [False, True], ids=["torch-resolver", "native-resolver"])
def test_a_hot_cache_overflow_is_raised_at_the_end_of_the_step(native_path) -> None:
    """A selection wider than the hot cache (six distinct missing positions, four hot-cache rows, no staging):
    both resolvers flag the overflow and the step raises it when its report is read, not at the resolution."""
    m = make_manager(make_layout("deepseek"), "hisparse", 1 << 20, hot_rows=4, page_rows=2, native=native_path)
    d = KVDriver(m)
    assert d.submit("a", 14, 4)
    m.poll()
    step = m.begin_step(["a"], 1)
    step.gather(0, torch.tensor([[[0, 2, 4, 6, 8, 10]]]))
    assert m.sync.reads == 0
    with pytest.raises(HotCacheOverflowError):
        m.end_step({"a": 1})


def _step_state(num_slots: int = 3, sources: int = 2, pages: int = 4, page_rows: int = 4, hot_rows: int = 3):
    """A small batch state: pages 0 and 1 of every (slot, source) in the arena, the rest only on the host."""
    table = torch.full((num_slots, sources, pages), -1, dtype=torch.int64)
    table[:, :, :2] = torch.arange(num_slots * sources * 2).view(num_slots, sources, 2)
    hot_pos = torch.full((num_slots, sources, hot_rows), -1, dtype=torch.int64)
    hot_stamp = torch.zeros_like(hot_pos)
    hot_loc = 1000 + torch.arange(hot_pos.numel()).view_as(hot_pos)
    host_pages = 100 + torch.arange(num_slots * sources * pages).view(num_slots, sources, pages)
    return table, hot_pos, hot_stamp, hot_loc, host_pages


def _resolve_step(positions, lengths, slots, state, sources=(0, 1), page_rows=4, host=True, direct=False):
    table, hot_pos, hot_stamp, hot_loc, host_pages = state
    counts = torch.zeros(len(slots), 3, dtype=torch.int64)
    out = native.resolve_step(native.load(), torch.tensor(positions), torch.tensor(lengths), torch.tensor(sources),
                              torch.tensor(slots), table[[min(s, len(table) - 1) for s in slots]], hot_pos,
                              hot_stamp, hot_loc, host_pages if host else None, counts, 5, page_rows,
                              direct_only=direct)
    return out, counts


def test_step_resolution_reads_and_updates_the_slots_of_the_batch_state() -> None:
    """Requests in slots 2 and 0 (in that order): direct rows from the page-table snapshot, misses copied from
    each slot's host pages into its hot cache, counts per request, the other slot untouched."""
    state = _step_state()
    table, hot_pos, hot_stamp, hot_loc, host_pages = state
    out, counts = _resolve_step([[1, 9, -1], [12, 12, 5]], [16, 16], [2, 0], state)
    assert out.flags == 0
    # Request 0 (slot 2), source 0: position 1 direct (page 0 → arena page table[2, 0, 0]), 9 a miss → hot slot 0.
    assert out.locations[0, 0].tolist() == [int(table[2, 0, 0]) * 4 + 1, int(hot_loc[2, 0, 0]), -1]
    assert out.locations[0, 1].tolist() == [int(hot_loc[0, 0, 0])] * 2 + [int(table[0, 0, 1]) * 4 + 1]
    assert hot_pos[2, :, 0].tolist() == [9, 9] and hot_pos[0, :, 0].tolist() == [12, 12]
    assert (hot_pos[1] == -1).all() and (hot_stamp[1] == 0).all()  # slot 1 is not in the step
    assert hot_stamp[2, 0, 0] == 5
    assert counts.tolist() == [[2, 0, 2], [2, 0, 2]]  # [direct, hot, host] summed over the two sources
    assert out.fetch_count == [2, 2]
    want_src = [int(host_pages[2, 0, 2]) * 4 + 1, int(host_pages[0, 0, 3]) * 4]
    assert out.fetch_src[0, :2].tolist() == want_src
    assert out.fetch_dst[0, :2].tolist() == [int(hot_loc[2, 0, 0]), int(hot_loc[0, 0, 0])]
    again, counts = _resolve_step([[9, -1, -1], [12, -1, -1]], [16, 16], [2, 0], state)  # now hot hits
    assert again.fetch_count == [0, 0] and counts.tolist() == [[0, 2, 0], [0, 2, 0]]


def test_step_resolution_flags_bad_positions_overflow_and_rows_without_a_host_copy() -> None:
    state = _step_state()
    before = [t.clone() for t in state]
    out, counts = _resolve_step([[1, 16]], [16], [1], state)  # position 16 is at the length: nothing resolved
    assert out.flags == native.STEP_BAD_POSITION and (out.locations == -1).all() and out.fetch_count == [0, 0]
    assert all(torch.equal(a, b) for a, b in zip(state, before, strict=True)) and not counts.any()
    out, _ = _resolve_step([[8, 9, 10, 11]], [16], [1], state)  # four misses, three hot rows
    assert out.flags & native.STEP_HOT_CACHE_OVERFLOW and (out.locations == -1).all()
    assert torch.equal(state[1], before[1])  # an overflowing row keeps its hot state
    state[4][1, 1, 2] = -1  # page 2 of slot 1, source 1 was never backed up
    out, _ = _resolve_step([[9]], [16], [1], state)
    assert out.flags == native.STEP_NO_HOST_COPY and out.fetch_count == [1, 0]
    out, _ = _resolve_step([[9]], [16], [1], _step_state(), host=False)  # no host store at all
    assert out.flags == native.STEP_NO_HOST_COPY


def test_direct_step_resolution_looks_pages_up_and_leaves_the_hot_cache_alone() -> None:
    """``direct_only`` (a step whose whole history is direct): page-table locations, distinct valid positions counted
    as direct per request and source, no copies, the hot state untouched; an unmapped page is flagged, not fetched."""
    state = _step_state()
    table, hot_pos, hot_stamp = state[0], state[1], state[2]
    before = (hot_pos.clone(), hot_stamp.clone())
    out, counts = _resolve_step([[1, 6, 6, -1], [7, 0, -1, -1]], [16, 16], [2, 0], state, direct=True)
    assert out.flags == 0 and out.fetch_count == [0, 0]
    for g in range(2):
        assert out.locations[g, 0].tolist() == [int(table[2, g, 0]) * 4 + 1, int(table[2, g, 1]) * 4 + 2,
                                                int(table[2, g, 1]) * 4 + 2, -1]
        assert out.locations[g, 1].tolist() == [int(table[0, g, 1]) * 4 + 3, int(table[0, g, 0]) * 4, -1, -1]
    assert counts.tolist() == [[4, 0, 0], [4, 0, 0]]  # two distinct positions each, two sources
    assert torch.equal(hot_pos, before[0]) and torch.equal(hot_stamp, before[1])
    out, counts = _resolve_step([[1, 9]], [16], [1], state, direct=True)  # page 2 is not in the arena
    assert out.flags == native.STEP_UNMAPPED and out.locations[0, 0, 1] == -1 and out.fetch_count == [0, 0]
    assert torch.equal(hot_pos, before[0])


@pytest.mark.parametrize("query_len", [1, 3])
def test_native_step_setup_gives_the_torch_set_up(query_len) -> None:
    """``StepKV``'s set-up by the library (``native.step_setup``) against the torch set-up on the same state:
    starts, lengths, the page-table snapshot, the new rows each source's write goes to and the indexer keys'
    pages and offsets — requests of different lengths in scattered, out-of-order slots."""
    from dhisparse.kv.residency import map_tail_pages
    from dhisparse.kv.resolution import NativeResolution, TorchResolution
    from dhisparse.kv.step import StepKV

    m = make_manager(make_layout("glm"), "adaptive", 1 << 20, page_rows=4, max_query_len=3, native=True)
    d = KVDriver(m)
    for rid, n in (("a", 5), ("b", 11), ("c", 2), ("d", 8)):
        assert d.submit(rid, n, 6)
    m.release("a")  # slot 0 free: the others sit in slots 1..3
    m.poll()
    reqs = [m.requests[r] for r in ("d", "b", "c")]
    for req in reqs:  # what begin_step does before building the step
        map_tail_pages(req, req.length + query_len - 1, 4, m.copies, m.fence)
    parts = m.step_parts()
    assert isinstance(m.resolution, NativeResolution)
    native_step = StepKV(parts, m.resolution, reqs, query_len, 1, m._report_buffer(len(reqs)))
    assert not native_step.flags.any()  # every new row's page is mapped
    torch_step = StepKV(parts, TorchResolution(), reqs, query_len, 1, m._report_buffer(len(reqs)))
    assert native_step.scatter is not None  # slots out of step order: the torch set-up gathers rows
    for name in ("starts", "lengths", "page_table"):
        assert torch.equal(getattr(native_step, name), getattr(torch_step, name)), name
    assert all(torch.equal(a, b) for a, b in zip(native_step.write_rows, torch_step.write_rows, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native_step.key_write[0], torch_step.key_write[0], strict=True))
    assert torch.equal(native_step.key_write[1], torch_step.key_write[1])
    assert native_step.max_length == torch_step.max_length
    with pytest.raises(ValueError, match="step_setup"):  # a slot past the batch state
        native.step_setup(native.load(), [4], [m.batch.num_slots], m.batch.page_table, m.batch.key_pages, 2, 1, 4, 2)


@pytest.mark.parametrize("bad", ["slot", "source", "layout", "dtype"])
def test_step_resolution_refuses_arguments_it_cannot_read_safely(bad) -> None:
    state = list(_step_state())
    slots, sources = [0], (0, 1)
    if bad == "slot":
        slots = [3]
    elif bad == "source":
        sources = (0, 2)
    elif bad == "layout":
        state[1] = state[1].transpose(1, 2)
    else:
        state[2] = state[2].int()
    with pytest.raises(ValueError, match="resolve_step"):
        _resolve_step([[1]], [16], slots, state, sources=sources)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native_step")
    return build_spec_engine(tmp, make_checkpoint(tmp, "glm_fsfs_sparse"), dtype="float32")


STATS = ("kv_rows_direct", "kv_rows_hot", "kv_rows_host", "kv_resolver_calls", "kv_host_syncs")


@pytest.mark.parametrize("policy, speculative, page_rows", [
    ("hisparse", None, 4), ("adaptive", None, 8), ("adaptive", "dflash2", 4), ("hisparse", "dspark", 8),
])
def test_engine_tokens_and_residency_match_the_torch_resolver(engine_dir, policy, speculative, page_rows) -> None:
    prompts = random_prompts([37, 203, 118, 5], 96, seed=page_rows + len(policy))
    params = SamplingParams(max_tokens=19, ignore_eos=True)
    runs = {}
    for kernels in ("torch", "auto"):
        llm = LLM(engine_dir, kernels=kernels, kv_policy=policy, page_rows=page_rows, pool_bytes=120_000,
                  speculative=speculative, max_batch_size=4)
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        runs[kernels] = ([o.token_ids for o in outs], {k: stats.get(k) for k in STATS},
                         stats["kv_kernels_native_resolver"])
    (torch_tokens, torch_stats, torch_native), (auto_tokens, auto_stats, auto_native) = runs["torch"], runs["auto"]
    assert (torch_native, auto_native) == (0.0, 1.0)
    assert auto_tokens == torch_tokens
    assert auto_stats == torch_stats
    assert auto_stats["kv_rows_host"] > 0  # the runs fetched from host: the fetch lists were exercised
