"""How a step resolves selected positions to arena rows (a mixin of :class:`~dhisparse.kv.step.StepKV`).

- **Direct steps** (every request's whole history direct, decided on the host at ``begin_step``): a page-table lookup
  giving the same locations as :func:`~dhisparse.kernels.resolver.resolve`, which would find every position direct and
  leave the hot cache untouched; the checks (position past the length, unmapped page) and the direct-row counts
  are deferred and settled once per step (:meth:`StepResolution._settle_deferred`, called by ``report``).
- **Otherwise** the torch resolver (on the device, fixed-shape fetch list) or, with the CUDA kernels and no
  verification staging, the resolver and row-copy kernels; on a CPU device with the native library selected
  (``kernels="auto"``) and no verification staging, one call of the library per source or index group
  (:meth:`StepResolution._resolve_native`).
- **Index groups**: sources selected by the same positions are resolved together, as ``[G, B, ...]`` rows of one
  resolution (a view of the step's state when the sources are consecutive; rows are independent, so each source
  gets what its own call would give), on direct steps and on the torch resolver without staging; host fetches stay
  one copy per source.
- **Hot state** is written into the batch state's slots as soon as it is computed (``store_hot``); ``abort_step``
  restores it from a snapshot taken before the step's first change (``restore_hot_state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dhisparse.host_values import to_device
from dhisparse.kernels import native
from dhisparse.kernels.resolver import HotCacheOverflowError, resolve
from dhisparse.kv import kernel_step
from dhisparse.kv.copies import CopyTicket

if TYPE_CHECKING:
    from dhisparse.kv.batch_state import BatchState
    from dhisparse.kv.request_state import RequestKV
    from dhisparse.kv.step import StepParts


@dataclass
class _Resolved:
    positions: torch.Tensor  # [B, X, K] as passed by the model
    locations: torch.Tensor  # [B, X*K] arena row of every entry (-1 where unused: the arena's last row, zero)
    ticket: CopyTicket | None  # host→device copies of the misses (None under the resident policy)
    staging_slot: int
    staged: bool  # rows may live in the staging slot

# Error flags accumulated on the device during a step (read once, see ``report``).
FLAG_BAD_POSITION, FLAG_OVERFLOW, FLAG_UNMAPPED = range(3)
_FLAG_MESSAGES = (
    "gather: a selected position is at or past the request's length",
    "the resolver's hot cache overflowed: a request misses more rows than its hot cache has evictable slots "
    "plus verification staging rows; raise hot_rows (B) to at least the number of distinct rows one step can "
    "select",
    "tail page of a new row is not mapped (begin_step broke its contract)",
)


_SOURCE_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
_CPU = torch.device("cpu")


def _source_index(sources: list[int], device: torch.device) -> slice | torch.Tensor:
    """The sources of an index group as an index of the source dimension: a slice when they are consecutive (a
    view, no copy; every GLM-style group), else an index tensor on ``device`` (made once per group)."""
    if sources == list(range(sources[0], sources[0] + len(sources))):
        return slice(sources[0], sources[0] + len(sources))
    return _source_tensor(tuple(sources), device)


def _source_tensor(sources: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The sources of a group as an int64 tensor on ``device`` (made once per group and device; the native
    library takes them as a CPU tensor even when consecutive)."""
    key = (sources, device)
    index = _SOURCE_INDEX.get(key)
    if index is None:
        index = _SOURCE_INDEX[key] = to_device(list(sources), torch.int64, device)
    return index


# The native library's step flags and the step's own (flag, error) each sets.
_NATIVE_FLAGS = ((native.STEP_BAD_POSITION, FLAG_BAD_POSITION, ValueError),
                 (native.STEP_HOT_CACHE_OVERFLOW, FLAG_OVERFLOW, HotCacheOverflowError),
                 (native.STEP_UNMAPPED, FLAG_UNMAPPED, RuntimeError))


