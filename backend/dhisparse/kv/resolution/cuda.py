"""Resolution by the CUDA kernels on a GPU: an index group resolved and fetched without a host round trip, and
sparse MLA attention over the resolved locations.

Per index group (the sources a GLM leader layer's selection serves, or one source), at its first reader:

1. **one step-resolver launch** for the whole batch and every source of the group (``CudaKernels.resolve_step``,
   ``StepResolveArgs`` of ``plugins/common/include/dhisparse/launch.h``): it reads the step's page-table snapshot and
   the hot state, host page ids and verification staging rows where they live (the batch state's slots), updates the
   hot state in place, takes staging rows for a verification step's misses past the evictable slots, adds the
   per-request counts and staged rows into the step's report, or-s its error bits into a word that becomes the step's
   flags, and writes each source's fetch list (host rows → arena rows, ``-1`` padded) in the same launch;
2. per source, one row-copy kernel launch on the copy stream (``CopyEngine.issue_gather``, after the current stream's
   work) from that fetch list as it is — through the host store's mapped view when it has several chunks, so one
   launch whatever their number (:func:`host_source`); a shared layer's rows are copied while the leader attends;
3. readers make the current stream wait for the copy's event (``CopyEngine.wait_for_read``) instead of
   synchronising the host.

The set-up and a step whose every history is direct are the torch reference's (page-table lookups on the device). The
group's members must use distinct staging slots to share a launch; otherwise each is launched on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dhisparse.host_values import to_device
from dhisparse.kernels import native
from dhisparse.kv.resolution.common import FLAG_BAD_POSITION, FLAG_NO_HOST_COPY, FLAG_OVERFLOW, Resolved, StepSetup
from dhisparse.kv.resolution.reference import TorchResolution

if TYPE_CHECKING:
    from dhisparse.kv.step import StepKV

# The step resolver's error bits (kernels.native.STEP_*; 16: a source, slot or staging slot out of range) and the
# step's flag each sets.
_FLAGS = ((native.STEP_BAD_POSITION, FLAG_BAD_POSITION), (native.STEP_HOT_CACHE_OVERFLOW, FLAG_OVERFLOW),
          (native.STEP_NO_HOST_COPY | 16, FLAG_NO_HOST_COPY))


class CudaResolution:
    """The CUDA kernels' resolution (see the module docstring); ``kernels`` is the selection's kernel set."""

    name = "cuda"

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels
        self.reference = TorchResolution()
        self._indices: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}  # groups' sources, slots

    def setup(self, step: StepKV, starts: list[int], width: int) -> StepSetup:
        return self.reference.setup(step, starts, width)

    def settle(self, step: StepKV) -> None:
        self.reference.settle(step)

    def resolve(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        if step.all_direct:
            self.reference.resolve(step, todo, positions)
            return
        staging_slots = [slot for _, slot in todo]
        if step.parts.staging and len(set(staging_slots)) != len(staging_slots):
            for item in todo:  # members sharing a staging slot would write the same rows: one launch each
                self._launch(step, [item], positions)
            return
        self._launch(step, todo, positions)

    def _index(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, made once per tuple."""
        key = (values, device)
        index = self._indices.get(key)
        if index is None:
            index = self._indices[key] = to_device(list(values), torch.int64, device)
        return index

    def _launch(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """One step-resolver launch for the sources ``todo`` and their fetches (see the module docstring)."""
        m, state = step.parts, step.parts.batch
        device = m.device
        batch = len(step.requests)
        flat = positions.reshape(batch, -1).contiguous()
        values = step.memo("device_stamp_and_slots", lambda: to_device([step.stamp, *step.slots], torch.int64, device))
        staging = None
        if m.staging and state.staging_loc.shape[2]:
            staging = (state.staging_loc, self._index(tuple(slot for _, slot in todo), device))
        groups, n = len(todo), flat.shape[1]
        out = {name: torch.empty(groups, batch, n, dtype=torch.int64, device=device)
               for name in ("locations", "fetch_src", "fetch_dst")}
        out.update(counts=step.counts, staged=step.staged, flags=torch.zeros(1, dtype=torch.int32, device=device))
        self.kernels.resolve_step(values[:1], flat, step.lengths, self._index(tuple(s for s, _ in todo), device),
                                  values[1:], step.page_table, state.hot_pos, state.hot_stamp, state.hot_loc,
                                  state.host_pages if m.uses_host else None, staging, m.page_rows, out)
        step.resolver_calls += groups  # (the step re-reads a gathered copy of the hot state after this)
        for bit, flag in _FLAGS:
            step.flag(flag, (out["flags"] & bit) != 0)
        for g, (source, slot) in enumerate(todo):
            ticket = None
            if m.uses_host:
                host, src, launch = host_source(self.kernels.copy_rows, m.host.rows, out["fetch_src"][g], device)
                ticket = m.copies.issue_gather("fetch", m.pool.arena, out["fetch_dst"][g], host, src, launch)
                step.tickets.append(ticket)
            step.resolved[source] = Resolved(positions, out["locations"][g], ticket, slot, staging is not None)

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
