"""The context engine's prefix cache: it prefills only the part of a prompt after its longest cached prefix.

The context (prefill) role keeps no KV hierarchy: a prompt is prefilled over a ``LocalKV`` of the whole prompt and
published. This cache keeps the complete pages of earlier prompts (per page: the rows of every layer
``[num_layers, page_rows, row_dim]`` and the indexer keys of every indexer layer ``[page_rows, d]``) under the same
chain keys as the hierarchy's prefix cache (:func:`dhisparse.kv.prefix_cache.page_keys`: the token ids of the page
and of everything before it, salted with the model, dtype and page size). A prompt's longest cached prefix — at most
``len(prompt) - min_suffix`` tokens: the last token's logits and, when speculating, the drafter's window of hidden
states are computed — is copied into the ``LocalKV`` and the model prefills from there; the prompt's new complete pages
are then cached. The published region still holds the whole prompt: the generation engine pulls only the pages its
own prefix cache lacks (``HostRowsTarget.cached_rows``).

Memory: host memory, at most ``capacity_bytes`` (the engine's ``host_bytes``), least recently used pages evicted
first (a hit or an insert refreshes a chain deepest page first, so a page's parent is evicted after it).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from dhisparse.kv.prefix_cache import cache_salt, page_keys
from dhisparse.model.kv_view import LocalKV

Page = tuple[torch.Tensor, dict[int, torch.Tensor]]


class ContextPrefixCache:
    """Complete prompt pages of a context engine, LRU under ``capacity_bytes`` (see the module docstring)."""

    def __init__(self, page_rows: int, capacity_bytes: int, min_suffix: int, model_key: str) -> None:
        if page_rows < 1 or capacity_bytes < 0 or min_suffix < 1:
            raise ValueError("page_rows and min_suffix must be >= 1 and capacity_bytes >= 0")
        self.page_rows, self.capacity_bytes, self.min_suffix = page_rows, capacity_bytes, min_suffix
        self.salt = cache_salt("context", model_key, page_rows)
        self.pages: OrderedDict[bytes, Page] = OrderedDict()
        self.nbytes = 0
        self.counters = {"context_prefix_lookup_tokens": 0.0, "context_prefix_reused_tokens": 0.0,
                         "context_prefix_evicted_pages": 0.0}

    @staticmethod
    def _bytes(page: Page) -> int:
        rows, keys = page
        return rows.numel() * rows.element_size() + sum(k.numel() * k.element_size() for k in keys.values())

    def keys_of(self, prompt: list[int]) -> list[bytes]:
        return page_keys(prompt, self.page_rows, self.salt)

    def restore(self, local: LocalKV, prompt: list[int], keys: list[bytes]) -> int:
        """Copy the longest cached prefix of ``prompt`` into ``local`` (positions ``0 ..``) and mark it committed;
        returns its length in tokens (the prefill starts there)."""
        limit = max(0, len(prompt) - self.min_suffix) // self.page_rows
        hit: list[Page] = []
        for key in keys[:limit]:
            page = self.pages.get(key)
            if page is None:
                break
            hit.append(page)
        self.counters["context_prefix_lookup_tokens"] += len(prompt)
        self._touch(keys[: len(hit)])
        for i, (rows, page_keys_) in enumerate(hit):
            at = slice(i * self.page_rows, (i + 1) * self.page_rows)
            local.rows[:, at] = rows.to(local.rows.device)
            for layer, k in page_keys_.items():
                local.keys[layer][at] = k.to(local.keys[layer].device)
        cached = len(hit) * self.page_rows
        local.length = cached
        self.counters["context_prefix_reused_tokens"] += cached
        return cached

    def insert(self, local: LocalKV, keys: list[bytes], first_page: int) -> None:
        """Cache the complete pages ``first_page ..`` of the prefilled prompt in ``local`` (``keys``: its page keys)."""
        for i in range(first_page, len(keys)):
            if keys[i] in self.pages:
                continue
            at = slice(i * self.page_rows, (i + 1) * self.page_rows)
            page = (local.rows[:, at].to("cpu", copy=True),
                    {layer: k[at].to("cpu", copy=True) for layer, k in local.keys.items()})
            size = self._bytes(page)
            if size > self.capacity_bytes:
                return
            while self.nbytes + size > self.capacity_bytes:
                _, old = self.pages.popitem(last=False)
                self.nbytes -= self._bytes(old)
                self.counters["context_prefix_evicted_pages"] += 1
            self.pages[keys[i]] = page
            self.nbytes += size
        self._touch(keys)

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # deepest first: a parent ends up more recent than its children
            if key in self.pages:
                self.pages.move_to_end(key)

    def stats(self) -> dict[str, float]:
        return {**self.counters, "context_prefix_cached_pages": float(len(self.pages)),
                "context_prefix_cached_bytes": float(self.nbytes)}
