"""Setting up the host store fast (parallel first touch, chunk-by-chunk pinning with progress) and releasing it.

The CUDA calls (``cudaHostRegister`` / ``cudaHostUnregister``) need a GPU; here the orchestration around them runs
with a stand-in for those two calls (it records what was pinned and can fail on a chosen chunk), and the real path
runs with pinning off — the same code, first touch and progress included."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dhisparse.kv import pinned_memory
from dhisparse.kv.host_store import ChunkedRows


class FakePinning:
    """Stands in for cudaHostRegister / cudaHostUnregister: records addresses and the threads that pinned."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.pinned: set[int] = set()
        self.threads: set[int] = set()
        self.calls = 0
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def pin(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.calls += 1
            if self.fail_at is not None and self.calls == self.fail_at:
                raise pinned_memory.PinError("cudaHostRegister failed with CUDA error 2")
            self.pinned.add(tensor.data_ptr())
            self.threads.add(threading.get_ident())
        time.sleep(0.02)  # a registration takes time: the workers overlap

    def unpin(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.pinned.remove(tensor.data_ptr())


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePinning:
    fake = FakePinning()
    monkeypatch.setattr(pinned_memory, "pin", fake.pin)
    monkeypatch.setattr(pinned_memory, "unpin", fake.unpin)
    import dhisparse.kv.host_store as host_store

    monkeypatch.setattr(host_store, "unpin", fake.unpin)
    return fake


def test_first_touch_and_pinning_run_in_parallel_with_progress(fake: FakePinning) -> None:
    chunks = [torch.full((1 << 16,), 7.0) for _ in range(12)]
    seen: list[tuple[int, int]] = []
    pinned: list[torch.Tensor] = []
    pinned_memory.touch_and_pin(chunks, True, workers=4, progress=lambda d, t: seen.append((d, t)), pinned=pinned)
    assert all(bool((c == 0).all()) for c in chunks)  # touched (zeroed)
    assert fake.pinned == {c.data_ptr() for c in chunks} and len(pinned) == 12
    assert len(fake.threads) > 1  # several workers pinned
    total = 12 * (1 << 16) * 4
    assert [t for _, t in seen] == [total] * 12 and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1][0] == total


def test_store_preallocates_pinned_chunks_and_releases_them(fake: FakePinning) -> None:
    rows = ChunkedRows(capacity_rows=1000, chunk_rows=96, row_dim=36, dtype=torch.bfloat16, pinned=True)
    before = len(rows.chunks)
    progress: list[int] = []
    rows.preallocate(workers=3, progress=lambda d, t: progress.append(d))
    assert rows.allocated_rows == 1000 and len(rows.chunks) == before + len(progress)
    assert all(c.data_ptr() % (36 * 2) == 0 for c in rows.chunks)  # chunks start at a multiple of the row size
    assert all(bool((c == 0).all()) for c in rows.chunks)
    assert len(fake.pinned) == len(progress)  # the preallocated chunks, not the lazy ones
    index = torch.tensor([0, 95, 96, 500, 999])
    rows.index_copy_(0, index, torch.arange(5 * 36, dtype=torch.bfloat16).view(5, 36))
    assert torch.equal(rows.index_select(0, index), torch.arange(5 * 36, dtype=torch.bfloat16).view(5, 36))
    rows.close()
    assert not fake.pinned and not rows.chunks and rows.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        rows.ensure(1)


def test_a_failed_pin_unpins_what_was_pinned_and_keeps_the_store_as_it_was(fake: FakePinning) -> None:
    fake.fail_at = 4
    rows = ChunkedRows(capacity_rows=1000, chunk_rows=100, row_dim=8, dtype=torch.float32, pinned=True)
    with pytest.raises(pinned_memory.PinError, match="CUDA error 2"):
        rows.preallocate(workers=2)
    assert not fake.pinned and not rows.chunks  # nothing half-registered, nothing added


def test_without_pinning_the_same_path_touches_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(_: torch.Tensor) -> None:
        raise AssertionError("pinning is off")

    monkeypatch.setattr(pinned_memory, "pin", never)
    rows = ChunkedRows(capacity_rows=300, chunk_rows=64, row_dim=5, dtype=torch.float64, pinned=False)
    rows.preallocate()
    assert rows.allocated_rows == 300 and len(rows.chunks) == 5
    span = rows.mapped(torch.device("cpu"))
    assert span is not None and bool((span.gather(torch.arange(300)) == 0).all())
    rows.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real cudaHostRegister")
def test_real_pinning_on_a_gpu() -> None:
    rows = ChunkedRows(capacity_rows=4096, chunk_rows=1024, row_dim=328, dtype=torch.bfloat16, pinned=True)
    rows.preallocate(workers=4)
    assert all(c.is_pinned() for c in rows.chunks)
    assert rows.mapped(torch.device("cuda")) is not None  # the device reads them at their host addresses
    rows.close()
