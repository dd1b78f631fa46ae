"""A cached page's indexer keys in host-store pages.

A request's indexer keys live only in its arena key pages (``kv/index_keys.py``), which are freed with the request,
and a key block (``keys_per_page`` positions) does not line up with a row page. So when a page becomes a prefix-cache
entry, the keys of its ``page_rows`` positions in every indexer layer (``[L, page_rows, index_key_dim]``, native key
format) are copied to host pages of the same host store, packed: flattened layer-major and laid over
:func:`key_host_pages` host pages viewed as flat memory (a host page holds ``page_rows * storage_dim`` values of
the row dtype, which for native rows and keys is the keys' dtype too). A hit copies them back into the new
request's own key pages (private: a request's key pages are written by its steps). Their host memory counts in
``host_bytes`` like the rows'.

A model whose pages carry further state (``PrefixRows.state_values``, ``kv/prefix_rows.py``; DeepSeek-V4's indexer
keys and HCA entries) has it packed in the same host pages, after the keys.
"""

from __future__ import annotations

import torch

from dhisparse.kv.config import KVLayout
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.host_store import HostStore
from dhisparse.kv.index_keys import gather_keys, write_request_keys
from dhisparse.kv.request_state import RequestKV


def key_values(layout: KVLayout, page_rows: int) -> int:
    """Values of one cached page's indexer keys (every indexer layer)."""
    return len(layout.indexer_layers) * page_rows * layout.index_key_dim


def key_host_pages(layout: KVLayout, page_rows: int, state_values: int = 0) -> int:
    """Host pages that hold one cached page's indexer keys and ``state_values`` further values (0 without either)."""
    values = key_values(layout, page_rows) + state_values
    per_page = page_rows * layout.storage_dim
    return -(-values // per_page)


def _host_rows(host: HostStore, pages: torch.Tensor) -> torch.Tensor:
    return (pages.unsqueeze(1) * host.page_rows + torch.arange(host.page_rows)).reshape(-1)


def save_page_keys(pool: DevicePool, layout: KVLayout, host: HostStore, req: RequestKV, page: int,
                   host_pages: torch.Tensor, state: torch.Tensor | None = None) -> None:
    """Copy the keys of ``req``'s page ``page`` (every indexer layer) and its model ``state`` (``[values]``) into
    ``host_pages`` (device → host, now)."""
    if host_pages.numel() == 0:
        return
    page_rows = host.page_rows
    parts = []
    if layout.indexer_layers:
        keys = gather_keys(pool, req.key_pages, page * page_rows, (page + 1) * page_rows)  # [L, page_rows, D]
        parts.append(keys.reshape(-1).to("cpu", host.dtype))
    if state is not None:
        parts.append(state.reshape(-1).to("cpu", host.dtype))
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=host.dtype)
    packed = torch.zeros(host_pages.numel() * page_rows * host.row_dim, dtype=host.dtype)
    packed[: flat.numel()] = flat
    host.rows.index_copy_(0, _host_rows(host, host_pages), packed.view(-1, host.row_dim))


def load_prefix_keys(pool: DevicePool, layout: KVLayout, host: HostStore, req: RequestKV,
                     key_pages: list[torch.Tensor], state_values: int = 0) -> torch.Tensor | None:
    """Write the cached keys of pages ``0 .. len(key_pages)-1`` (``key_pages[i]``: page ``i``'s packed keys) into
    ``req``'s key pages (host → device, now); returns the pages' model state ``[n, state_values]`` (CPU; ``None``
    without pages or state)."""
    if not key_pages or (not layout.indexer_layers and not state_values):
        return None
    page_rows, n = host.page_rows, len(key_pages)
    per_entry = key_pages[0].numel()
    rows = host.rows.index_select(0, _host_rows(host, torch.cat(key_pages))).view(n, per_entry * page_rows
                                                                                  * host.row_dim)
    layers = len(layout.indexer_layers)
    values = key_values(layout, page_rows)
    if layers:
        keys = rows[:, :values].view(n, layers, page_rows, layout.index_key_dim)
        keys = keys.transpose(0, 1).reshape(layers, n * page_rows, layout.index_key_dim)  # [L, P, D], page-major
        for i in range(layers):
            write_request_keys(pool, layout, req, i, 0, keys[i])
    return rows[:, values:values + state_values] if state_values else None
