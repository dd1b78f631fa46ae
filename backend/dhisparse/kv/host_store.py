"""The host store: full history of every request and KV source, page-granular, in (pinned) host memory."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from dhisparse.kv.config import KVLayout

HOST_EMPTY = 0  # no copy of the page on host yet
HOST_PENDING = 1  # a copy into the page is issued, not done
HOST_VALID = 2  # the page holds its rows (write-once: a valid page never changes until freed)


class HostStore:
    """Host rows ``[num_pages * page_rows, row_dim]`` and a page allocator.

    Contract:
        - Host page ``h`` is rows ``h*page_rows .. (h+1)*page_rows - 1`` of :attr:`rows`. Requests own host
          pages for their whole capacity from admission to release; which of them hold data is tracked by
          the request (``HOST_EMPTY / HOST_PENDING / HOST_VALID`` per page and source).
        - Memory is pinned when the device is CUDA, so host→device row copies can be asynchronous.
        - The store grows geometrically. Growing replaces :attr:`rows`, so it first completes every pending
          copy (``drain``), which may reference the old tensor.
        - Freed pages are overwritten with NaN when ``poison_freed`` (tests).
    """

    def __init__(self, layout: KVLayout, page_rows: int, device: torch.device, poison_freed: bool = False,
                 initial_pages: int = 64) -> None:
        self.page_rows = page_rows
        self.row_dim = layout.row_dim
        self.dtype = layout.dtype
        self.pinned = device.type == "cuda"
        self.poison_freed = poison_freed
        self.num_pages = 0
        self.rows = self._new_rows(0)
        self._free: list[int] = []
        self._grow_to(initial_pages)

    def _new_rows(self, pages: int) -> torch.Tensor:
        return torch.zeros(pages * self.page_rows, self.row_dim, dtype=self.dtype, pin_memory=self.pinned)

    def _grow_to(self, pages: int) -> None:
        rows = self._new_rows(pages)
        rows[: self.rows.shape[0]] = self.rows
        for p in range(self.num_pages, pages):
            heapq.heappush(self._free, p)
        self.rows, self.num_pages = rows, pages

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int, drain: Callable[[], None]) -> torch.Tensor:
        """Take ``count`` pages (lowest ids first), growing the store if needed; int64 page ids on CPU."""
        if count > len(self._free):
            drain()
            self._grow_to(max(2 * self.num_pages, self.used_pages + count))
        return torch.tensor([heapq.heappop(self._free) for _ in range(count)], dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        ids = pages.flatten().tolist()
        for p in ids:
            heapq.heappush(self._free, p)
        if self.poison_freed and ids:
            self.rows.view(self.num_pages, self.page_rows, -1)[torch.tensor(ids)] = float("nan")

    def rows_of(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Host row index of each position given the request's host page ids (same leading shape)."""
        return pages * self.page_rows + positions % self.page_rows
