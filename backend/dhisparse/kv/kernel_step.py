"""The KV step's CUDA-kernel path: resolution and host fetch of an index group without a host round trip, and
sparse MLA attention over the resolved locations.

:class:`dhisparse.kv.step.StepKV` calls into this module only when the manager's kernel selection runs on the
device (``selection.kernels.on_device``); the torch path of ``StepKV`` is untouched otherwise.

Per index group (the sources a GLM leader layer's selection serves, or one source), at its first reader:

1. **one step-resolver launch** for the whole batch and every source of the group (``CudaKernels.resolve_step``,
   ``StepResolveArgs`` of ``plugins/common/include/dhisparse/launch.h``): it reads the step's page-table snapshot
   and the hot state and host page ids where they live in the batch state's slots, updates the hot state in place,
   takes verification staging rows for misses past the evictable slots, adds the per-request counts (and staged
   rows) into the step's report, or-s its error bits into a flag word, and writes each source's fetch list (host
   rows → arena rows, ``-1`` padded) in the same launch;
2. per source, one row-copy kernel launch on the copy stream (``CopyEngine.issue_gather``, after the current
   stream's work) reads the rows from pinned host memory into their hot slots or staging rows — through the host
   store's mapped view when it has several chunks, so one launch whatever their number (:func:`_host_source`); a
   shared layer's rows are copied while the leader attends;
3. readers make the current stream wait for the copy's event (``CopyEngine.wait_for_read``) instead of
   synchronising the host; the flag word is folded into the step's flags, read once with the report.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dhisparse.host_values import to_device

if TYPE_CHECKING:
    from dhisparse.kv.copies import CopyTicket
    from dhisparse.kv.step import StepKV, StepParts

# Step-constant device values (stamp [1], slots [B]) of each open step, moved once per step.
_STEP_VALUES: weakref.WeakKeyDictionary[StepKV, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def _step_values(step: StepKV, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = _STEP_VALUES.get(step)
    if values is None:
        both = to_device([step.stamp, *step.slots], torch.int64, device)
        values = _STEP_VALUES[step] = (both[:1], both[1:])
    return values


def resolve_group_on_device(step: StepKV, manager: StepParts, sources: torch.Tensor, staging_slots: list[int] | None,
                            positions: torch.Tensor) -> tuple[torch.Tensor, list[CopyTicket | None], torch.Tensor]:
    """Resolve ``positions [B, X, K]`` for the group's ``sources [G]`` (a device int64 tensor) with one
    step-resolver launch and issue each source's host fetch with the row-copy kernel.

    ``staging_slots``: each source's verification staging slot (distinct), or ``None`` without staging. Returns
    ``locations [G, B, X*K]``, one copy ticket per source (``None`` without a host store) and the launch's int32
    error bits ``[1]`` (``kernels.native.STEP_*``; the caller folds them into the step's flags)."""
    kernels = manager.kernels.kernels
    device = manager.device
    batch = len(step.requests)
    state = step._batch
    flat = positions.reshape(batch, -1).contiguous()
    stamp, slots = _step_values(step, device)
    staging = None
    if staging_slots is not None:
        first = staging_slots[0]
        consecutive = staging_slots == list(range(first, first + len(staging_slots)))
        staging = step.staging_loc[:, first: first + len(staging_slots)] if consecutive else \
            step.staging_loc[:, to_device(staging_slots, torch.int64, device)]
    groups, n = sources.numel(), flat.shape[1]
    out = {"locations": torch.empty(groups, batch, n, dtype=torch.int64, device=device),
           "fetch_src": torch.empty(groups, batch, n, dtype=torch.int64, device=device),
           "fetch_dst": torch.empty(groups, batch, n, dtype=torch.int64, device=device),
           "counts": step.counts, "staged": step.staged,
           "flags": torch.zeros(1, dtype=torch.int32, device=device)}
    host_pages = state.host_pages if manager.uses_host else None
    kernels.resolve_step(stamp, flat, step.lengths, sources, slots, step.page_table, state.hot_pos, state.hot_stamp,
                         state.hot_loc, host_pages, staging, manager.pool.page_rows, out)
    if step._scatter is not None:  # the step's gathered copy of the hot state is stale: read again on use
        step._slot_state.pop("hot_pos", None)
        step._slot_state.pop("hot_stamp", None)
    tickets: list[CopyTicket | None] = [None] * groups
    if host_pages is not None:
        for g in range(groups):
            host, src, launch = _host_source(kernels.copy_rows, manager.host.rows, out["fetch_src"][g], device)
            tickets[g] = manager.copies.issue_gather("fetch", manager.pool.arena, out["fetch_dst"][g], host, src,
                                                     launch)
    return out["locations"], tickets, out["flags"]


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
