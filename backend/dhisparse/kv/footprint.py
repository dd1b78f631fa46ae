"""Device memory of one request under a policy: the numbers admission reserves and the docs quote."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.device_pool import keys_per_page

INDEX_BYTES = 8  # int64 page-table entries and LRU fields


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Footprint:
    """Required device memory of one request (never lent to others), per policy.

    The non-speculative part is what the request needs with one new token per step; the speculative part is
    exactly ``ring_bytes + staging_bytes``.

    Attributes:
        capacity_rows: positions the request may ever write: ``prompt + max_new + max_query_len - 1``.
        num_pages: pages covering ``capacity_rows`` (page-table length per source).
        tail_pages: pages per source of the tail ring (``resident``: every page of the request).
        hot_pages: pages per source backing the hot cache of ``B`` rows (0 for ``resident``).
        staging_pages: arena pages of the request's verification staging (all slots together).
        staging_slots: staging slots (``KVLayout.staging_slots`` when there are staging rows, else 0).
        staging_rows: rows per staging slot (``KVConfig.staging_rows``); slot ``j`` uses the first
            ``staging_rows`` rows of pages ``j * ceil(staging_rows / page_rows) ...``.
        page_bytes: bytes of one arena page.
        pages_bytes: non-speculative arena pages: ``num_sources * (tail pages + hot_pages) * page_bytes`` with
            the tail of a one-token step.
        metadata_bytes: page tables (int64 per page and source) and LRU state (position, stamp and
            location, int64 each, per hot slot and source), for a one-token step.
        index_key_bytes: arena pages of the indexer keys of every indexer layer for a one-token step's capacity
            (keys live in arena pages, ``keys_per_page`` positions of one layer per page; ``kv/index_keys.py``).
        key_blocks: key pages per indexer layer for the whole capacity (``capacity_rows``, verification block
            included); the request holds ``len(indexer_layers) * key_blocks`` key pages from admission on.
        ring_bytes: the draft ring buffer (``KVConfig.draft_ring_bytes``).
        staging_overflow_bytes: ``staging_pages * page_bytes``: rows of a verification step's union of
            selections that the hot cache cannot take.
        model_state_bytes: ``KVConfig.model_state_bytes`` (a model family's per-request state beside the
            hierarchy; part of the non-speculative required memory).
        staging_block_bytes: room for the verification block's own ``max_query_len - 1`` provisional rows
            beyond the one-token footprint: extra tail-ring pages per source, indexer keys and page-table
            entries of the ``max_query_len - 1`` extra positions.
    """

    capacity_rows: int
    num_pages: int
    tail_pages: int
    hot_pages: int
    page_bytes: int
    pages_bytes: int
    metadata_bytes: int
    index_key_bytes: int
    key_blocks: int = 0
    staging_pages: int = 0
    staging_slots: int = 0
    staging_rows: int = 0
    ring_bytes: int = 0
    staging_overflow_bytes: int = 0
    staging_block_bytes: int = 0
    model_state_bytes: int = 0

    @property
    def staging_bytes(self) -> int:
        """Verification staging: overflow rows and the block's provisional rows."""
        return self.staging_overflow_bytes + self.staging_block_bytes

    @property
    def speculative_bytes(self) -> int:
        """The speculative state: draft ring + verification staging (0 without a drafter)."""
        return self.ring_bytes + self.staging_bytes

    @property
    def base_bytes(self) -> int:
        """Required memory without the speculative state."""
        return self.pages_bytes + self.metadata_bytes + self.index_key_bytes + self.model_state_bytes

    @property
    def required_bytes(self) -> int:
        return self.base_bytes + self.speculative_bytes

    @property
    def device_pages(self) -> int:
        """Arena pages per source reserved at admission for tail ring + hot cache (staging comes on top)."""
        return self.tail_pages + self.hot_pages

    def staging_locations(self, page_rows: int, pages: torch.Tensor) -> torch.Tensor:
        """``[max(1, staging_slots), staging_rows]`` arena rows of staging slots from the request's staging
        ``pages``: slot ``j`` takes the first ``staging_rows`` rows of its ``staging_pages / staging_slots`` pages
        (with ``KVConfig.staging_share < 1`` the fewer pages are shared by every slot, cyclically)."""
        rows = (pages.unsqueeze(1) * page_rows + torch.arange(page_rows, device=pages.device)).reshape(-1)
        slots = max(1, self.staging_slots)
        per_slot = pages.numel() // slots
        if pages.numel() % slots == 0 and per_slot * page_rows >= self.staging_rows:
            return rows.view(slots, -1)[:, : self.staging_rows].contiguous()
        index = torch.arange(slots * self.staging_rows, device=pages.device) % max(1, rows.numel())
        return rows[index].view(slots, self.staging_rows) if rows.numel() else rows.new_zeros(slots, 0)


