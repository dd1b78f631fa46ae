"""The prefix cache's index: content-addressed full pages shared by reference count across requests.

**Keys.** A request's token ids are cut into pages of ``page_rows`` tokens (a model whose rows are not tokens says
which tokens a page spans: ``kv/prefix_rows.py``); only *full* pages have a key. Page
``i``'s key is ``blake2b(key[i-1] || token ids of page i)`` (32 bytes) and ``key[-1] = blake2b(salt)``, where the salt
names the model, the KV dtype, the row and key layout and ``page_rows`` (:func:`cache_salt`). So a key names a page
*and every token before it*: two requests share page ``i`` only if their first ``(i + 1) * page_rows`` tokens are
equal, and a lookup is a walk from page 0 that stops at the first key not cached (the longest cached prefix at page
granularity, no coarser alignment).

**Entries** (:class:`CachedPage`): one per key, holding the page's rows in the host store (``host_pages``: one host
page per KV source) and its indexer keys packed into host pages (``key_pages``, :mod:`dhisparse.kv.prefix_keys`);
under ``adaptive`` optionally a device copy that requests map directly (:mod:`dhisparse.kv.prefix_device`).

Rules (the manager's side is :mod:`dhisparse.kv.prefix_reuse`; :func:`check_cache` checks them):

- An entry is made only from a complete page whose host copy is valid, so its rows never change again; its host
  pages belong to the cache from then on (never written: copy-on-write, the partial tail page is never an entry).
- ``refs``: the requests holding the entry — admitted with a hit on it, or that registered it — until their memory
  is freed (after their copies and readers finished). A request holds entries ``0 .. n-1`` of its sequence, a prefix.
- ``children``: cached entries whose parent it is. Only *leaves* nobody holds (``refs == children == 0``) are
  evictable, least recently used first (ties: deepest first), so every cached entry's parent is cached and a walk
  from page 0 reaches every entry.
"""

from __future__ import annotations

import array
import hashlib
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dhisparse.kv.prefix_rows import IDENTITY, PrefixRows

KEY_BYTES = 32

DEVICE_NONE = 0  # no device copy
DEVICE_READY = 1  # device copy valid; requests may map it (kv/prefix_device.py)


@dataclass(eq=False)
class CachedPage:
    """One cached full page (all KV sources): see the module docstring."""

    key: bytes
    parent: CachedPage | None
    depth: int  # the page's index in every sequence that holds it (positions depth * page_rows ...)
    host_pages: torch.Tensor  # [S] int64 host pages of its rows, one per source (CPU)
    key_pages: torch.Tensor  # [n] int64 host pages of its packed indexer keys (CPU)
    refs: int = 0
    children: int = 0
    last_use: int = 0
    # Adaptive: a device copy ([S] arena pages, optional bytes) requests map in their page tables.
    device_pages: torch.Tensor | None = None
    mappers: int = 0  # requests whose page table maps the device copy now
    unmapped_epoch: int = 0  # reader epoch (ReaderFence.issued) when a mapping was last dropped
    snapshot: torch.Tensor | None = field(default=None, repr=False)  # tests: the host rows at registration

    @property
    def evictable(self) -> bool:
        return self.refs == 0 and self.children == 0


def cache_salt(*parts: object) -> bytes:
    """The key chain's root input: everything besides the token ids that decides a page's rows (model, dtype,
    row and key layout, page size), as one byte string."""
    return repr(parts).encode()


