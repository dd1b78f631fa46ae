"""The prefill side's arena allocator: random allocate/free never overlaps and frees back to one range."""

from __future__ import annotations

import random

import pytest

from dhisparse.disagg.arena import ALIGN, ArenaRanges


def _span(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def test_random_allocations_never_overlap_and_free_back_to_one_range() -> None:
    arena, held, rng = ArenaRanges(ALIGN * 100), [], random.Random(0)
    for _ in range(2000):
        if held and rng.random() < 0.5:
            arena.free(*held.pop(rng.randrange(len(held))))
            continue
        size = rng.randint(1, ALIGN * 10)
        offset = arena.allocate(size)
        if offset is None:
            assert arena.size - arena.used < _span(size) or len(held) > 1  # fragmented or full
            continue
        assert offset % ALIGN == 0 and offset + _span(size) <= arena.size
        assert all(offset + _span(size) <= o or o + _span(n) <= offset for o, n in held)
        held.append((offset, size))
    for offset, size in held:
        arena.free(offset, size)
    assert arena.used == 0 and arena.allocate(arena.size) == 0


def test_double_free_is_refused() -> None:
    arena = ArenaRanges(ALIGN * 4)
    offset = arena.allocate(10)
    arena.free(offset, 10)
    with pytest.raises(ValueError, match="already free"):
        arena.free(offset, 10)


def test_exporter_arenas_stay_within_their_limit() -> None:
    """The context side never registers more than ``arena_limit_bytes``: a history that does not fit fails that
    prefill (a TransferError naming the limit); once regions are released the same history fits again."""
    import pytest

    pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")
    from dhisparse.disagg.nixl_transfer import NixlExporter, TransferError

    exporter = NixlExporter("arena-limit-test", arena_bytes=1 << 20, arena_limit_bytes=2 << 20)
    try:
        exporter.publish("a/0/r0", 700 << 10)
        exporter.publish("a/1/r1", 700 << 10)  # a second arena, up to the limit
        with pytest.raises(TransferError, match="arena_limit_bytes = 2097152"):
            exporter.publish("a/2/r2", 700 << 10)
        assert exporter.stats()["arena_bytes"] <= 2 << 20
        assert exporter.cancel("r0") == ["a/0/r0"]
        exporter.publish("a/3/r3", 700 << 10)  # fits in the freed range
        assert exporter.stats()["arena_bytes"] <= 2 << 20
    finally:
        exporter.close()
