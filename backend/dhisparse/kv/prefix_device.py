"""Shared resident pages (``adaptive``): a prefix-cache entry's device copy, mapped by every request that holds it.

Under ``adaptive`` a complete prompt page may stay on the device as an optional page. When such a page is a
prefix-cache entry, its device copy belongs to the entry (:attr:`CachedPage.device_pages`, ``S`` arena pages
charged to optional bytes once) and every request holding the entry may map it in its page table
(``OPT_SHARED``), so requests with one system prompt keep one resident copy of it, not one each. Operations:

- :func:`map_cached_copies` — at import, a hit's pages whose entry has a device copy are mapped (no copy, no memory);
- :func:`publish_copies` — after import, a held page the request keeps as a private ready optional page of every
  source becomes the entry's device copy (ownership moves to the cache; the mapping stays);
- :func:`unmap_shared` — at reclaim and at release, the request's shared mappings are dropped (its rows are read
  from the hot cache or the host again: a cached page's host copy is always valid); the entry notes the reader
  epoch (``unmapped_epoch``);
- :class:`DeviceCopies` — copies nobody maps are *cached unreferenced device pages*: evicted least recently used
  first, before any request's optional pages, when an admission has a deficit (or a refill has no room), and freed
  once every reader issued before the last unmapping has finished (safe free, as for any optional page).

A refill of a held page maps the entry's copy when there is one (:func:`map_on_refill`), else refills a private
optional page from the (shared, read-only) host page as usual.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dhisparse.host_values import to_device
from dhisparse.kv.copies import ReaderFence
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.prefix_cache import CachedPage
from dhisparse.kv.request_state import OPT_ABSENT, OPT_READY, OPT_SHARED, RequestKV


def _map(req: RequestKV, entry: CachedPage, sources: torch.Tensor, device: torch.device) -> None:
    """Map ``entry``'s copy at page ``entry.depth`` for ``sources`` (absent there) of ``req``."""
    assert entry.device_pages is not None
    i = entry.depth
    newly = not bool((req.opt_state[:, i] == OPT_SHARED).any())
    req.page_table[to_device(sources, None, device), i] = to_device(entry.device_pages[sources], None, device)
    req.opt_state[sources, i] = OPT_SHARED
    if newly:
        entry.mappers += 1


def map_cached_copies(req: RequestKV, device: torch.device) -> int:
    """Map every held page whose entry has a device copy (sources still absent); returns pages mapped."""
    mapped = 0
    for entry in req.prefix_held[: req.prompt_pages]:
        if entry.device_pages is None:
            continue
        absent = torch.nonzero(req.opt_state[:, entry.depth] == OPT_ABSENT).flatten()
        if absent.numel():
            _map(req, entry, absent, device)
            mapped += int(absent.numel())
    return mapped


def map_on_refill(req: RequestKV, source: int, page: int, device: torch.device) -> bool:
    """Map the held entry's copy instead of refilling ``(source, page)`` privately (True when mapped)."""
    if page >= len(req.prefix_held) or req.prefix_held[page].device_pages is None:
        return False
    _map(req, req.prefix_held[page], torch.tensor([source]), device)
    return True


def publish_copies(req: RequestKV, copies: DeviceCopies) -> int:
    """Held pages kept as private ready optional pages of every source become their entries' device copies
    (which had none; ``copies`` keeps them); returns pages published."""
    published = 0
    for entry in req.prefix_held[: req.prompt_pages]:
        i = entry.depth
        if entry.device_pages is not None or not bool((req.opt_state[:, i] == OPT_READY).all()):
            continue
        entry.device_pages = req.opt_page[:, i].clone()
        copies.holders[id(entry)] = entry
        req.opt_page[:, i] = -1
        req.opt_state[:, i] = OPT_SHARED
        entry.mappers += 1
        published += 1
    return published


def unmap_shared(req: RequestKV, fence: ReaderFence) -> int:
    """Drop every shared mapping of ``req`` (reclaim or release); returns (source, page) mappings dropped."""
    shared = req.opt_state == OPT_SHARED
    if not bool(shared.any()):
        return 0
    ss, si = torch.nonzero(shared, as_tuple=True)
    req.page_table[to_device(ss, None, req.page_table.device), to_device(si, None, req.page_table.device)] = -1
    req.opt_state[ss, si] = OPT_ABSENT
    req.may_refill = True  # a held page's host copy is valid: refillable
    for i in torch.unique(si).tolist():
        entry = req.prefix_held[i]
        entry.mappers -= 1
        entry.unmapped_epoch = fence.issued
    return int(ss.numel())


class DeviceCopies:
    """The cache's device copies that are leaving (retired) and the LRU eviction of copies nobody maps."""

    def __init__(self, num_sources: int) -> None:
        self.num_sources = num_sources
        self.retiring: list[tuple[torch.Tensor, int]] = []  # (arena pages, epoch) freed once readers finished
        self.holders: dict[int, CachedPage] = {}  # entries with a device copy, by identity
        self.evicted = 0  # copies evicted (each num_sources pages)

    @property
    def retiring_pages(self) -> int:
        return sum(int(p.numel()) for p, _ in self.retiring)

    def copies(self) -> list[CachedPage]:
        """The entries that hold a device copy."""
        return list(self.holders.values())

    def resident_pages(self) -> int:
        """Arena pages of every cached device copy (mapped or not)."""
        return self.num_sources * len(self.holders)

    def retire(self, entry: CachedPage) -> None:
        """``entry``'s copy (nobody maps it) leaves: freed once the readers issued before its last unmapping
        finished."""
        assert entry.device_pages is not None and entry.mappers == 0
        self.retiring.append((entry.device_pages, entry.unmapped_epoch))
        entry.device_pages = None
        del self.holders[id(entry)]
        self.evicted += 1

    def evict_unmapped(self, pages: int) -> int:
        """Retire copies nobody maps, least recently used first (ties: deepest first), until ``pages`` arena
        pages are leaving; returns the pages retired."""
        if pages <= 0:
            return 0
        idle = sorted((e for e in self.holders.values() if e.mappers == 0), key=lambda e: (e.last_use, -e.depth))
        taken = 0
        for entry in idle:
            if taken >= pages:
                break
            self.retire(entry)
            taken += self.num_sources
        return taken

    def free_retired(self, pool: DevicePool, fence: ReaderFence) -> int:
        """Free the retired copies whose readers have finished; returns pages freed."""
        if not self.retiring:
            return 0
        fence.poll()
        keep, freed = [], 0
        for pages, epoch in self.retiring:
            if epoch <= fence.completed:
                pool.free(pages, optional=True)
                freed += int(pages.numel())
            else:
                keep.append((pages, epoch))
        self.retiring = keep
        return freed

    def owned_pages(self) -> Iterable[torch.Tensor]:
        """Every arena page the cache owns (device copies and retiring ones), for the ownership invariant."""
        yield from (e.device_pages for e in self.holders.values() if e.device_pages is not None)
        yield from (p for p, _ in self.retiring)