class StepResolution:
    """Resolution, hot-state and check methods of a step (state set up by ``StepKV.__init__``)."""

    _m: StepParts
    _batch: BatchState
    _scatter: torch.Tensor | None
    _resolved: dict[int, _Resolved]
    _deferred: list[tuple[torch.Tensor, torch.Tensor]]
    _tickets: list[CopyTicket]
    _hot_before: tuple[torch.Tensor, torch.Tensor] | None
    requests: list[RequestKV]
    slots: list[int]
    _slot_state: dict[str, torch.Tensor]
    all_direct: bool
    stamp: int
    resolver_calls: int
    lengths: torch.Tensor
    page_table: torch.Tensor
    query_len: int
    # hot_pos, hot_stamp, hot_loc, host_pages, staging_loc: properties of StepKV (the step's slot rows, read lazily)
    hot_pos: torch.Tensor
    hot_stamp: torch.Tensor
    hot_loc: torch.Tensor
    host_pages: torch.Tensor | None
    staging_loc: torch.Tensor
    counts: torch.Tensor
    staged: torch.Tensor
    flags: torch.Tensor

    def _resolve(self, source: int, positions: torch.Tensor, slot: int) -> None:
        m = self._m
        flat = positions.reshape(len(self.requests), -1)
        if self.all_direct and not m.debug_checks:
            self._resolve_direct([(source, slot)], positions)
            return
        staging = self.staging_loc[:, slot] if self.staging_loc.shape[2] else None
        if m.kernels.native_resolver is not None and staging is None and not self.all_direct:
            self._snapshot_hot()
            self._resolve_native([(source, slot)], positions)  # checks the positions itself
            return
        # Once per resolution (the layers reusing it pass the same positions).
        self._flag(FLAG_BAD_POSITION, (flat >= self.lengths.view(-1, 1)).any(), ValueError)
        if self.all_direct:  # debug_checks: the direct resolution's checks and counts at once
            self._resolve_direct([(source, slot)], positions)
            self._settle_deferred()
            return
        # CUDA kernels: resolve and fetch without a host round trip. The resolver kernel has no staging step yet,
        # so a step with verification staging resolves with the torch resolver (on the device as well).
        self._snapshot_hot()
        if m.kernels.on_device and staging is None:
            kres, kticket = kernel_step.resolve_on_device(self, m, source, positions)
            self.resolver_calls += 1
            if kticket is not None:
                self._tickets.append(kticket)
            self._resolved[source] = _Resolved(positions, kres.locations, kticket, slot, False)
            return
        res = resolve(flat, self.page_table[:, source], self.hot_pos[:, source], self.hot_stamp[:, source],
                      self.hot_loc[:, source], self.stamp, m.pool.page_rows, staging, on_device=True)
        self.resolver_calls += 1
        self.store_hot(source, res.hot_pos, res.hot_stamp)
        self.counts += res.counts
        self.staged += res.staged
        assert res.overflow is not None and res.fetch_mask is not None and res.fetch_position is not None
        self._flag(FLAG_OVERFLOW, res.overflow.any(), HotCacheOverflowError)
        # With staging, the slot's previous rows may be overwritten: their entry must not be reused (decided from
        # the configuration, not from this resolution's counts, so that it costs no host sync).
        staged = staging is not None
        if staged:
            stale = [s for s, e in self._resolved.items() if e.staged and e.staging_slot == slot and s != source]
            for s in stale:
                del self._resolved[s]
        ticket = None
        if self.host_pages is not None:
            # Fixed-shape copy list: misses copy their host row into their hot slot or staging row, every other
            # entry copies host row 0 into the scratch row (resident never misses: its history is all direct).
            assert res.fetch_location is not None
            ticket = self._issue_fetch(*self._fetch_lists(self.host_pages[:, source], res.fetch_mask,
                                                          res.fetch_position, res.fetch_location))
        self._resolved[source] = _Resolved(positions, res.locations, ticket, slot, staged)

    def _resolve_group(self, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """Resolve several sources selected by the same ``positions`` at once: the resolver takes the group's
        state as ``[G, B, ...]`` (a view of the step's tensors when the sources are consecutive) and resolves each
        row on its own, so each source's result is what its own call would give — one resolution (and one fetch
        list) serves the group. Used for direct steps and for steps without verification staging on the torch
        resolver."""
        m, batch = self._m, len(self.requests)
        sources = [s for s, _ in todo]
        groups = len(sources)
        index = _source_index(sources, m.device)
        flat = positions.reshape(batch, -1)
        page_rows = m.pool.page_rows
        if self.all_direct:
            self._resolve_direct(todo, positions)
            return
        self._snapshot_hot()
        if m.kernels.native_resolver is not None:
            self._resolve_native(todo, positions)  # checks the positions itself
            return
        self._flag(FLAG_BAD_POSITION, (flat >= self.lengths.view(-1, 1)).any(), ValueError)

        def by_source(t: torch.Tensor) -> torch.Tensor:  # [B, S, X] → [G, B, X] of the group's sources (a view)
            return t[:, index].transpose(0, 1)

        # Source-major rows ([G, B, ...]): each source's outputs (locations, fetch lists) are contiguous.
        res = resolve(flat.unsqueeze(0).expand(groups, batch, flat.shape[1]), by_source(self.page_table),
                      by_source(self.hot_pos), by_source(self.hot_stamp), by_source(self.hot_loc), self.stamp,
                      page_rows, None, on_device=True)
        self.resolver_calls += groups
        self._store_hot_sources(index, res.hot_pos.transpose(0, 1), res.hot_stamp.transpose(0, 1))
        self.counts += res.counts.sum(0)
        assert res.overflow is not None and res.fetch_mask is not None and res.fetch_position is not None
        self._flag(FLAG_OVERFLOW, res.overflow.any(), HotCacheOverflowError)
        locations = res.locations  # [G, B, N]
        tickets: list[CopyTicket | None] = [None] * groups
        if self.host_pages is not None:  # fixed-shape copy lists (see _resolve), one copy per source
            assert res.fetch_location is not None
            src, dst = self._fetch_lists(by_source(self.host_pages), res.fetch_mask, res.fetch_position,
                                         res.fetch_location)  # [G, B, N], all sources at once
            # Separate copies keep the prefetch: the leader's attention waits only for its own source's rows.
            for g in range(groups):
                tickets[g] = self._issue_fetch(src[g], dst[g])
        for g, (source, slot) in enumerate(todo):
            self._resolved[source] = _Resolved(positions, locations[g], tickets[g], slot, False)

    def _resolve_native(self, todo: list[tuple[int, int]], positions: torch.Tensor, direct: bool = False) -> None:
        """The sources ``todo`` (no verification staging) resolved by one call of the native CPU library (a CPU
        device; ``kernels.native_resolver``): the same results as the torch resolver (checked at start-up). The call
        reads the step's state where it lives (page-table snapshot by request; hot state and host page ids in the
        batch state's slots, the hot state updated there in place), adds the counts into the step's report and
        returns each source's copy list as host → arena rows with its length, which a CPU call's caller may read: a
        source that misses nothing issues no fetch, one that does copies exactly its rows. The position check is
        the call's too; the checks stay flags settled by ``report``, as on the torch path. ``direct``: a direct step
        (see :meth:`_resolve_direct`): page-table lookups only, the hot state untouched."""
        m, batch = self._m, len(self.requests)
        state = self._batch
        sources = _source_tensor(tuple(s for s, _ in todo), _CPU)
        out = native.resolve_step(m.kernels.native_resolver, positions.reshape(batch, -1).contiguous(), self.lengths,
                                  sources, self._native_slots(), self.page_table,
                                  state.hot_pos, state.hot_stamp, state.hot_loc,
                                  state.host_pages if m.uses_host else None, self.counts, self.stamp,
                                  m.pool.page_rows, direct_only=direct)
        self.resolver_calls += len(todo)
        if self._scatter is not None and not direct:  # the step's gathered hot state is stale: read again on use
            self._slot_state.pop("hot_pos", None)
            self._slot_state.pop("hot_stamp", None)
        if out.flags & native.STEP_NO_HOST_COPY:
            raise RuntimeError("a missed row has no host copy (its page was never backed up): the KV hierarchy's "
                               "residency invariant is broken")
        for bit, flag, error in _NATIVE_FLAGS:  # raised with the step's other checks
            if out.flags & bit:
                self._flag(flag, torch.ones((), dtype=torch.bool), error)
        ok = not out.flags
        for (source, slot), locations, width, g in zip(todo, out.locations.unbind(0), out.fetch_count,
                                                       range(len(todo)), strict=True):
            ticket = self._issue_fetch(out.fetch_src[g, :width], out.fetch_dst[g, :width]) if width and ok else None
            self._resolved[source] = _Resolved(positions, locations, ticket, slot, False)

    def _native_slots(self) -> torch.Tensor:
        """The step's slots as a CPU int64 tensor (made on first use)."""
        slots = self._slot_state.get("slots")
        if slots is None:
            slots = self._slot_state["slots"] = torch.tensor(self.slots, dtype=torch.int64)
        return slots

    def _fetch_lists(self, host_pages: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                     locations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host and arena rows ``(src, dst)`` of a fixed-shape copy list ``[..., N]`` (any leading shape, matching
        the requests' host page ids ``host_pages [..., M]``): where ``mask``, the host row of ``positions`` goes to
        arena row ``locations``; every other entry copies host row 0 into the scratch row."""
        m = self._m
        page = host_pages.gather(-1, (positions // m.pool.page_rows).clamp(max=host_pages.shape[-1] - 1))
        return (torch.where(mask, m.host.rows_of(page, positions), 0),
                torch.where(mask, locations, m.pool.scratch_row))

    def _issue_fetch(self, src: torch.Tensor, dst: torch.Tensor) -> CopyTicket:
        m = self._m
        ticket = m.copies.issue("fetch", m.pool.arena, dst.reshape(-1), m.host.rows, src.reshape(-1))
        self._tickets.append(ticket)
        return ticket

    def _store_hot_sources(self, index: slice | torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor) -> None:
        """New hot state ``[B, G, hot_rows]`` of the sources ``index``, written into the slots in place."""
        self.hot_pos[:, index] = hot_pos
        self.hot_stamp[:, index] = hot_stamp
        if self._scatter is not None:
            slots = self._scatter if isinstance(index, slice) else self._scatter.unsqueeze(1)
            self._batch.hot_pos[slots, index] = hot_pos
            self._batch.hot_stamp[slots, index] = hot_stamp

    def _resolve_direct(self, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """Resolver step 1 alone for the sources of ``todo`` (``(source, staging slot)``, selected by the same
        ``positions``), for a step whose every request has its whole history direct (decided on the host at
        ``begin_step``): a page-table lookup giving the locations :func:`resolve` would, which would find every
        position direct and leave the hot cache untouched. Its checks (position past the length, unmapped page) and
        its counts are deferred to :meth:`report`, done once for every direct resolution of the step. With the native
        CPU library the lookup, its checks and its counts are one call (``native.resolve_step(direct_only=True)``),
        nothing deferred."""
        if self._m.kernels.native_resolver is not None:
            self._resolve_native(todo, positions, direct=True)
            return
        page_rows = self._m.pool.page_rows
        flat = positions.reshape(len(self.requests), -1)
        table = self.page_table[:, _source_index([s for s, _ in todo], self._m.device)]  # [B, G, M]
        pidx = (flat // page_rows).clamp_(0, table.shape[2] - 1)  # an unused entry (-1) reads page 0
        page = table.gather(2, pidx.unsqueeze(1).expand(-1, len(todo), -1))
        loc = page * page_rows + (flat % page_rows).unsqueeze(1)  # negative where unmapped (flagged)
        locations = torch.where((flat >= 0).unsqueeze(1), loc, -1)  # [B, G, N]
        for (source, slot), source_locations in zip(todo, locations.unbind(1), strict=True):
            self._deferred.append((flat, source_locations))
            self._resolved[source] = _Resolved(positions, source_locations, None, slot, False)
        self.resolver_calls += len(todo)

    def _settle_deferred(self) -> None:
        """Check and count the direct resolutions so far, all in one set of operations: an unmapped page of a
        valid entry is flagged; per request, the distinct valid positions of each resolution are counted as direct
        rows (as :func:`resolve` does), summed over the resolutions."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        raw = torch.cat([f for f, _ in deferred], dim=1) if len(deferred) > 1 else deferred[0][0]
        locs = torch.cat([loc for _, loc in deferred], dim=1) if len(deferred) > 1 else deferred[0][1]
        valid = raw >= 0
        self._flag(FLAG_BAD_POSITION, (raw >= self.lengths.view(-1, 1)).any(), ValueError)
        self._flag(FLAG_UNMAPPED, ((locs < 0) & valid).any(), RuntimeError)
        sizes = [f.shape[1] for f, _ in deferred]
        if self.query_len == 1:  # one query per request: its selection's valid positions are distinct (a top-k)
            self.counts.select(1, 0).add_(valid.sum(dim=1))
            return
        if len(set(sizes)) == 1:  # one sort of every resolution's row: [B, R, N], unused entries (< 0) first
            ordered = torch.sort(raw.view(raw.shape[0], len(sizes), sizes[0]), dim=2).values
        else:  # positions of different resolutions kept distinct in one sort: resolution i adds i * 2^40
            offsets = torch.cat([torch.full((n,), i << 40, dtype=torch.int64, device=raw.device)
                                 for i, n in enumerate(sizes)])
            ordered = torch.sort(torch.where(valid, raw + offsets, -1), dim=1).values
        distinct = ordered >= 0  # valid and unlike the entry before it
        distinct[..., 1:].logical_and_(ordered[..., 1:] != ordered[..., :-1])
        self.counts.select(1, 0).add_(distinct.flatten(1).sum(dim=1))

    def _snapshot_hot(self) -> None:
        """Keep the hot state from before the step's first change (``abort_step`` restores it)."""
        if self._hot_before is None:
            self._hot_before = (self.hot_pos.clone(), self.hot_stamp.clone())

    def store_hot(self, source: int, hot_pos: torch.Tensor, hot_stamp: torch.Tensor) -> None:
        """A resolution's new hot state ``[B, hot_rows]`` of ``source``, written into the slots in place."""
        self.hot_pos[:, source] = hot_pos
        self.hot_stamp[:, source] = hot_stamp
        if self._scatter is not None:  # the step's rows are a gathered copy: write through to the slots
            self._batch.hot_pos[self._scatter, source] = hot_pos
            self._batch.hot_stamp[self._scatter, source] = hot_stamp

    def restore_hot_state(self) -> None:
        """Roll back the step's hot-cache changes (``abort_step``): slots whose position changed are emptied
        (their rows were refilled), the others get their position and stamp from before the step."""
        if self._hot_before is None:
            return
        pos, stamp = self._hot_before
        changed = self.hot_pos != pos
        new_pos, new_stamp = pos.masked_fill(changed, -1), stamp.masked_fill(changed, 0)
        self.hot_pos.copy_(new_pos)
        self.hot_stamp.copy_(new_stamp)
        if self._scatter is not None:
            self._batch.hot_pos[self._scatter] = new_pos
            self._batch.hot_stamp[self._scatter] = new_stamp

    def _flag(self, flag: int, broken: torch.Tensor, error: type[Exception]) -> None:
        """Record a check on the device; in debug mode read and raise it now (one counted read per check)."""
        if self._m.debug_checks:
            if self._m.sync.read(broken)[0][0]:
                raise error(_FLAG_MESSAGES[flag])
            return
        self.flags[flag : flag + 1].bitwise_or_(broken)  # in place, no write-back
