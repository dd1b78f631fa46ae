"""Resolution by the CUDA kernels on a GPU: resolution and host fetch of a source without a host round trip, and
sparse MLA attention over the resolved locations.

Per source (and, for a GLM index group, for every source of the group at the leader layer, so that the shared
layers' rows are copied ahead on the copy stream while the current layer attends):

1. the resolver kernel runs on the current stream (outputs padded with ``-1``, hot-cache state updated on the
   device);
2. the missing rows' host indices are computed on the device from the request's host pages
   (``host_page * P + position % P``, ``-1`` where there is nothing to copy);
3. one row-copy kernel launch on the copy stream (``CopyEngine.issue_gather``, after the current stream's work)
   reads them from pinned host memory into their hot-cache slots — through the host store's mapped view when it
   has several chunks, so one launch whatever their number (:func:`host_source`); the resolver's status column is
   copied to pinned memory in the same stream order and checked when the ticket completes (a hot-cache overflow
   raises :class:`HotCacheOverflowError` then, at the latest in ``end_step``);
4. readers make the current stream wait for the copy's event (``CopyEngine.wait_for_read``) instead of
   synchronising the host.

The set-up and a step whose every history is direct are the torch reference's (page-table lookups on the device).
The resolver kernel of this build has no verification staging step: a verification step with staging rows resolves
with the torch reference on the device (the same contract, step 4 included), which the one-launch resolver kernel of
issue #25 replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dhisparse.kernels.resolver import HotCacheOverflowError
from dhisparse.kv.copies import CopyTicket
from dhisparse.kv.resolution.common import FLAG_BAD_POSITION, Resolved, StepSetup
from dhisparse.kv.resolution.reference import TorchResolution

if TYPE_CHECKING:
    from dhisparse.kv.step import StepKV


class CudaResolution:
    """The CUDA kernels' resolution (see the module docstring); ``kernels`` is the selection's kernel set."""

    name = "cuda"

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels
        self.reference = TorchResolution()

    def setup(self, step: StepKV, starts: list[int], width: int) -> StepSetup:
        return self.reference.setup(step, starts, width)

    def settle(self, step: StepKV) -> None:
        self.reference.settle(step)

    def resolve(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        if step.all_direct or step.parts.staging:
            self.reference.resolve(step, todo, positions)
            return
        host_pages = step.host_pages
        device_pages = None  # the host page ids on the device, moved once per step
        if host_pages is not None:
            device_pages = step.memo("device_host_pages", lambda: host_pages.to(positions.device, non_blocking=True))
        for source, slot in todo:
            locations, ticket = self._resolve_source(step, source, positions, device_pages)
            step.resolver_calls += 1
            step.resolved[source] = Resolved(positions, locations, ticket, slot, False)

    def _resolve_source(self, step: StepKV, source: int, positions: torch.Tensor,
                        host_pages: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """Resolve ``positions [B, X, K]`` of ``source`` with the resolver kernel and issue the host fetch of its
        misses with the row-copy kernel; returns the locations ``[B, X*K]`` and the fetch's ticket."""
        m = step.parts
        flat = positions.reshape(len(step.requests), -1).contiguous()
        step.flag(FLAG_BAD_POSITION, (flat >= step.lengths.view(-1, 1)).any())
        out = self.kernels.resolve_padded(flat, step.page_table[:, source], step.hot_pos[:, source],
                                          step.hot_stamp[:, source], step.hot_loc[:, source], step.stamp,
                                          m.page_rows)
        step.store_hot(source, out["hot_pos"], out["hot_stamp"])
        step.counts += out["summary"][:, 3:6].to(torch.int64)
        if host_pages is None:  # resident policy: every row is direct, nothing can miss
            return out["locations"], None
        pages = host_pages[:, source]  # [B, M] host page ids
        wanted = out["copy_position"]
        valid = wanted >= 0
        safe = wanted.clamp(min=0)
        page = pages.gather(1, (safe // m.page_rows).clamp(max=pages.shape[1] - 1))
        src_rows = torch.where(valid, page * m.page_rows + safe % m.page_rows, torch.full_like(safe, -1))
        status = out["summary"][:, 0].contiguous()
        hot_rows = step.hot_pos.shape[2]
        issued: list[CopyTicket] = []

        def check_status() -> None:
            watched = issued[0].watched
            if watched is not None and bool((watched != 0).any()):
                row = int(torch.nonzero(watched)[0])
                raise HotCacheOverflowError(
                    f"request row {row} (source {source}): the resolver kernel found more missing rows than its "
                    f"hot cache of {hot_rows} slots can take; raise hot_rows (B)")

        host, src_rows, launch = host_source(self.kernels.copy_rows, m.host.rows, src_rows, flat.device)
        ticket = m.copies.issue_gather("fetch", m.pool.arena, out["copy_location"], host, src_rows, launch,
                                       on_done=check_status, watch=status)
        issued.append(ticket)
        step.tickets.append(ticket)
        return out["locations"], ticket

    def attend(self, step: StepKV, locations: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> torch.Tensor | None:
        """``out_lat [B, Q, H, rank]`` of sparse MLA over arena rows ``locations [B, Q, K]`` by the kernel, or
        ``None`` when it has no kernel for these dtypes (the model computes it)."""
        arena = step.parts.pool.arena
        if not self.kernels.supports_attention(q_lat.dtype, arena.dtype):
            return None
        dtype = arena.dtype
        out: torch.Tensor = self.kernels.sparse_mla(q_lat.to(dtype), q_pe.to(dtype), arena, locations, softmax_scale)
        return out.to(q_lat.dtype)


def host_source(launch: Callable[..., None], host: Any, src_rows: torch.Tensor, device: torch.device
                ) -> tuple[Any, torch.Tensor, Callable[..., None]]:
    """What the row-copy kernel reads the host rows ``src_rows`` (global host rows, ``-1`` = none) from: a store
    of one chunk directly; a store of several chunks through its mapped view (``ChunkedRows.mapped``: every chunk
    as one span aliasing the pinned memory), the rows translated to span rows on the device — **one launch
    whatever the number of chunks**; only where no such view exists, one launch per chunk (:func:`per_chunk`)."""
    chunks = getattr(host, "chunks", None)
    if chunks is None or len(chunks) <= 1:
        return (chunks[0] if chunks else host), src_rows, launch
    mapped = host.mapped(device)
    if mapped is None:
        return host, src_rows, per_chunk(launch, host)
    return mapped.span, torch.where(src_rows >= 0, mapped.span_rows(src_rows.clamp(min=0)), -1), launch


def per_chunk(launch: Callable[..., None], host: Any) -> Callable[..., None]:
    """The row-copy launch over the host store's fixed chunks (``ChunkedRows``): one launch per allocated chunk,
    each with the source rows of the other chunks masked to ``-1`` (chunk-local indices; the number of chunks is
    known on the host, so nothing is read from the device)."""
    chunks = getattr(host, "chunks", None)
    if chunks is None:
        return launch
    chunk_rows = host.chunk_rows

    def run(_host: object, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
            stream: object = None) -> None:
        for k, chunk in enumerate(chunks):
            mine = (src_rows >= 0) & (src_rows // chunk_rows == k)
            launch(chunk, dst, torch.where(mine, src_rows - k * chunk_rows, -1), dst_rows, stream=stream)

    return run
