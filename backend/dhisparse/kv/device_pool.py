"""The device pool: an arena of rows carved into pages, with byte accounting and the budget rule."""

from __future__ import annotations

import heapq

import torch

from dhisparse.errors import ConfigError
from dhisparse.host_values import to_device
from dhisparse.kv.config import KVConfig, KVLayout


def keys_per_page(layout: KVLayout, page_rows: int) -> int:
    """Indexer keys (of one layer, in the layout's key format) that one arena page holds (0 without indexer)."""
    if not layout.indexer_layers:
        return 0
    page_bytes = page_rows * layout.row_bytes
    per_page = page_bytes // layout.index_key_bytes
    if per_page < 1 or page_bytes % layout.key_storage_dtype.itemsize:
        raise ConfigError(f"page_rows {page_rows}: an arena page ({page_bytes} bytes) must hold at least one "
                          f"indexer key ({layout.index_key_bytes} bytes) in whole key elements; raise page_rows")
    return per_page


def key_view(arena: torch.Tensor, pages: int, page_bytes: int, layout: KVLayout, per_page: int) -> torch.Tensor:
    """The first ``pages`` arena pages as ``[pages, per_page, key_storage_dim]`` keys (a view, no copy)."""
    if per_page == 0:
        return arena.new_zeros(0, 0, 0, dtype=layout.key_storage_dtype)
    flat = arena.view(-1)[: pages * page_bytes // arena.element_size()]
    elems = page_bytes // layout.key_storage_dtype.itemsize
    keys = flat.view(layout.key_storage_dtype).view(pages, elems)
    view: torch.Tensor = keys[:, : per_page * layout.key_storage_dim].unflatten(1, (per_page, layout.key_storage_dim))
    return view


class BudgetError(RuntimeError):
    """The budget rule ``required + optional + reserve <= pool_bytes`` or the page accounting broke."""


class DevicePool:
    """Device arena of ``num_pages * page_rows`` rows and the byte accounting of everything on device.

    Contract:
        - ``arena`` is ``[num_pages * page_rows + 2, storage_dim]`` of the layout's storage dtype (the model
          dtype, or ``uint8`` bytes for FP8 rows); a *location* is a row index into it, page ``p`` is rows
          ``p*page_rows .. (p+1)*page_rows - 1``.
        - ``allocate`` hands out the lowest free page ids (deterministic); ``free`` returns them. Freed pages
          are overwritten with NaN when ``poison_freed`` (tests), so a read of a freed page is visible.
        - ``required_bytes`` (hot caches, tail rings, metadata, indexer keys of admitted requests) and
          ``optional_bytes`` (optional pages, whatever their state) are changed only through
          :meth:`reserve_required` / :meth:`release_required` / :meth:`allocate` (optional) / :meth:`free`,
          each of which checks ``required + optional + reserve <= pool_bytes`` afterwards.
        - The arena itself is sized ``pool_bytes // page_bytes`` pages, an upper bound: the accounting also
          counts metadata that lives outside it, so the pages in use never exceed it. Two pages follow the
          pages, outside the budget (counted in the engine's workspace bound): the *scratch page* (page id
          ``num_pages``), whose first row :attr:`scratch_row` receives the entries of fixed-shape copy lists that
          copy nothing (no location ever points into it), then the *zero page* :attr:`zero_page` (``num_pages +
          1``), always zero: its last row, the arena's last, is :attr:`zero_row` (a step gathers unused selection
          entries from it, so a gather is one index with no mask; ``-1`` indexes it as well), and it is the key page
          of every key block a request does not own (``kv/index_keys.py``).
        - Indexer keys live in arena pages too (``kv/index_keys.py``): :attr:`keys` views every page, the zero
          page included, as ``keys_per_page`` keys of the layout's key format.
    """

    def __init__(self, layout: KVLayout, config: KVConfig, device: torch.device, poison_freed: bool = False):
        self.page_rows = config.page_rows
        self.page_bytes = config.page_rows * layout.row_bytes
        self.pool_bytes = config.pool_bytes
        self.reserve_bytes = config.reserve_bytes
        self.num_pages = config.pool_bytes // self.page_bytes
        self.scratch_row = self.num_pages * config.page_rows  # first row of the scratch page
        self.zero_page = self.num_pages + 1
        self.arena = torch.zeros((self.num_pages + 2) * config.page_rows, layout.storage_dim,
                                 dtype=layout.storage_dtype, device=device)
        self.zero_row = self.arena.shape[0] - 1  # the zero page's last row: ``-1`` indexes it too
        self.keys_per_page = keys_per_page(layout, config.page_rows)
        self.keys = key_view(self.arena, self.num_pages + 2, self.page_bytes, layout, self.keys_per_page)
        self.poison_freed = poison_freed
        self._free: list[int] = list(range(self.num_pages))
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self.required_bytes = 0
        self.optional_bytes = 0

    # ------------------------------------------------------------------------------------------ accounting
    @property
    def used_bytes(self) -> int:
        return self.required_bytes + self.optional_bytes + self.reserve_bytes

    @property
    def spare_bytes(self) -> int:
        """What may still be reserved or filled without breaking the budget rule."""
        return self.pool_bytes - self.used_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def check_budget(self) -> None:
        if self.used_bytes > self.pool_bytes:
            raise BudgetError(
                f"budget rule broken: required {self.required_bytes} + optional {self.optional_bytes} + "
                f"reserve {self.reserve_bytes} > pool {self.pool_bytes}"
            )

    def reserve_required(self, nbytes: int) -> None:
        self.required_bytes += nbytes
        self.check_budget()

    def release_required(self, nbytes: int) -> None:
        self.required_bytes -= nbytes
        if self.required_bytes < 0:
            raise BudgetError("required bytes went negative")

    # ------------------------------------------------------------------------------------------ pages
    def allocate(self, count: int, optional: bool = False) -> torch.Tensor:
        """Take ``count`` free pages (lowest ids first). ``optional`` pages are charged to optional bytes;
        required pages must already be covered by :meth:`reserve_required`. Returns int64 page ids."""
        if count > len(self._free):
            raise BudgetError(f"arena has {len(self._free)} free pages, {count} requested")
        if optional:
            self.optional_bytes += count * self.page_bytes
            try:
                self.check_budget()
            except BudgetError:
                self.optional_bytes -= count * self.page_bytes
                raise
        pages = [heapq.heappop(self._free) for _ in range(count)]
        ids = torch.tensor(pages, dtype=torch.int64)
        self._is_free[ids] = False
        return ids

    def free(self, pages: torch.Tensor, optional: bool = False) -> None:
        """Return pages. The caller guarantees no copy or reader still uses them (safe-free rules)."""
        ids = pages.to("cpu", torch.int64).flatten()
        if ids.numel() == 0:
            return
        if bool(self._is_free[ids].any()) or ids.unique().numel() != ids.numel():
            raise BudgetError(f"double free of arena pages {ids.tolist()}")
        self._is_free[ids] = True
        for p in ids.tolist():
            heapq.heappush(self._free, p)
        if optional:
            self.optional_bytes -= ids.numel() * self.page_bytes
        if self.poison_freed:
            pages_view = self.arena[: self.scratch_row].view(self.num_pages, self.page_rows, -1)
            pages_view[ids.to(self.arena.device)] = float("nan") if self.arena.is_floating_point() else 255

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        return self._is_free[pages.to("cpu", torch.int64)]

    def page_rows_of(self, pages: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """Arena row indices of whole pages: ``[len(pages) * page_rows]`` int64, page-major."""
        pages = to_device(pages, torch.int64, device or self.arena.device)
        offsets = torch.arange(self.page_rows, device=pages.device)
        return (pages.unsqueeze(1) * self.page_rows + offsets).reshape(-1)
