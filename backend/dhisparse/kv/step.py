"""StepKV: the KV view of one batched forward (``B`` requests, ``Q`` new tokens each).

Built by :meth:`KVManager.begin_step`, which has already mapped the tail pages for the new rows, so the
state snapshot taken here (page tables, hot caches) stays valid for the whole step. Per layer the model
calls :meth:`write` first, then :meth:`index_keys` / :meth:`gather`. Resolution happens at a source's first
:meth:`gather` (or :meth:`locations`), by the manager's resolution implementation (``kv/resolution/``: torch
reference, CPU library or CUDA kernels, chosen once), once per source and positions tensor; when the layer leads
a GLM-style index group the other sources of the group are resolved at the same time and their host copies
issued ahead (prefetch), and a source shared by several layers reuses the first layer's location vector.

Host reads: no per-layer call reads a device value on the host. Checks (a selected position past the length, a
hot-cache overflow, an unmapped tail row) and the resolver's statistics accumulate on the device and are read
once per step (:meth:`report`, read by ``end_step`` or fused into the engine's own read); with
``KVManager(debug_checks=True)`` the checks are read and raised at once instead.

Verification staging: rows of a step's union of selections that the hot cache cannot take are copied from
host straight into the request's staging slot of the source's position in its index group (one slot per
group position, :attr:`KVLayout.staging_slots`); the location vector points there, so attention reads every
row through one vector from the arena, a hot slot or staging. The next group's resolution reuses the slots
(on CUDA the copy stream waits for the current stream, i.e. for the previous group's attention), and a resolved
entry whose staged rows a later resolution may overwrite is dropped here, whichever implementation resolves, so a
later layer sharing that source resolves again instead of reading another source's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dhisparse.host_values import to_device
from dhisparse.kv.copies import CopyTicket
from dhisparse.kv.index_keys import gather_keys
from dhisparse.kv.request_state import OPT_BACKING_UP, OPT_ON_DEVICE, OPT_READY, OPT_SHARED, RequestKV
from dhisparse.kv.resolution.common import (
    FLAG_ERRORS,
    FLAG_MESSAGES,
    FLAG_UNMAPPED,
    Resolved,
    StepParts,
    StepResolution,
)


def _history_direct(req: RequestKV) -> bool:
    """Whether every page before the tail is a mapped optional page (host-side state only)."""
    tail_first = req.tail_first
    if tail_first == 0:
        return True
    state = req.opt_state.numpy()  # CPU state: numpy is cheaper than torch at this size
    if state.shape[1] < tail_first:
        return False
    return bool(_READABLE[state[:, :tail_first]].all())


_READABLE = np.zeros(max(*OPT_ON_DEVICE, OPT_SHARED) + 1, dtype=bool)  # optional-page states read directly
_READABLE[[OPT_READY, OPT_BACKING_UP, OPT_SHARED]] = True


class StepKV:
    """KV access for one step (the :class:`~dhisparse.kv.store.KVStep` of the hierarchy). Attributes:

    lengths: ``[B]`` int64 (device) history length of each request including the ``Q`` new tokens.
    starts: ``[B]`` int64 (device) position of each request's first new token.
    page_table: ``[B, S, M]`` int64 (device) the step's snapshot of the requests' page tables.
    query_len: ``Q``. max_length: ``max(lengths)``, known on the host.
    counts / staged / flags: views of the report (``[B, 3]`` direct, hot, host rows; ``[B]`` staged rows; flags).
    """

    def __init__(self, parts: StepParts, resolution: StepResolution, requests: list[RequestKV], query_len: int,
                 stamp: int, report: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.parts = parts
        self.resolution = resolution
        self.requests = requests
        self.query_len = query_len
        self.query_tiled_gather = False  # resolves once per source and selection tensor
        self.device_attention = parts.attends_on_device
        self.stamp = stamp
        batch_state = parts.batch
        # The requests' rows of the persistent batch state: a view when their slots are consecutive in step order
        # (updated in place), else one gather per tensor (hot-cache changes are scattered back at each resolve).
        slots = [r.slot for r in requests]
        self.slots = slots
        self.scatter: torch.Tensor | None = None
        self.rows: slice | torch.Tensor = slice(slots[0], slots[0] + len(slots))
        if slots != list(range(slots[0], slots[0] + len(slots))):
            self.rows = self.scatter = to_device(slots, torch.int64, parts.device)
        # Hot caches [B, S, hot_rows], host page ids [B, S, M] and staging rows [B, G, T] of the step's slots are read
        # on first use (slot_rows): a direct step never touches them. Only the step changes them, so a later read
        # sees what a read here would.
        self._slot_state: dict[str, torch.Tensor] = {}
        self._hot_before: tuple[torch.Tensor, torch.Tensor] | None = None  # for abort_step (first change)
        # Indexer keys live in arena pages (kv/index_keys.py): the step's key-page tables [B, L, KB] (a view or one
        # gather; they change only at admission and release), read by index_keys.
        key_pages = batch_state.key_pages[self.rows]
        self._key_blocks = key_pages.shape[2]
        self._key_pages = key_pages.unbind(1)  # per indexer layer [B, KB]
        starts = [r.length for r in requests]
        self.max_length = max(starts) + query_len  # known on the host, no read
        # The report (see report()): counts [B, 3], staged rows [B], flags, as views of one buffer, zeroed.
        self._report, self.counts, self.staged, self.flags = report
        # The resolution's set-up: starts, lengths, the page-table snapshot (a reclaim or a completed backup may unmap
        # a page during the step while the step's readers still use it), the arena rows the new tokens' writes go to
        # (per source [B*Q]) and their indexer keys' pages and offsets (per indexer layer [B, Q]).
        setup = resolution.setup(self, starts, max(r.footprint.num_pages for r in requests))
        self.starts, self.lengths, self.page_table = setup.starts, setup.lengths, setup.page_table
        self.write_rows, self.key_write = setup.write_rows, setup.key_write
        self.slot_index = setup.slot_index  # the step's slots as a CPU int64 tensor (the native resolution's)
        if setup.unmapped is not None:
            self.flag(FLAG_UNMAPPED, setup.unmapped)
        # Every request's whole history direct (resident; adaptive with all prompt pages on device and no page
        # that left the tail): resolution is a page-table lookup. Decided from host state, no device read.
        self.all_direct = all(_history_direct(r) for r in requests)
        self.resolved: dict[int, Resolved] = {}
        self.deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # the resolution's deferred checks (settle)
        self.tickets: list[CopyTicket] = []
        self.resolver_calls = 0  # resolutions (one per source and positions tensor)
        self.closed = False

    # ------------------------------------------------------------------------------------------ state
    def memo(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A value of this step made once, on first use (``make()``)."""
        value = self._slot_state.get(name)
        if value is None:
            value = self._slot_state[name] = make()
        return value

    def slot_rows(self, name: str) -> torch.Tensor:
        """The step's rows of one batch-state tensor: a view (consecutive slots) or a gathered copy, read once."""
        value = self._slot_state.get(name)
        if value is None:
            value = self._slot_state[name] = getattr(self.parts.batch, name)[self.rows]
        return value

    @property
    def hot_pos(self) -> torch.Tensor:
        return self.slot_rows("hot_pos")

    @property
    def hot_stamp(self) -> torch.Tensor:
        return self.slot_rows("hot_stamp")

    @property
    def hot_loc(self) -> torch.Tensor:
        return self.slot_rows("hot_loc")

    @property
    def host_pages(self) -> torch.Tensor | None:
        return self.slot_rows("host_pages") if self.parts.uses_host else None

    @property
    def staging_loc(self) -> torch.Tensor:
        return self.slot_rows("staging_loc")

    def snapshot_hot(self) -> None:
        """Keep the hot state from before the step's first change (``abort_step`` restores it)."""
        if self._hot_before is None:
            self._hot_before = (self.hot_pos.clone(), self.hot_stamp.clone())

    def store_hot(self, index: int | slice | torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor) -> None:
        """New hot state of the sources ``index`` (``[B, hot_rows]`` for one source, ``[B, G, hot_rows]`` for several),
        written into the slots in place."""
        self.hot_pos[:, index] = hot_pos
        self.hot_stamp[:, index] = hot_stamp
        if self.scatter is not None:  # the step's rows are a gathered copy: write through to the slots
            slots = self.scatter if isinstance(index, int | slice) else self.scatter.unsqueeze(1)
            self.parts.batch.hot_pos[slots, index] = hot_pos
            self.parts.batch.hot_stamp[slots, index] = hot_stamp

    def restore_hot_state(self) -> None:
        """Roll back the step's hot-cache changes (``abort_step``): slots whose position changed are emptied
        (their rows were refilled), the others get their position and stamp from before the step."""
        if self._hot_before is None:
            return
        pos, stamp = self._hot_before
        self._slot_state.pop("hot_pos", None)  # read the slots again: an implementation may have written them
        self._slot_state.pop("hot_stamp", None)
        changed = self.hot_pos != pos
        new_pos, new_stamp = pos.masked_fill(changed, -1), stamp.masked_fill(changed, 0)
        self.hot_pos.copy_(new_pos)
        self.hot_stamp.copy_(new_stamp)
        if self.scatter is not None:
            self.parts.batch.hot_pos[self.scatter] = new_pos
            self.parts.batch.hot_stamp[self.scatter] = new_stamp

    def flag(self, flag: int, broken: torch.Tensor) -> None:
        """Record a check on the device; in debug mode read and raise it now (one counted read per check)."""
        if self.parts.debug_checks:
            if self.parts.sync.read(broken)[0][0]:
                raise FLAG_ERRORS[flag](FLAG_MESSAGES[flag])
            return
        self.flags[flag : flag + 1].bitwise_or_(broken)  # in place, no write-back

    def issue_fetch(self, src: torch.Tensor, dst: torch.Tensor) -> CopyTicket:
        """Copy host rows ``src`` (global rows of the host store) into arena rows ``dst``; completed by end_step."""
        m = self.parts
        ticket = m.copies.issue("fetch", m.pool.arena, dst.reshape(-1), m.host.rows, src.reshape(-1))
        self.tickets.append(ticket)
        return ticket

    # ------------------------------------------------------------------------------------------ writes
    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Write the new tokens' rows ``[B, Q, row_dim]`` (and indexer keys ``[B, Q, index_key_dim]`` if the
        layer has an indexer) into the tail; provisional until ``end_step``."""
        if self.closed:
            self._closed()
        m = self.parts
        layout = m.layout
        batch, q = len(self.requests), self.query_len
        if tuple(rows.shape) != (batch, q, layout.row_dim):
            raise ValueError(f"write(layer {layer}): rows must be [{batch}, {q}, {layout.row_dim}], "
                             f"got {list(rows.shape)}")
        flat = rows.reshape(-1, rows.shape[-1])
        stored = flat if m.rows_as_is and flat.dtype == layout.dtype else layout.encode(flat)
        m.pool.arena.index_copy_(0, self.write_rows[layout.source_of_layer[layer]], stored)
        key_layer = m.key_layer[layer]
        if key_layer >= 0:
            if index_keys is None or tuple(index_keys.shape) != (batch, q, layout.index_key_dim):
                raise ValueError(f"write(layer {layer}): index_keys [{batch}, {q}, {layout.index_key_dim}] "
                                 "are required for a layer with an indexer")
            # One indexed write into the requests' key pages in the arena.
            pages, within = self.key_write
            keys = index_keys if m.keys_as_is and index_keys.dtype == layout.dtype else layout.encode_keys(index_keys)
            m.pool.keys.index_put_((pages[key_layer], within), keys)
        elif index_keys is not None:
            raise ValueError(f"layer {layer} has no indexer; pass index_keys=None")

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``[B, stop - start, index_key_dim]`` keys of positions ``start .. stop-1`` (``stop`` defaults to
        ``max_length``: every position incl. the new ones); zero past ``lengths[b]``."""
        if self.closed:
            self._closed()
        m = self.parts
        key_layer = m.key_layer[layer]
        if key_layer < 0:
            raise ValueError(f"layer {layer} has no indexer")
        stop = self.max_length if stop is None else stop
        # Keys are zero past each request's length (zero page past its blocks): one gather of the key pages covering
        # start .. stop-1, no per-request work.
        if -(-stop // m.keys_per_page) > self._key_blocks:
            raise ValueError(f"index_keys(layer {layer}): stop {stop} is past the batch state's "
                             f"{self._key_blocks * m.keys_per_page} positions per slot")
        keys = gather_keys(m.pool, self._key_pages[key_layer], start, stop)
        return keys if m.keys_as_is else m.layout.decode_keys(keys)

    # ------------------------------------------------------------------------------------------ gather
    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows ``[B, X, K, row_dim]`` of the selected ``positions`` ``[B, X, K]`` int64 (``-1`` = unused
        slot, zeros returned there). Every selected position must be below ``lengths[b]``."""
        entry = self._entry(layer, positions)
        # Unused entries (-1) read the arena's last row, the pool's zero row: one index, no mask.
        rows = self.parts.pool.arena[entry.locations]
        if not self.parts.rows_as_is:
            rows = self.parts.layout.decode(rows)
        return rows.view(*positions.shape, -1)

    def attend(self, layer: int, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> torch.Tensor | None:
        """Sparse MLA ``out_lat [B, X, H, rank]`` of ``q_lat [B, X, H, rank]`` / ``q_pe [B, X, H, rope]`` over
        the rows at ``positions`` by the resolution's device kernel, or ``None`` (the caller computes it from
        :meth:`gather`)."""
        if not self.device_attention:
            return None
        return self.resolution.attend(self, self.locations(layer, positions), q_lat, q_pe, softmax_scale)

    def locations(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Arena rows ``[B, X, K]`` of the selected ``positions`` (``-1`` where unused), readable by work issued
        next on the current stream; resolves (and fetches) on first use per source and positions tensor."""
        return self._entry(layer, positions).locations.view_as(positions)

    def _entry(self, layer: int, positions: torch.Tensor) -> Resolved:
        if self.closed:
            self._closed()
        m = self.parts
        source = m.layout.source_of_layer[layer]
        known = self.resolved.get(source)
        if known is not None and known.positions is positions:  # the same selection tensor, already checked
            if known.ticket is not None:
                m.copies.wait_for_read(known.ticket)
            return known
        if positions.dim() != 3 or positions.shape[0] != len(self.requests):
            raise ValueError(f"gather(layer {layer}): positions must be [{len(self.requests)}, X, K]")
        if positions.device != m.device or positions.dtype != torch.int64:
            positions = positions.to(m.device, torch.int64)
        entry = self._lookup(source, positions)
        if entry is None:
            # Resolve this source and (for a group leader) the group's other sources, prefetching theirs.
            todo: dict[int, int] = {}  # source -> staging slot
            for other in m.group_of_layer[layer]:
                other_source = m.layout.source_of_layer[other]
                if other_source not in todo and self._lookup(other_source, positions) is None:
                    todo[other_source] = m.staging_slot_of_layer[other]
            if m.staging:  # the staging slots this resolution fills may hold another source's rows: drop it
                slots = set(todo.values())
                stale = [s for s, e in self.resolved.items() if e.staged and e.staging_slot in slots and s not in todo]
                for s in stale:
                    del self.resolved[s]
            if not self.all_direct:  # the hot state changes: keep it from before the step's first change (abort)
                self.snapshot_hot()
            self.resolution.resolve(self, list(todo.items()), positions)
            if self.scatter is not None and not self.all_direct:  # an implementation may write the slots directly
                self._slot_state.pop("hot_pos", None)
                self._slot_state.pop("hot_stamp", None)
            entry = self.resolved[source]
        if entry.ticket is not None:
            m.copies.wait_for_read(entry.ticket)
        return entry

    def _lookup(self, source: int, positions: torch.Tensor) -> Resolved | None:
        entry = self.resolved.get(source)
        if entry is None:
            return None
        same = entry.positions is positions  # the model passes the group's selection tensor itself
        if not same and entry.positions.shape == positions.shape:  # an equal copy: compare (one counted read)
            same = bool(self.parts.sync.read((entry.positions != positions).any())[0][0] == 0)
        return entry if same else None

    # ------------------------------------------------------------------------------------------ report
    def report(self) -> torch.Tensor:
        """What ``end_step`` reads from the device, as one int64 vector: the per-request resolution counts
        ``[B, 3]`` (flattened), the per-request staged row counts ``[B]``, then the error flags. The engine may
        read it together with its sampled tokens (one transfer) and pass the values to ``end_step(report=...)``."""
        if self.deferred:
            self.resolution.settle(self)
        return self._report

    def check_report(self, values: Sequence[int]) -> list[list[int]]:
        """Raise the first error flag set in ``values`` (from :meth:`report`); return per request
        ``[direct, hot, host, staged]``."""
        batch = len(self.requests)
        for flag, is_set in enumerate(values[4 * batch:]):
            if is_set:
                raise FLAG_ERRORS[flag](FLAG_MESSAGES[flag])
        return [[*values[3 * b: 3 * b + 3], values[3 * batch + b]] for b in range(batch)]

    def reset_checks(self) -> None:
        """Clear the step's device-side flags and counts (``abort_step``: nothing of a rolled-back step is
        reported); what the resolution deferred is dropped."""
        self.deferred = []
        self._report.zero_()

    def finish(self, report: Sequence[int] | None) -> list[list[int]]:
        """The step's work is over (``end_step``): complete its fetches, read its report unless the caller did (one
        counted host read), raise the first failed check; returns per request ``[direct, hot, host, staged]``."""
        self.wait_fetches()  # prefetches of layers the model skipped must not outlive the step
        if report is None:
            report = self.parts.sync.read(self.report())[0]
        return self.check_report(report)

    def wait_fetches(self) -> None:
        """Complete every host→device copy this step issued (called by ``end_step``)."""
        for ticket in self.tickets:
            self.parts.copies.wait(ticket)

    def _closed(self) -> None:
        raise RuntimeError("this StepKV was ended; call begin_step for the next step")
