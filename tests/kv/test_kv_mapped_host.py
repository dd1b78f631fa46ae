"""The host fetch as one gather from a view of the host store on the arena's device (``kv/mapped_host.py``).

On CPU the view spans the store's own chunks and every copy out of the host store takes it, so these tests run the
index arithmetic and gather the GPU runs (there with the pinned store mapped into the device's address space). The
CUDA-only test checks that the mapped view is made on CUDA, aliases the pinned memory and never reads the fetch
list on the host; it is skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.host_values import HostSync
from dhisparse.kv.copies import CopyEngine
from dhisparse.kv.host_store import ChunkedRows

CPU = torch.device("cpu")


def _filled(capacity: int, chunk_rows: int, rows: int, dtype: torch.dtype, seed: int = 0,
            pinned: bool = False) -> tuple[ChunkedRows, torch.Tensor]:
    store = ChunkedRows(capacity, chunk_rows, 7, dtype, pinned=pinned)
    store.ensure(rows)
    dense = (torch.randn(rows, 7, generator=torch.Generator().manual_seed(seed)) * 50).to(dtype)
    store.index_copy_(0, torch.arange(rows), dense)
    return store, dense


@pytest.mark.parametrize("chunk_rows", [64, 8, 5])  # one chunk; several; a short last chunk (45 = 9 × 5)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_mapped_gather_equals_the_rows_with_one_and_several_chunks(chunk_rows, dtype) -> None:
    store, dense = _filled(45, chunk_rows, 45, dtype)
    assert len(store.chunks) == -(-45 // chunk_rows)
    view = store.mapped(CPU)
    assert view is not None and view.device == CPU
    boundaries = torch.tensor([r for k in range(1, len(store.chunks)) for r in (k * chunk_rows - 1, k * chunk_rows)],
                              dtype=torch.int64)
    index = torch.cat([boundaries, torch.randint(0, 45, (257,), generator=torch.Generator().manual_seed(1)),
                       torch.tensor([0, 44])])
    assert torch.equal(view.gather(index), dense[index])
    assert torch.equal(view.gather(index), store.index_select(0, index))  # the host-side gather agrees
    for chunk in store.chunks:  # every chunk starts at a multiple of the row size (what the span needs)
        assert chunk.data_ptr() % (7 * chunk.element_size()) == 0


def test_a_new_chunk_is_in_the_view_made_after_it_and_the_old_rows_stay() -> None:
    store, dense = _filled(40, 8, 10, torch.float32)
    first = store.mapped(CPU)
    assert first is not None and first.allocated_rows == 16
    before = [c.data_ptr() for c in store.chunks]
    store.ensure(33)
    more = torch.randn(23, 7, generator=torch.Generator().manual_seed(2))
    store.index_copy_(0, torch.arange(10, 33), more)
    dense = torch.cat([dense, more])
    view = store.mapped(CPU)
    assert view is not first and view.allocated_rows == 40 and len(store.chunks) == 5
    assert [c.data_ptr() for c in store.chunks[:2]] == before  # growing never moves a chunk
    index = torch.tensor([7, 8, 15, 16, 23, 24, 31, 32, 0, 9])
    assert torch.equal(view.gather(index), dense[index])
    assert torch.equal(first.gather(torch.tensor([3, 12])), dense[[3, 12]])  # an older view still reads right


def test_a_fetch_copy_gathers_from_the_view_with_no_host_read() -> None:
    store, dense = _filled(45, 8, 45, torch.float32)
    sync = HostSync()
    copies = CopyEngine(CPU, sync)
    arena = torch.zeros(20, 7)
    src = torch.tensor([7, 8, 40, 16, 0, 44, 23, 24])
    dst = torch.tensor([3, 19, 0, 5, 7, 8, 1, 2])
    ticket = copies.issue("fetch", arena, dst, store, src)
    assert not torch.equal(arena[dst], dense[src])  # deferred: nothing visible before it is done
    copies.wait(ticket)
    assert torch.equal(arena[dst], dense[src])
    assert copies.mapped_copies == 1 and sync.reads == 0
    back = copies.issue("tail_backup", store, torch.tensor([1, 2]), arena, torch.tensor([3, 19]))
    copies.wait(back)  # device → host keeps its own path
    assert copies.mapped_copies == 1 and torch.equal(store.index_select(0, torch.tensor([1, 2])), dense[[7, 8]])


@pytest.mark.parametrize("policy", ["hisparse", "adaptive"])
def test_steps_fetch_through_the_view_across_chunks_and_read_the_host_once_per_step(policy) -> None:
    layout = make_layout("glm")
    probe = make_manager(layout, policy, 1 << 20)
    page_bytes = probe.pool.page_bytes
    # A small hot cache: selected rows miss and are fetched from the host; chunks of 3 pages: many chunks.
    m = make_manager(layout, policy, 1 << 20, hot_rows=4, host_chunk_bytes=3 * page_bytes)
    d = KVDriver(m, seed=5)  # checks every gather against its plain copy of the history
    for i in range(3):
        assert d.submit(f"r{i}", 23 + 5 * i, 10)
    d.poll()
    assert len(m.host.rows.chunks) > 1
    for _ in range(8):
        if not d.steppable():
            break
        before = m.sync.reads
        d.step(d.steppable(), 1)
        assert m.sync.reads - before <= 1  # the step's one report read, never a fetch list
        d.poll()
    stats = m.stats()
    assert stats["kv_rows_host"] > 0, "the test must fetch rows from the host store"
    assert m.copies.mapped_copies > 0
    d.drain()


def test_the_cuda_view_is_made_only_on_cuda() -> None:
    store, _ = _filled(45, 8, 45, torch.float32)
    assert store.mapped(CPU) is not None
    assert store.mapped(torch.device("cuda")) is None  # an unpinned store has no view on a CUDA device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA device) to map pinned host memory")
def test_the_pinned_store_is_mapped_into_the_device_and_fetches_read_nothing_on_the_host() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    store, dense = _filled(45, 8, 45, torch.bfloat16, pinned=True)
    view = store.mapped(dev)
    assert view is not None and view.device == dev
    assert view.span.data_ptr() == min(c.data_ptr() for c in store.chunks)  # aliases host memory, no copy
    index = torch.randint(0, 45, (300,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(view.gather(index.to(dev)).cpu(), dense[index])
    sync = HostSync()
    copies = CopyEngine(dev, sync)
    arena = torch.zeros(300, 7, dtype=torch.bfloat16, device=dev)
    ticket = copies.issue("fetch", arena, torch.arange(300, device=dev), store, index.to(dev))
    copies.wait(ticket)
    assert sync.reads == 0 and copies.mapped_copies == 1
    assert torch.equal(arena.cpu(), dense[index])