def page_keys(token_ids: Sequence[int], page_rows: int, salt: bytes, rows: PrefixRows = IDENTITY) -> list[bytes]:
    """Chain keys of the full pages of ``token_ids`` (``rows.pages_within(len(token_ids))`` of them); page ``i`` is
    hashed over the token ids of its span (``rows.page_end``: ``page_rows`` tokens each with one row per token)."""
    pages = rows.pages_within(len(token_ids), page_rows)
    ends = [rows.page_end(i, page_rows) for i in range(pages + 1)]
    data = array.array("q", token_ids[: ends[-1]]).tobytes()
    key = hashlib.blake2b(salt, digest_size=KEY_BYTES).digest()
    keys = []
    for i in range(pages):
        key = hashlib.blake2b(key + data[ends[i] * 8:ends[i + 1] * 8], digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys


class PrefixCache:
    """The index of cached pages, their reference counts and the LRU order of evictable ones."""

    def __init__(self) -> None:
        self.entries: dict[bytes, CachedPage] = {}
        self.unreferenced = 0  # entries no request holds (kept as entries change)
        self._tick = 0
        self._seq = 0
        self._evictable: list[tuple[int, int, int, CachedPage]] = []  # (last_use, -depth, seq, entry), lazy

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, keys: Iterable[bytes]) -> list[CachedPage]:
        """The cached entries of the longest prefix of ``keys`` (a walk from page 0)."""
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            out.append(entry)
        return out

    def touch(self, entries: Iterable[CachedPage]) -> None:
        """Mark ``entries`` used now (one tick for all: within it the deepest is evicted first)."""
        self._tick += 1
        for e in entries:
            e.last_use = self._tick

    def hold(self, entries: Sequence[CachedPage]) -> None:
        """A request takes a reference on each of ``entries``."""
        self.pin(entries)
        self.touch(entries)

    def pin(self, entries: Iterable[CachedPage]) -> None:
        """A reference on each of ``entries`` without marking them used (give it back with :meth:`drop`)."""
        for e in entries:
            self.unreferenced -= e.refs == 0
            e.refs += 1

    def drop(self, entries: Iterable[CachedPage]) -> None:
        """A request gives its references back (its memory is freed); leaves nobody holds become evictable."""
        for e in entries:
            if e.refs <= 0:
                raise RuntimeError(f"prefix cache: reference count of page {e.depth} would go negative")
            e.refs -= 1
            self.unreferenced += e.refs == 0
            self._offer(e)

    def insert(self, key: bytes, parent: CachedPage | None, host_pages: torch.Tensor,
               key_pages: torch.Tensor) -> CachedPage:
        """A new entry held by its registrant (``refs`` 1). ``parent``: the entry of the previous page (``None`` for
        page 0); it must be cached."""
        if key in self.entries:
            raise ValueError("prefix cache: the page is cached already")
        depth = 0 if parent is None else parent.depth + 1
        if parent is not None:
            if self.entries.get(parent.key) is not parent:
                raise ValueError("prefix cache: a page's parent must be cached")
            parent.children += 1
        entry = CachedPage(key, parent, depth, host_pages, key_pages, refs=1)
        self.entries[key] = entry
        self.touch([entry])
        return entry

    def _offer(self, e: CachedPage) -> None:
        if e.evictable and self.entries.get(e.key) is e:
            heapq.heappush(self._evictable, (e.last_use, -e.depth, self._seq, e))
            self._seq += 1

    def evict_one(self) -> CachedPage | None:
        """Remove the least recently used leaf nobody holds and return it (the caller frees its memory), or
        ``None`` when no entry is evictable."""
        while self._evictable:
            last_use, _, _, e = heapq.heappop(self._evictable)
            if e.evictable and self.entries.get(e.key) is e and e.last_use == last_use:
                del self.entries[e.key]
                self.unreferenced -= 1
                if e.parent is not None:
                    e.parent.children -= 1
                    self._offer(e.parent)
                return e
        return None



def check_cache(cache: PrefixCache, holders: Iterable[Sequence[CachedPage]]) -> str | None:
    """Why the index is inconsistent with the requests' holds (``holders``: each alive request's held entries), or
    ``None``: keys unique and reachable, parents cached, children and reference counts exact, holds are prefixes."""
    refs: dict[int, int] = {}
    for held in holders:
        for depth, e in enumerate(held):
            if e.depth != depth or (depth and e.parent is not held[depth - 1]):
                return f"a request holds page {e.depth} at index {depth} (holds must be prefixes of one chain)"
            refs[id(e)] = refs.get(id(e), 0) + 1
    if cache.unreferenced != sum(1 for e in cache.entries.values() if e.refs == 0):
        return f"the cache counts {cache.unreferenced} unreferenced entries"
    children: dict[int, int] = {}
    for key, e in cache.entries.items():
        if e.key != key:
            return "an entry is filed under another key"
        if e.parent is not None:
            if cache.entries.get(e.parent.key) is not e.parent:
                return f"page {e.depth}'s parent is not cached"
            children[id(e.parent)] = children.get(id(e.parent), 0) + 1
    for e in cache.entries.values():
        if e.refs != refs.get(id(e), 0):
            return f"page {e.depth} counts {e.refs} references, {refs.get(id(e), 0)} requests hold it"
        if e.children != children.get(id(e), 0):
            return f"page {e.depth} counts {e.children} children, {children.get(id(e), 0)} are cached"
    cached = {id(e) for e in cache.entries.values()}
    if any(k not in cached for k in refs):
        return "a request holds a page that is not cached"
    return None
