"""Byte ranges of a registered transfer arena: first-fit allocation, 64-byte aligned, neighbours merged on free.

The prefill side registers a few large arenas with NIXL once and carves each prompt's region out of them, so the
decode side's view of the prefill agent's registered memory never holds a stale, freed registration at an address
that a later region reuses (NIXL merges metadata per registered section; a freed section would stay in its view).
"""

from __future__ import annotations

import bisect

ALIGN = 64


class ArenaRanges:
    """Free-list over ``[0, size)`` bytes."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be > 0, got {size}")
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset, never adjacent
        self.used = 0

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new range of ``nbytes`` (rounded up to the alignment), or ``None`` if none fits."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self.used += need
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        i = bisect.bisect_left(self._free, (offset, 0))
        if (i > 0 and sum(self._free[i - 1]) > offset) or (i < len(self._free) and offset + size > self._free[i][0]):
            raise ValueError(f"range {offset}+{size} is already free")
        self.used -= size
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (offset, size)
            return
        self._free.insert(i, (offset, size))
