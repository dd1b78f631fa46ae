"""Resolution by the torch reference (any device): the resolver of ``dhisparse.kernels.resolver`` over the step's state.

- **Set-up**: host-known values (starts, lengths, page and key-block indices of the new tokens) computed on the
  host and moved in one copy; the new rows' arena rows gathered from the page-table snapshot on the device.
- **Direct steps** (every request's whole history direct, decided on the host at ``begin_step``): a page-table lookup
  giving the same locations as :func:`~dhisparse.kernels.resolver.resolve`, which would find every position direct
  and leave the hot cache untouched; the checks (position past the length, unmapped page) and the direct-row counts
  are deferred and settled once per step (:meth:`TorchResolution.settle`, called by ``report``).
- **Otherwise** the resolver on the device with a fixed-shape fetch list (rows that are not misses copy host row 0
  into the arena's scratch row, so the list's length is never needed on the host). An index group's sources are
  resolved together, as ``[G, B, ...]`` rows of one resolution (a view of the step's state when the sources are
  consecutive; rows are independent, so each source gets what its own call would give); with verification staging
  each source is resolved on its own, into its own staging slot. Host fetches stay one copy per source (prefetch:
  a group leader's attention waits only for its own rows).
- **Hot state** is written into the batch state's slots as soon as it is computed (``StepKV.store_hot``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from dhisparse.host_values import to_device
from dhisparse.kernels.resolver import resolve
from dhisparse.kv.copies import CopyTicket
from dhisparse.kv.resolution.common import FLAG_BAD_POSITION, FLAG_OVERFLOW, FLAG_UNMAPPED, Resolved, StepSetup

if TYPE_CHECKING:
    from dhisparse.kv.step import StepKV


class TorchResolution:
    """The torch reference (see the module docstring)."""

    name = "torch"

    def __init__(self) -> None:
        self._sources: dict[tuple[tuple[int, ...], torch.device], slice | torch.Tensor] = {}

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, step: StepKV, starts: list[int], width: int) -> StepSetup:
        m = step.parts
        batch, query_len = len(starts), step.query_len
        first = np.asarray(starts, dtype=np.int64)
        positions = (first[:, None] + np.arange(query_len)).ravel()  # [B*Q], request-major
        values = to_device(torch.from_numpy(np.concatenate(
            (first, first + query_len, *np.divmod(positions, m.page_rows),
             *np.divmod(positions, max(1, m.keys_per_page))))), None, m.device)
        page_index, within_page, key_block, within_key_page = values[2 * batch:].view(4, batch, query_len).unbind(0)
        table = m.batch.page_table[step.rows, :, :width].clone()  # [B, S, M]
        sources = table.shape[1]
        page = table.transpose(0, 1).gather(2, page_index.unsqueeze(0).expand(sources, -1, -1))  # [S, B, Q]
        new_rows = page.mul_(m.page_rows).add_(within_page)  # negative only where a page is unmapped
        # begin_step maps every new row's tail page (its contract, "tail map"): checked in debug mode (a device read)
        unmapped = (new_rows < 0).any() if m.debug_checks else None
        key_pages = m.batch.key_pages[step.rows]
        write_pages = key_pages.transpose(0, 1).gather(2, key_block.unsqueeze(0).expand(key_pages.shape[1], -1, -1))
        return StepSetup(starts=values[:batch], lengths=values[batch: 2 * batch], page_table=table,
                         write_rows=new_rows.clamp_(min=0).view(sources, -1).unbind(0),
                         key_write=(write_pages.unbind(0), within_key_page), unmapped=unmapped)

    # ------------------------------------------------------------------------------------------ resolution
    def resolve(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        m = step.parts
        if step.all_direct:
            self.direct(step, todo, positions)
            if m.debug_checks:
                self.settle(step)
            return
        if m.staging or len(todo) == 1 or m.debug_checks:
            for source, slot in todo:
                self._resolve_source(step, source, slot, positions)
        else:
            self._resolve_group(step, todo, positions)

    def _resolve_source(self, step: StepKV, source: int, slot: int, positions: torch.Tensor) -> None:
        m = step.parts
        flat = positions.reshape(len(step.requests), -1)
        step.flag(FLAG_BAD_POSITION, (flat >= step.lengths.view(-1, 1)).any())
        staging = step.staging_loc[:, slot] if m.staging else None
        res = resolve(flat, step.page_table[:, source], step.hot_pos[:, source], step.hot_stamp[:, source],
                      step.hot_loc[:, source], step.stamp, m.page_rows, staging, on_device=True)
        step.resolver_calls += 1
        step.store_hot(source, res.hot_pos, res.hot_stamp)
        step.counts += res.counts
        step.staged += res.staged
        assert res.overflow is not None and res.fetch_mask is not None and res.fetch_position is not None
        step.flag(FLAG_OVERFLOW, res.overflow.any())
        ticket = None
        host_pages = step.host_pages
        if host_pages is not None:  # resident never misses: its history is all direct
            assert res.fetch_location is not None
            ticket = step.issue_fetch(*fetch_lists(step, host_pages[:, source], res.fetch_mask, res.fetch_position,
                                                   res.fetch_location))
        step.resolved[source] = Resolved(positions, res.locations, ticket, slot, staging is not None)

    def _resolve_group(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """Several sources selected by the same ``positions`` (no staging) as ``[G, B, ...]`` rows of one resolution."""
        m, batch = step.parts, len(step.requests)
        groups = len(todo)
        index = self._source_index([s for s, _ in todo], m.device)
        flat = positions.reshape(batch, -1)
        step.flag(FLAG_BAD_POSITION, (flat >= step.lengths.view(-1, 1)).any())

        def by_source(t: torch.Tensor) -> torch.Tensor:  # [B, S, X] → [G, B, X] of the group's sources (a view)
            return t[:, index].transpose(0, 1)

        # Source-major rows ([G, B, ...]): each source's outputs (locations, fetch lists) are contiguous.
        res = resolve(flat.unsqueeze(0).expand(groups, batch, flat.shape[1]), by_source(step.page_table),
                      by_source(step.hot_pos), by_source(step.hot_stamp), by_source(step.hot_loc), step.stamp,
                      m.page_rows, None, on_device=True)
        step.resolver_calls += groups
        step.store_hot(index, res.hot_pos.transpose(0, 1), res.hot_stamp.transpose(0, 1))
        step.counts += res.counts.sum(0)
        assert res.overflow is not None and res.fetch_mask is not None and res.fetch_position is not None
        step.flag(FLAG_OVERFLOW, res.overflow.any())
        tickets: list[CopyTicket | None] = [None] * groups
        host_pages = step.host_pages
        if host_pages is not None:  # fixed-shape copy lists, one copy per source
            assert res.fetch_location is not None
            src, dst = fetch_lists(step, by_source(host_pages), res.fetch_mask, res.fetch_position, res.fetch_location)
            for g in range(groups):
                tickets[g] = step.issue_fetch(src[g], dst[g])
        for g, (source, slot) in enumerate(todo):
            step.resolved[source] = Resolved(positions, res.locations[g], tickets[g], slot, False)

    def direct(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """Resolver step 1 alone for the sources of ``todo`` (a step whose every history is direct): page-table
        lookups giving the locations :func:`resolve` would; checks and counts deferred to :meth:`settle`."""
        m = step.parts
        flat = positions.reshape(len(step.requests), -1)
        table = step.page_table[:, self._source_index([s for s, _ in todo], m.device)]  # [B, G, M]
        pidx = (flat // m.page_rows).clamp_(0, table.shape[2] - 1)  # an unused entry (-1) reads page 0
        page = table.gather(2, pidx.unsqueeze(1).expand(-1, len(todo), -1))
        loc = page * m.page_rows + (flat % m.page_rows).unsqueeze(1)  # negative where unmapped (flagged)
        locations = torch.where((flat >= 0).unsqueeze(1), loc, -1)  # [B, G, N]
        for (source, slot), source_locations in zip(todo, locations.unbind(1), strict=True):
            step.deferred.append((flat, source_locations))
            step.resolved[source] = Resolved(positions, source_locations, None, slot, False)
        step.resolver_calls += len(todo)

    def settle(self, step: StepKV) -> None:
        """Check and count the direct resolutions so far, all in one set of operations: an unmapped page of a
        valid entry is flagged; per request, the distinct valid positions of each resolution are counted as direct
        rows (as :func:`resolve` does), summed over the resolutions."""
        if not step.deferred:
            return
        deferred, step.deferred = step.deferred, []
        raw = torch.cat([f for f, _ in deferred], dim=1) if len(deferred) > 1 else deferred[0][0]
        locs = torch.cat([loc for _, loc in deferred], dim=1) if len(deferred) > 1 else deferred[0][1]
        valid = raw >= 0
        step.flag(FLAG_BAD_POSITION, (raw >= step.lengths.view(-1, 1)).any())
        step.flag(FLAG_UNMAPPED, ((locs < 0) & valid).any())
        sizes = [f.shape[1] for f, _ in deferred]
        if step.query_len == 1:  # one query per request: its selection's valid positions are distinct (a top-k)
            step.counts.select(1, 0).add_(valid.sum(dim=1))
            return
        if len(set(sizes)) == 1:  # one sort of every resolution's row: [B, R, N], unused entries (< 0) first
            ordered = torch.sort(raw.view(raw.shape[0], len(sizes), sizes[0]), dim=2).values
        else:  # positions of different resolutions kept distinct in one sort: resolution i adds i * 2^40
            offsets = torch.cat([torch.full((n,), i << 40, dtype=torch.int64, device=raw.device)
                                 for i, n in enumerate(sizes)])
            ordered = torch.sort(torch.where(valid, raw + offsets, -1), dim=1).values
        distinct = ordered >= 0  # valid and unlike the entry before it
        distinct[..., 1:].logical_and_(ordered[..., 1:] != ordered[..., :-1])
        step.counts.select(1, 0).add_(distinct.flatten(1).sum(dim=1))

    def attend(self, step: StepKV, locations: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> None:
        return None  # the model attends over the gathered rows

    def _source_index(self, sources: list[int], device: torch.device) -> slice | torch.Tensor:
        """The sources of an index group as an index of the source dimension: a slice when they are consecutive (a
        view, no copy; every GLM-style group), else an index tensor on ``device`` (made once per group)."""
        if sources == list(range(sources[0], sources[0] + len(sources))):
            return slice(sources[0], sources[0] + len(sources))
        key = (tuple(sources), device)
        index = self._sources.get(key)
        if index is None:
            index = self._sources[key] = to_device(sources, torch.int64, device)
        return index


def fetch_lists(step: StepKV, host_pages: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                locations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host and arena rows ``(src, dst)`` of a fixed-shape copy list ``[..., N]`` (any leading shape, matching the
    requests' host page ids ``host_pages [..., M]``): where ``mask``, the host row of ``positions`` goes to arena row
    ``locations``; every other entry copies host row 0 into the scratch row."""
    m = step.parts
    page = host_pages.gather(-1, (positions // m.page_rows).clamp(max=host_pages.shape[-1] - 1))
    return (torch.where(mask, m.host.rows_of(page, positions), 0), torch.where(mask, locations, m.pool.scratch_row))