def tail_ring_pages(config: KVConfig, max_query_len: int | None = None) -> int:
    """Tail pages per source for the host-backed policies.

    The rows of a step span at most ``ceil((page_rows - 1 + max_query_len) / page_rows)`` pages; one more
    page lets a completed page finish its host backup while the next one fills.
    """
    q = config.max_query_len if max_query_len is None else max_query_len
    return ceil_div(config.page_rows - 1 + q, config.page_rows) + 1


def _pages(layout: KVLayout, config: KVConfig, prompt_len: int, max_new_tokens: int,
           query_len: int) -> tuple[int, int, int]:
    """``(capacity_rows, num_pages, tail_pages)`` for steps of up to ``query_len`` new tokens."""
    capacity = prompt_len + max_new_tokens + query_len - 1
    num_pages = ceil_div(capacity, config.page_rows)
    # without a host store the tail holds every page of the request
    tail = min(tail_ring_pages(config, query_len), num_pages) if config.uses_host else num_pages
    return capacity, num_pages, tail


def request_footprint(layout: KVLayout, config: KVConfig, prompt_len: int, max_new_tokens: int) -> Footprint:
    """The required memory of a request with ``prompt_len`` prompt tokens and ``max_new_tokens`` budget."""
    if prompt_len < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_len and max_new_tokens must be >= 1, got {prompt_len}, {max_new_tokens}")
    sources = layout.num_sources
    page_bytes = config.page_rows * layout.row_bytes
    per_page = keys_per_page(layout, config.page_rows)
    capacity, num_pages, tail_pages = _pages(layout, config, prompt_len, max_new_tokens, config.max_query_len)
    capacity_1, num_pages_1, tail_pages_1 = _pages(layout, config, prompt_len, max_new_tokens, 1)
    hot_rows = config.hot_rows_for(layout)
    hot_pages = ceil_div(hot_rows, config.page_rows)
    lru_bytes = sources * hot_rows * 3 * INDEX_BYTES
    staging_rows = config.staging_rows(layout)
    staging_slots = layout.staging_slots if staging_rows else 0
    staging_pages = staging_slots * ceil_div(staging_rows, config.page_rows)
    if staging_pages and config.staging_share < 1.0:  # a scaled simulation (see KVConfig.staging_share)
        staging_pages = max(1, round(staging_pages * config.staging_share))
    indexers = len(layout.indexer_layers)
    key_blocks, key_blocks_1 = (ceil_div(c, per_page) if per_page else 0 for c in (capacity, capacity_1))
    block_bytes = (sources * (tail_pages - tail_pages_1) * page_bytes
                   + sources * (num_pages - num_pages_1) * INDEX_BYTES
                   + indexers * (key_blocks - key_blocks_1) * page_bytes)
    return Footprint(
        capacity_rows=capacity,
        num_pages=num_pages,
        tail_pages=tail_pages,
        hot_pages=hot_pages,
        page_bytes=page_bytes,
        pages_bytes=sources * (tail_pages_1 + hot_pages) * page_bytes,
        metadata_bytes=sources * num_pages_1 * INDEX_BYTES + lru_bytes,
        index_key_bytes=indexers * key_blocks_1 * page_bytes,
        key_blocks=key_blocks,
        staging_pages=staging_pages,
        staging_slots=staging_slots,
        staging_rows=staging_rows,
        ring_bytes=config.draft_ring_bytes,
        staging_overflow_bytes=staging_pages * page_bytes,
        staging_block_bytes=block_bytes,
        model_state_bytes=config.model_state_bytes,
    )
