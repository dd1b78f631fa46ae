"""Device memory of one request under a policy: the numbers admission reserves and the docs quote."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.kv.config import KVConfig, KVLayout

INDEX_BYTES = 8  # int64 page-table entries and LRU fields


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Footprint:
    """Required device memory of one request (never lent to others), per policy.

    Attributes:
        capacity_rows: positions the request may ever write: ``prompt + max_new + max_query_len - 1``.
        num_pages: pages covering ``capacity_rows`` (page-table length per source).
        tail_pages: pages per source of the tail ring (``resident``: every page of the request).
        hot_pages: pages per source backing the hot cache of ``B`` rows (0 for ``resident``).
        page_bytes: bytes of one arena page.
        pages_bytes: ``num_sources * (tail_pages + hot_pages) * page_bytes``.
        metadata_bytes: page tables (int64 per page and source) and LRU state (position, stamp and
            location, int64 each, per hot slot and source).
        index_key_bytes: indexer keys of every indexer layer for ``capacity_rows`` positions.
        speculative_bytes: the request's speculative state (``KVConfig.extra_required_bytes``).
    """

    capacity_rows: int
    num_pages: int
    tail_pages: int
    hot_pages: int
    page_bytes: int
    pages_bytes: int
    metadata_bytes: int
    index_key_bytes: int
    speculative_bytes: int = 0

    @property
    def required_bytes(self) -> int:
        return self.pages_bytes + self.metadata_bytes + self.index_key_bytes + self.speculative_bytes

    @property
    def device_pages(self) -> int:
        """Arena pages per source reserved at admission (tail ring + hot cache)."""
        return self.tail_pages + self.hot_pages


def tail_ring_pages(config: KVConfig) -> int:
    """Tail pages per source for the host-backed policies.

    The rows of a step span at most ``ceil((page_rows - 1 + max_query_len) / page_rows)`` pages; one more
    page lets a completed page finish its host backup while the next one fills.
    """
    return ceil_div(config.page_rows - 1 + config.max_query_len, config.page_rows) + 1


def request_footprint(layout: KVLayout, config: KVConfig, prompt_len: int, max_new_tokens: int) -> Footprint:
    """The required memory of a request with ``prompt_len`` prompt tokens and ``max_new_tokens`` budget."""
    if prompt_len < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_len and max_new_tokens must be >= 1, got {prompt_len}, {max_new_tokens}")
    sources = layout.num_sources
    capacity = prompt_len + max_new_tokens + config.max_query_len - 1
    num_pages = ceil_div(capacity, config.page_rows)
    page_bytes = config.page_rows * layout.row_bytes
    if config.uses_host:
        tail_pages = min(tail_ring_pages(config), num_pages)
        hot_pages = ceil_div(config.hot_rows, config.page_rows)
        lru_bytes = sources * config.hot_rows * 3 * INDEX_BYTES
    else:
        tail_pages, hot_pages, lru_bytes = num_pages, 0, 0
    return Footprint(
        capacity_rows=capacity,
        num_pages=num_pages,
        tail_pages=tail_pages,
        hot_pages=hot_pages,
        page_bytes=page_bytes,
        pages_bytes=sources * (tail_pages + hot_pages) * page_bytes,
        metadata_bytes=sources * num_pages * INDEX_BYTES + lru_bytes,
        index_key_bytes=len(layout.indexer_layers) * capacity * layout.index_key_bytes,
        speculative_bytes=config.extra_required_bytes,
    )
