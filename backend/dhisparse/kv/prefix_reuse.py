"""Prefix reuse in the hierarchy: the manager's side of the prefix cache (``kv/prefix_cache.py``).

When it applies: ``KVConfig.prefix_reuse`` on, a policy with a host store (``hisparse``, ``adaptive``), native rows and
native indexer keys, the streamed prefill (``kv/prefill_stream.py``). There a hit reads the cached rows and keys
exactly as they were written; with FP8 rows or keys the prefill of an uncached prompt attends to the unquantized
earlier rows and keys while a hit could only offer quantized ones, so reuse would change tokens and is off.
``resident`` has no host store (it keeps nothing beyond a request's life) and does no reuse.

Life of a page (each step is a call from :class:`~dhisparse.kv.manager.KVManager`):

1. ``set_token_ids`` (before ``try_admit``): the prompt's page keys are computed once.
2. ``lookup`` (``try_admit``): the longest cached prefix of the prompt, at most ``prompt_len - min_suffix`` tokens
   (the prefill computes at least the last token, for its logits, and with a drafter the drafter's window, whose
   hidden states seed its ring: those are recomputed, not stored). Host pages short? Cached entries nobody holds
   are evicted least recently used first (``make_host_room``) before the admission waits.
3. ``admit``: the request holds the hit's entries; its pages ``0 .. h-1`` are their host pages (valid), the cached
   indexer keys are copied into its own key pages, and its prefill starts at ``h * page_rows``.
4. ``import_prompt`` → ``before_import`` maps shared device copies, ``after_import`` registers the prompt's own
   complete pages (their host copies are valid: the streamed prefill wrote them) and publishes its resident ones.
5. ``release`` → ``on_release`` drops shared mappings; when the memory is freed (copies and readers done)
   ``on_free`` registers the complete pages decoding added (the engine passed the whole sequence), gives the
   references back and returns the private host pages to free.

A model whose rows are not tokens, or whose pages carry more state than rows and keys, passes a
:class:`~dhisparse.kv.prefix_rows.PrefixRows` (``rows``): page spans in tokens, the tokens a hit saves, the state saved
and loaded with each page (DeepSeek-V4, ``kv/prefix_v4.py``). Token counts (statistics, ``min_suffix``) are tokens;
``RequestKV.prefix_reused_tokens`` is the hit's *rows* (where its prefill and imports start writing rows).

Registration stops at the first page already cached or not host-valid (a request's holds stay a prefix), or when no
host page for its keys can be found. Statistics: ``prefix_lookup_tokens`` (prompt tokens looked up at admission),
``prefix_reused_tokens`` (of those, found cached), ``prefix_registered_pages``, ``prefix_evicted_pages`` (engine-wide
counters; the first two per request too), gauges in :meth:`PrefixReuse.gauges`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.copies import ReaderFence
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.host_store import HOST_VALID, HostMemoryError, HostStore
from dhisparse.kv.prefix_cache import CachedPage, PrefixCache, cache_salt, page_keys
from dhisparse.kv.prefix_device import DeviceCopies, map_cached_copies, publish_copies, unmap_shared
from dhisparse.kv.prefix_keys import key_host_pages, load_prefix_keys, save_page_keys
from dhisparse.kv.prefix_rows import IDENTITY, PrefixRows
from dhisparse.kv.request_state import RequestKV

COUNTERS = ("prefix_lookup_tokens", "prefix_reused_tokens", "prefix_hits", "prefix_registered_pages",
            "prefix_evicted_pages", "prefix_evicted_device_pages")


class PrefixReuse:
    """The prefix cache of one :class:`~dhisparse.kv.manager.KVManager` (see the module docstring)."""

    def __init__(self, layout: KVLayout, config: KVConfig, pool: DevicePool, host: HostStore, enabled: bool,
                 verify: bool = False, rows: PrefixRows = IDENTITY) -> None:
        self.layout, self.pool, self.host, self.rows = layout, pool, host, rows
        self.enabled = enabled
        self.page_rows = config.page_rows
        self.min_suffix = max(1, config.prefix_min_suffix_tokens)
        self.salt = cache_salt(config.prefix_model_key, layout, config.page_rows, *(
            () if rows is IDENTITY else rows.describe()))
        self.verify = verify  # keep each entry's host rows at registration; check_invariants compares (tests)
        self.cache = PrefixCache()
        self.device = DeviceCopies(layout.num_sources)
        self.key_pages_per_entry = key_host_pages(layout, config.page_rows, rows.state_values)
        self.tokens: dict[str, tuple[list[int], list[bytes]]] = {}  # request -> (token ids, page keys)
        self.no_lookup: set[str] = set()  # requests admitted without a lookup (set_token_ids(reuse=False))
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)

    # ------------------------------------------------------------------------------------------ tokens
    def set_token_ids(self, request_id: str, token_ids: Sequence[int], reuse: bool = True) -> None:
        """Remember a request's token ids (its prompt before admission; its whole sequence before release).
        ``reuse=False``: the admission looks nothing up (its pages are still registered)."""
        if not self.enabled:
            return
        if reuse:
            self.no_lookup.discard(request_id)
        else:
            self.no_lookup.add(request_id)
        known = self.tokens.get(request_id)
        if known is not None and len(known[0]) == len(token_ids) and known[0] == list(token_ids):
            return
        tokens = [int(t) for t in token_ids]
        self.tokens[request_id] = (tokens, page_keys(tokens, self.page_rows, self.salt, self.rows))

    def forget(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)
        self.no_lookup.discard(request_id)
        self.rows.forget(request_id)

    def _prompt_tokens(self, tokens: list[int], prompt_len: int) -> int:
        """The prompt's tokens, of a request whose prompt has ``prompt_len`` rows."""
        if self.rows is IDENTITY:
            return prompt_len
        return min(len(tokens), (prompt_len - self.rows.lead_rows + 1) * self.rows.tokens_per_row - 1)

    # ------------------------------------------------------------------------------------------ admission
    def lookup(self, request_id: str, prompt_len: int) -> list[CachedPage]:
        """The cached entries of the longest reusable prefix of the request's prompt (none without tokens)."""
        known = self.tokens.get(request_id)
        if known is None or self.rows.rows(len(known[0])) < prompt_len or request_id in self.no_lookup:
            return []
        tokens = self._prompt_tokens(known[0], prompt_len)
        limit = self.rows.pages_within(max(0, tokens - self.min_suffix), self.page_rows)
        hit = self.cache.match(known[1][:limit])
        if hit and self.rows.reused_tokens(self.rows.page_end(len(hit), self.page_rows)) == 0:
            return []  # too short to save any computation (kv/prefix_rows.py)
        return hit

    def make_host_room(self, count: int) -> bool:
        """Evict cached entries nobody holds (LRU leaves) until ``count`` host pages are free."""
        while self.host.free_pages < count and self._evict_one():
            pass
        return self.host.free_pages >= count

    @contextlib.contextmanager
    def pinned(self, entries: Sequence[CachedPage]) -> Iterator[None]:
        """Keep ``entries`` from eviction for the duration (a reference, without touching their LRU time: a refused
        admission leaves the order alone)."""
        self.cache.pin(entries)
        try:
            yield
        finally:
            self.cache.drop(entries)

    def _evict_one(self) -> bool:
        entry = self.cache.evict_one()
        if entry is None:
            return False
        if entry.device_pages is not None:
            self.device.retire(entry)
            self.counters["prefix_evicted_device_pages"] += self.layout.num_sources
        self.host.free(torch.cat([entry.host_pages, entry.key_pages]))
        self.counters["prefix_evicted_pages"] += 1
        return True

    def admit(self, req: RequestKV, hit: list[CachedPage]) -> None:
        """``req`` was admitted with ``hit``: hold it, mark its host pages valid, copy its keys in, count."""
        known = self.tokens.get(req.request_id)
        if known is not None and req.request_id not in self.no_lookup:
            prompt_tokens = self._prompt_tokens(known[0], req.prompt_len)
            self.counters["prefix_lookup_tokens"] += prompt_tokens
            req.add_stat("prefix_lookup_tokens", prompt_tokens)
        if not hit:
            return
        self.cache.hold(hit)
        req.prefix_held = list(hit)
        req.host_state[:, : len(hit)] = HOST_VALID
        state = load_prefix_keys(self.pool, self.layout, self.host, req, [e.key_pages for e in hit],
                                 self.rows.state_values)
        if state is not None:
            self.rows.load_state(req.request_id, state)
        req.prefix_reused_tokens = len(hit) * self.page_rows  # rows
        reused = self.rows.reused_tokens(self.rows.page_end(len(hit), self.page_rows))
        req.add_stat("prefix_reused_tokens", reused)
        self.counters["prefix_reused_tokens"] += reused
        self.counters["prefix_hits"] += 1

    # ------------------------------------------------------------------------------------------ import
    def before_import(self, req: RequestKV) -> None:
        """Map the hit's shared device copies (adaptive) before the import places the rest."""
        if req.prefix_held and req.prompt_pages:
            map_cached_copies(req, self.pool.arena.device)

    def after_import(self, req: RequestKV) -> None:
        """Register the prompt's complete pages (host-valid now) and publish its resident ones (adaptive)."""
        if not self.enabled:
            return
        self.register(req, req.prompt_len // self.page_rows)
        if req.prompt_pages:
            publish_copies(req, self.device)

    def register(self, req: RequestKV, pages: int) -> int:
        """Make ``req``'s pages ``len(prefix_held) .. pages-1`` cache entries while each is host-valid and not
        cached yet; returns pages registered."""
        known = self.tokens.get(req.request_id)
        if known is None or req.host_pages is None:
            return 0
        keys, held = known[1], req.prefix_held
        registered = 0
        for i in range(len(held), min(pages, len(keys))):
            if keys[i] in self.cache.entries or not bool((req.host_state[:, i] == HOST_VALID).all()):
                break
            try:
                key_pages = self._host_pages(self.key_pages_per_entry)
            except HostMemoryError:  # the OS refused the keys' memory: the page stays private (caching is optional)
                break
            if key_pages is None:
                break
            state = self.rows.save_state(req.request_id, i) if self.rows.state_values else None
            save_page_keys(self.pool, self.layout, self.host, req, i, key_pages, state)
            entry = self.cache.insert(keys[i], held[-1] if held else None, req.host_pages[:, i].clone(), key_pages)
            if self.verify:
                entry.snapshot = self.entry_rows(entry).clone()
            held.append(entry)
            registered += 1
        self.counters["prefix_registered_pages"] += registered
        return registered

    def _host_pages(self, count: int) -> torch.Tensor | None:
        if count == 0:
            return torch.zeros(0, dtype=torch.int64)
        if self.host.free_pages < count:
            self.make_host_room(count)
        return self.host.allocate(count)

    def entry_rows(self, entry: CachedPage) -> torch.Tensor:
        """The host rows of an entry's pages (rows, then packed keys), for checks."""
        pages = torch.cat([entry.host_pages, entry.key_pages])
        rows = (pages.unsqueeze(1) * self.page_rows + torch.arange(self.page_rows)).reshape(-1)
        return self.host.rows.index_select(0, rows)

    # ------------------------------------------------------------------------------------------ release
    def on_release(self, req: RequestKV, fence: ReaderFence) -> None:
        """The request is released: its shared mappings go (the copies stay cached)."""
        unmap_shared(req, fence)

    def on_free(self, req: RequestKV) -> torch.Tensor | None:
        """The request's memory is being freed (copies and readers done): register the complete pages decoding
        added, give its references back; returns its private host pages (``None`` without a host store)."""
        known = self.tokens.get(req.request_id)
        if known is not None and req.imported and self.enabled:
            self.register(req, min(req.length, self.rows.rows(len(known[0]))) // self.page_rows)
        self.forget(req.request_id)
        if req.host_pages is None:
            return None
        private = req.host_pages[:, len(req.prefix_held):]
        self.cache.drop(req.prefix_held)
        req.prefix_held = []
        return private

    # ------------------------------------------------------------------------------------------ device
    def free_retired(self, fence: ReaderFence) -> None:
        self.device.free_retired(self.pool, fence)

    def evict_device(self, pages: int) -> int:
        """Retire device copies nobody maps (LRU) until ``pages`` arena pages leave; returns pages retired."""
        taken = self.device.evict_unmapped(pages)
        self.counters["prefix_evicted_device_pages"] += taken
        return taken

    def evict_all(self) -> int:
        """Evict every entry nobody holds (leaves first, repeatedly); returns entries evicted."""
        evicted = 0
        while self._evict_one():
            evicted += 1
        return evicted

    # ------------------------------------------------------------------------------------------ figures
    def gauges(self) -> dict[str, float]:
        """``prefix_cached_pages`` (entries: one page of every source), ``prefix_unreferenced_pages`` (held by no
        request), ``prefix_host_pages`` (host pages the cache owns: rows and packed keys), ``prefix_device_pages``
        (arena pages of shared device copies, retiring ones included; ``prefix_device_bytes`` the same in bytes, part
        of ``optional_bytes``), ``prefix_reuse_enabled`` (0/1)."""
        per_entry = self.layout.num_sources + self.key_pages_per_entry
        device_pages = self.device.resident_pages() + self.device.retiring_pages
        return {
            "prefix_reuse_enabled": float(self.enabled),
            "prefix_cached_pages": float(len(self.cache)),
            "prefix_unreferenced_pages": float(self.cache.unreferenced),
            "prefix_host_pages": float(per_entry * len(self.cache)),
            "prefix_device_pages": float(device_pages),
            "prefix_device_bytes": float(device_pages * self.pool.page_bytes),
        }

    def host_pages_owned(self) -> int:
        """Host pages the cache owns (rows and packed keys of every entry)."""
        return (self.layout.num_sources + self.key_pages_per_entry) * len(self.cache)

    def owned_host_pages(self) -> torch.Tensor:
        pages = [torch.cat([e.host_pages, e.key_pages]) for e in self.cache.entries.values()]
        return torch.cat(pages) if pages else torch.zeros(0, dtype=torch.int64)
