"""Importing a request's history that an external transfer wrote straight into its host-store pages.

In a disaggregated deployment (``dhisparse.disagg``) the prefill engine runs elsewhere and the decode side
pulls the prompt's rows over NIXL into the pages the host store reserved for the request at admission
(:func:`history_host_rows` names them). The host copy therefore exists before anything is on device, so
the import is the co-located one (:func:`residency.import_prompt_rows`) with the directions turned around:

- complete prompt pages become ``HOST_VALID`` at once (no ``import`` copy, no deferred backup);
- the partial last page goes to the tail ring (host → device);
- ``adaptive`` keeps complete pages on device as optional pages, resident-first and page-major, while the
  budget allows (host → device); they are ``READY`` with a valid host copy, so a later reclaim retires
  them without a backup, and pages left on host are refillable (``may_refill``).

Only policies with a host store (``adaptive``, ``hisparse``) import this way; ``resident`` has no host
store, so its decode side receives the rows in a staging buffer and uses ``import_prompt``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dhisparse.host_values import to_device
from dhisparse.kv.config import KVLayout
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.host_store import HOST_VALID, HostStore
from dhisparse.kv.index_keys import write_request_keys
from dhisparse.kv.policies import KVPolicy
from dhisparse.kv.request_state import OPT_READY, RequestKV


def history_host_rows(req: RequestKV, host: HostStore) -> torch.Tensor:
    """Host-store row index of every prompt position: ``[num_sources, prompt_len]`` int64 (CPU).

    Row ``(s, t)`` of the prompt belongs at global row ``history_host_rows(...)[s, t]`` of ``host.rows`` (a
    :class:`ChunkedRows`: chunk ``r // chunk_rows``, row ``r % chunk_rows``); a page never straddles chunks and its
    rows are consecutive, so a transfer can write one contiguous run per (source, page)."""
    if req.host_pages is None:
        raise ValueError(f"request {req.request_id!r} has no host pages (policy without a host store)")
    positions = torch.arange(req.prompt_len)
    return host.rows_of(req.host_pages[:, positions // host.page_rows], positions.unsqueeze(0))


def import_host_rows(req: RequestKV, policy: KVPolicy, pool: DevicePool, host: HostStore) -> None:
    """Place a prompt whose rows are already in the request's host pages (see the module docstring)."""
    if not policy.uses_host:
        raise ValueError(f"import from host needs a policy with a host store, not {policy.name!r}")
    assert req.host_pages is not None
    page_rows = pool.page_rows
    device = pool.arena.device
    num_sources, length = req.num_sources, req.prompt_len
    rows_at = history_host_rows(req, host)  # [S, T]
    req.length = length
    complete = length // page_rows
    req.host_state[:, :complete] = HOST_VALID

    req.tail_first = complete
    if complete * page_rows < length:
        pos = torch.arange(complete * page_rows, length)
        req.page_table[:, complete] = to_device(req.tail_ring[:, complete % req.tail_pages], None, device)
        dst = req.tail_ring[:, (pos // page_rows) % req.tail_pages] * page_rows + pos % page_rows
        rows = host.rows.index_select(0, rows_at[:, pos].reshape(-1))
        pool.arena.index_copy_(0, to_device(dst.reshape(-1), None, device), to_device(rows, pool.arena.dtype, device))
    if req.prompt_pages == 0 or policy.optional_prompt_pages(length, page_rows) == 0:  # nothing stays optional
        return

    prompt_pages = req.prompt_pages
    order = torch.arange(prompt_pages).unsqueeze(0) * num_sources + torch.arange(num_sources).unsqueeze(1)
    keep_count = min(prompt_pages * num_sources, max(pool.spare_bytes, 0) // pool.page_bytes)
    if keep_count < prompt_pages * num_sources:
        req.may_refill = True  # some complete pages stay on host only; refill may bring them later
    if keep_count == 0:
        return
    pages = pool.allocate(keep_count, optional=True)
    ks, ki = torch.nonzero(order < keep_count, as_tuple=True)
    page_of = torch.empty(keep_count, dtype=torch.int64)
    page_of[order[ks, ki]] = pages  # page-major assignment, as in the co-located import
    req.opt_page[ks, ki] = page_of
    req.opt_state[ks, ki] = OPT_READY
    req.page_table[to_device(ks, None, device), to_device(ki, None, device)] = to_device(page_of, None, device)
    within = torch.arange(page_rows)
    src = (req.host_pages[ks, ki].unsqueeze(1) * page_rows + within).reshape(-1)
    dst = (page_of.unsqueeze(1) * page_rows + within).reshape(-1)
    pool.arena.index_copy_(0, to_device(dst, None, device),
                           to_device(host.rows.index_select(0, src), pool.arena.dtype, device))


def set_index_keys(req: RequestKV, index_keys: Mapping[int, torch.Tensor], layout: KVLayout, pool: DevicePool,
                   layer_index: dict[int, int], what: str = "import") -> None:
    """Check and store the prompt's indexer keys ``{layer: [prompt_len, index_key_dim]}`` (every indexer layer of
    ``layer_index``) in the request's key pages, in the layout's key format (``kv/index_keys.py``). ``what`` names
    the caller in the errors."""
    if set(index_keys) != set(layer_index):
        raise ValueError(f"{what}: index_keys must cover layers {sorted(layer_index)}, got {sorted(index_keys)}")
    for layer, keys in index_keys.items():
        if tuple(keys.shape) != (req.prompt_len, layout.index_key_dim):
            raise ValueError(f"{what}: index_keys[{layer}] must be [{req.prompt_len}, {layout.index_key_dim}], "
                             f"got {list(keys.shape)}")
    for layer, keys in index_keys.items():
        write_request_keys(pool, layout, req, layer_index[layer], 0, keys)
