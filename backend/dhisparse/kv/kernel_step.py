"""The KV step's CUDA-kernel path: resolution and host fetch of one source without a host round trip, and
sparse MLA attention over the resolved locations.

:class:`dhisparse.kv.step.StepKV` calls into this module only when the manager's kernel selection runs on the
device (``selection.kernels.on_device``); the torch path of ``StepKV`` is untouched otherwise.

Per source (and, for a GLM index group, for every source of the group at the leader layer, so that the
shared layers' rows are copied ahead on the copy stream while the current layer attends):

1. the resolver kernel runs on the current stream (outputs padded with ``-1``, hot-cache state updated on
   the device);
2. the missing rows' host indices are computed on the device from the request's host pages
   (``host_page * P + position % P``, ``-1`` where there is nothing to copy);
3. one row-copy kernel launch on the copy stream (``CopyEngine.issue_gather``, after the current stream's
   work) reads them from pinned host memory into their hot-cache slots — through the host store's mapped view
   when it has several chunks, so one launch whatever their number (:func:`_host_source`); the resolver's
   status column is copied to pinned memory in the same stream order and checked when the ticket completes
   (a hot-cache overflow raises :class:`HotCacheOverflowError` then, at the latest in ``end_step``);
4. readers make the current stream wait for the copy's event (``CopyEngine.wait_for_read``) instead of
   synchronising the host.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dhisparse.kernels.resolver import HotCacheOverflowError, Resolution

if TYPE_CHECKING:
    from dhisparse.kv.copies import CopyTicket
    from dhisparse.kv.step import StepKV, StepParts


# Host page ids of each open step's requests on the device ([B, S, M]), moved once per step, not per source.
_DEVICE_HOST_PAGES: weakref.WeakKeyDictionary[StepKV, torch.Tensor] = weakref.WeakKeyDictionary()


def _device_host_pages(step: StepKV, device: torch.device) -> torch.Tensor:
    pages = _DEVICE_HOST_PAGES.get(step)
    if pages is None:
        assert step.host_pages is not None
        pages = step.host_pages.to(device, non_blocking=True)
        _DEVICE_HOST_PAGES[step] = pages
    return pages


def resolve_on_device(step: StepKV, manager: StepParts, source: int, positions: torch.Tensor
                      ) -> tuple[Resolution, CopyTicket | None]:
    """Resolve ``positions [B, X, K]`` of ``source`` with the resolver kernel and issue the host fetch of
    its misses with the row-copy kernel. Updates ``step.hot_pos`` / ``hot_stamp`` / ``counts`` like the torch
    path. The returned resolution's copy fields are the kernel's padded ``[B * N]`` lists (``-1`` = none)."""
    kernels = manager.kernels.kernels
    page_rows = manager.pool.page_rows
    batch = len(step.requests)
    flat = positions.reshape(batch, -1).contiguous()
    out = kernels.resolve_padded(flat, step.page_table[:, source], step.hot_pos[:, source],
                                 step.hot_stamp[:, source], step.hot_loc[:, source], step.stamp, page_rows)
    step.store_hot(source, out["hot_pos"], out["hot_stamp"])
    step.counts += out["summary"][:, 3:6].to(torch.int64)
    n = flat.shape[1]
    resolution = Resolution(
        locations=out["locations"], steps=out["steps"], hot_pos=out["hot_pos"], hot_stamp=out["hot_stamp"],
        copy_request=torch.arange(batch, device=flat.device).repeat_interleave(n),
        copy_position=out["copy_position"].reshape(-1), copy_slot=out["copy_slot"].reshape(-1),
        copy_location=out["copy_location"].reshape(-1), counts=out["summary"][:, 3:6].to(torch.int64),
        staged=torch.zeros(batch, dtype=torch.int64, device=flat.device),  # the kernel path runs without staging
    )
    if step.host_pages is None:  # resident policy: every row is direct, nothing can miss
        return resolution, None
    host_pages = _device_host_pages(step, flat.device)[:, source]  # [B, M] host page ids
    wanted = out["copy_position"]
    valid = wanted >= 0
    safe = wanted.clamp(min=0)
    page = host_pages.gather(1, (safe // page_rows).clamp(max=host_pages.shape[1] - 1))
    src_rows = torch.where(valid, page * page_rows + safe % page_rows, torch.full_like(safe, -1))
    status = out["summary"][:, 0].contiguous()

    def check_status() -> None:
        watched = ticket.watched
        if watched is not None and bool((watched != 0).any()):
            row = int(torch.nonzero(watched)[0])
            raise HotCacheOverflowError(
                f"request row {row} (source {source}): the resolver kernel found more missing rows than its "
                f"hot cache of {step.hot_pos.shape[2]} slots can take; raise hot_rows (B)")

    host, src_rows, launch = _host_source(kernels.copy_rows, manager.host.rows, src_rows, flat.device)
    ticket = manager.copies.issue_gather("fetch", manager.pool.arena, out["copy_location"], host, src_rows, launch,
                                         on_done=check_status, watch=status)
    return resolution, ticket


def _host_source(launch: Callable[..., None], host: object, src_rows: torch.Tensor, device: torch.device
                 ) -> tuple[object, torch.Tensor, Callable[..., None]]:
    """What the row-copy kernel reads the host rows ``src_rows`` (global host rows, ``-1`` = none) from: a store
    of one chunk directly; a store of several chunks through its mapped view (``ChunkedRows.mapped``: every chunk
    as one span aliasing the pinned memory), the rows translated to span rows on the device — **one launch
    whatever the number of chunks**; only where no such view exists, one launch per chunk (``_per_chunk``)."""
    chunks = getattr(host, "chunks", None)
    if chunks is None or len(chunks) <= 1:
        return (chunks[0] if chunks else host), src_rows, launch
    mapped = host.mapped(device)  # type: ignore[attr-defined]
    if mapped is None:
        return host, src_rows, _per_chunk(launch, host)
    return mapped.span, torch.where(src_rows >= 0, mapped.span_rows(src_rows.clamp(min=0)), -1), launch


def _per_chunk(launch: Callable[..., None], host: object) -> Callable[..., None]:
    """The row-copy launch over the host store's fixed chunks (``ChunkedRows``): one launch per allocated chunk,
    each with the source rows of the other chunks masked to ``-1`` (chunk-local indices; the number of chunks
    is known on the host, so nothing is read from the device)."""
    chunks = getattr(host, "chunks", None)
    if chunks is None:
        return launch
    chunk_rows = host.chunk_rows  # type: ignore[attr-defined]

    def run(_host: object, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
            stream: object = None) -> None:
        for k, chunk in enumerate(chunks):
            mine = (src_rows >= 0) & (src_rows // chunk_rows == k)
            launch(chunk, dst, torch.where(mine, src_rows - k * chunk_rows, -1), dst_rows, stream=stream)

    return run


def attend(manager: StepParts, locations: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
           softmax_scale: float) -> torch.Tensor | None:
    """``out_lat [B, Q, H, rank]`` of sparse MLA over arena rows ``locations [B, Q, K]`` by the selected
    kernel, or ``None`` when the selection has no device kernel for these dtypes (the model computes it)."""
    kernels = manager.kernels.kernels
    arena = manager.pool.arena
    if not kernels.on_device or not kernels.supports_attention(q_lat.dtype, arena.dtype):
        return None
    dtype = arena.dtype
    out = kernels.sparse_mla(q_lat.to(dtype), q_pe.to(dtype), arena, locations, softmax_scale)
    return out.to(q_lat.dtype)
