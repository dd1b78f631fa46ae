"""Indexer keys in arena pages: where a request's keys live and the few operations on them.

An arena page holds ``keys_per_page`` keys of one indexer layer in the layout's key format (``DevicePool.keys``
views the arena so). A request holds ``key_blocks`` pages per indexer layer for its whole capacity, taken at
admission with its other required pages and zeroed then; position ``p`` of indexer layer ``i`` is key
``p % keys_per_page`` of page ``key_pages[i, p // keys_per_page]``. Past a request's capacity the batch state
points at the pool's zero page, so a step reads the keys of its requests up to its longest one with one gather
and no mask: every key past a request's length is zero (written keys of rejected positions are zeroed again).
The keys therefore cost what requests hold, charged against ``pool_bytes`` like rows (``Footprint.index_key_bytes``),
instead of ``max_batch_size * max_model_len`` slots beside the pool.
"""

from __future__ import annotations

import torch

from dhisparse.kv.config import KVLayout
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.request_state import RequestKV


def zero_pages(pool: DevicePool, pages: torch.Tensor) -> None:
    """Zero whole arena pages (freshly allocated key pages: a freed page may hold old or poisoned values)."""
    if pages.numel():
        pool.arena.index_fill_(0, pool.page_rows_of(pages), 0)


def block_index(positions: torch.Tensor, per_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key block, key within the page)`` of positions."""
    return positions // per_page, positions % per_page


def write_request_keys(pool: DevicePool, layout: KVLayout, req: RequestKV, layer_index: int, start: int,
                       keys: torch.Tensor) -> None:
    """Store keys ``[T, index_key_dim]`` of positions ``start .. start+T-1`` of one request and indexer layer."""
    positions = torch.arange(start, start + keys.shape[0], device=pool.arena.device)
    block, within = block_index(positions, pool.keys_per_page)
    pages = req.key_pages[layer_index].gather(0, block)
    pool.keys.index_put_((pages, within), layout.encode_keys(keys.to(pool.arena.device)))


def zero_request_keys(pool: DevicePool, req: RequestKV, start: int, stop: int) -> None:
    """Zero the keys of positions ``start .. stop-1`` of every indexer layer of one request (rejected rows)."""
    if stop <= start or req.key_pages.shape[0] == 0:
        return
    positions = torch.arange(start, stop, device=pool.arena.device)
    block, within = block_index(positions, pool.keys_per_page)
    pages = req.key_pages[:, block]  # [L, n]
    pool.keys.index_put_((pages, within.expand_as(pages)), pool.keys.new_zeros(()))  # no host value to copy


def gather_keys(pool: DevicePool, pages: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Stored keys ``[..., stop - start, key_storage_dim]`` of positions ``start .. stop-1`` from key-page tables
    ``pages [..., KB]`` (one gather of the pages covering them; ``stop`` within ``KB`` pages)."""
    per_page = pool.keys_per_page
    first, blocks = start // per_page, -(-stop // per_page)
    if first or blocks < pages.shape[-1]:
        pages = pages[..., first:blocks]
    keys = pool.keys[pages].flatten(-3, -2)  # [..., n * per_page, D]
    lo, hi = start - first * per_page, stop - first * per_page
    return keys if (lo, hi) == (0, keys.shape[-2]) else keys[..., lo:hi, :]


def request_keys(pool: DevicePool, key_pages: torch.Tensor, stop: int) -> torch.Tensor:
    """Stored keys ``[L, stop, key_storage_dim]`` of positions ``0 .. stop-1`` of every indexer layer of one
    request (``key_pages`` ``[L, KB]``; for checks and tests)."""
    return gather_keys(pool, key_pages, 0, stop)


class RequestKeys:
    """One admitted request's indexer keys in place, for a writer outside a step (the streamed prefill):
    ``write`` / ``read`` positions of one indexer layer in its key pages. Native key format only (what is read is
    exactly what was written)."""

    def __init__(self, pool: DevicePool, layout: KVLayout, req: RequestKV, layer_index: dict[int, int]) -> None:
        if layout.index_key_format != "native":
            raise ValueError("keys written in place are read back exactly only in the native key format")
        self.pool, self.layout, self.req, self.layer_index = pool, layout, req, layer_index

    def write(self, layer: int, start: int, keys: torch.Tensor) -> None:
        write_request_keys(self.pool, self.layout, self.req, self.layer_index[layer], start, keys)

    def read(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Keys ``[stop - start, index_key_dim]`` of positions ``start .. stop-1`` (one gather of their pages)."""
        if -(-stop // self.pool.keys_per_page) > self.req.key_pages.shape[1]:
            raise ValueError(f"keys up to position {stop} are past the request's capacity")
        return self.layout.decode_keys(gather_keys(self.pool, self.req.key_pages[self.layer_index[layer]], start,
                                                   stop))
