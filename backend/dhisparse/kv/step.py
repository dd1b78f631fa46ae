"""StepKV: the KV view of one batched forward (``B`` requests, ``Q`` new tokens each).

Built by :meth:`KVManager.begin_step`, which has already mapped the tail pages for the new rows, so the
state snapshot taken here (page tables, hot caches) stays valid for the whole step. Per layer the model
calls :meth:`write` first, then :meth:`index_keys` / :meth:`gather`. Resolution happens in :meth:`gather`,
once per source and positions tensor; when the layer leads a GLM-style index group the other sources
of the group are resolved at the same time and their host copies issued ahead (prefetch), and a source
shared by several layers reuses the first layer's location vector.

Host reads: no per-layer call reads a device value on the host. Checks (a selected position past the length, a
hot-cache overflow, an unmapped tail row) and the resolver's statistics accumulate on the device and are read
once per step (:meth:`report`, read by ``end_step`` or fused into the engine's own read); with
``KVManager(debug_checks=True)`` the checks are read and raised at once instead. Host copies of missing rows
use the resolver's fixed-shape copy list (``fetch_*``): rows that are not misses are copied into the arena's
scratch row, so the list's length is never needed on the host.

Verification staging: rows of a step's union of selections that the hot cache cannot take are copied from
host straight into the request's staging slot of the source's position in its index group (one slot per
group position, :attr:`KVLayout.staging_slots`); the location vector points there, so attention reads every
row through one vector from the arena, a hot slot or staging. Staged rows are entries of the same fixed-shape
copy list (no extra host read). The next group's resolution reuses the slots;
copies are issued after the work already queued (on CUDA the copy stream waits for the current stream, i.e.
for the previous group's attention), and a resolved entry whose staged rows were overwritten is dropped, so a
later layer sharing that source resolves again instead of reading another source's rows.

CUDA kernels (``dhisparse.kv.kernel_step``): a step without verification staging whose history is not all
direct resolves and fetches with the resolver and row-copy kernels; :meth:`attend` runs sparse MLA on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dhisparse.host_values import to_device
from dhisparse.kernels import native
from dhisparse.kernels.resolver import HotCacheOverflowError
from dhisparse.kv import kernel_step
from dhisparse.kv.index_keys import gather_keys
from dhisparse.kv.request_state import OPT_BACKING_UP, OPT_ON_DEVICE, OPT_READY, RequestKV
from dhisparse.kv.step_resolution import (
    _FLAG_MESSAGES,
    FLAG_UNMAPPED,
    StepResolution,
    _Resolved,
)

if TYPE_CHECKING:
    from dhisparse.kernels.selection import KernelSelection
    from dhisparse.kv.batch_state import BatchState
    from dhisparse.kv.config import KVLayout
    from dhisparse.kv.copies import CopyEngine, CopyTicket
    from dhisparse.kv.device_pool import DevicePool
    from dhisparse.kv.host_store import HostStore
    from dhisparse.kv.host_sync import HostSync


@dataclass(frozen=True)
class StepParts:
    """What a step works with, handed over by the manager (the step reads none of the manager's state)."""

    layout: KVLayout
    pool: DevicePool
    host: HostStore
    copies: CopyEngine
    batch: BatchState  # persistent per-slot state (kv/batch_state.py)
    sync: HostSync  # every host read of the step goes through it
    kernels: KernelSelection
    device: torch.device
    uses_host: bool  # the policy keeps history in the host store
    debug_checks: bool  # read and raise each check at once
    indexer_layers: frozenset[int]


def _history_direct(req: RequestKV) -> bool:
    """Whether every page before the tail is a mapped optional page (host-side state only)."""
    if req.tail_first == 0:
        return True
    if req.prompt_pages < req.tail_first:
        return False
    state = req.opt_state.numpy()[:, : req.tail_first]  # CPU state: numpy is cheaper than torch at this size
    return bool(_READABLE[state].all())


_READABLE = np.zeros(max(OPT_ON_DEVICE) + 1, dtype=bool)  # optional-page states a step reads directly
_READABLE[[OPT_READY, OPT_BACKING_UP]] = True


class StepKV(StepResolution):
    """KV access for one step. Attributes:

    lengths: ``[B]`` int64 (device) history length of each request including the ``Q`` new tokens.
    starts: ``[B]`` int64 (device) position of each request's first new token.
    query_len: ``Q``.
    """

    def __init__(self, parts: StepParts, requests: list[RequestKV], query_len: int, stamp: int) -> None:
        self._m = manager = parts
        self.requests = requests
        self.query_len = query_len
        self.stamp = stamp
        device = manager.device
        # The requests' rows of the persistent batch state: a view when their slots are consecutive in step order
        # (updated in place), else one gather per tensor (hot-cache changes are scattered back at each resolve).
        batch_state = manager.batch
        self._batch = batch_state
        slots = [r.slot for r in requests]
        self.slots = slots
        if slots == list(range(slots[0], slots[0] + len(slots))):
            rows: slice | torch.Tensor = slice(slots[0], slots[0] + len(slots))
            self._scatter: torch.Tensor | None = None
        else:
            rows = to_device(slots, torch.int64, device)
            self._scatter = rows
        self._rows = rows
        # Hot caches [B, S, hot_rows], host page ids [B, S, M] and staging rows [B, G, T] of the step's slots are read
        # on first use (properties below): a direct step never touches them. Only the step changes them, so a later
        # read sees what a read here would.
        self._slot_state: dict[str, torch.Tensor] = {}
        self._hot_before: tuple[torch.Tensor, torch.Tensor] | None = None  # for abort_step (first resolve)
        self._unmapped: torch.Tensor | None = None  # a new row's page not mapped (set by the set-up below)
        # Indexer keys live in arena pages (kv/index_keys.py): the step's key-page tables [B, L, KB] (a view or one
        # gather; they change only at admission and release), read by index_keys.
        key_pages = batch_state.key_pages[rows]
        self._key_blocks = key_pages.shape[2]
        self._key_pages = key_pages.unbind(1)  # per indexer layer [B, KB]
        # The page table is the one snapshot a step takes (one copy of its rows, up to the widest request): a reclaim
        # or a completed backup may unmap a page during the step while the step's readers still use it. With it:
        # starts, lengths, the arena rows the new tokens' writes go to (per source [B*Q]) and their indexer keys'
        # pages and offsets (per indexer layer [B, Q]; offsets [B, Q]).
        width = max(r.footprint.num_pages for r in requests)
        starts = [r.length for r in requests]
        self.max_length = max(starts) + query_len  # known on the host, no read
        if manager.kernels.native_resolver is not None:  # CPU device: one library call
            self._setup_native(starts, slots, width, query_len)
        else:
            self._setup_torch(starts, rows, key_pages, width, query_len)
        # The report (see report()): counts [B, 3], staged rows [B], flags, as views of one buffer.
        # (One buffer per batch size, kept by the batch state and zeroed here: the previous step's report was read.)
        self._report, self.counts, self.staged, self.flags = batch_state.report_buffer(len(requests),
                                                                                       len(_FLAG_MESSAGES))
        if self._unmapped is not None:  # begin_step maps every new row's tail page (its contract: "tail map")
            self._flag(FLAG_UNMAPPED, self._unmapped, RuntimeError)
        # Every request's whole history direct (resident; adaptive with all prompt pages on device and no page
        # that left the tail): resolution is a page-table lookup. Decided from host state, no device read.
        self.all_direct = all(_history_direct(r) for r in requests)
        self._resolved: dict[int, _Resolved] = {}
        # Direct resolutions' (positions, locations), checked and counted once per step in report().
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._tickets: list[CopyTicket] = []
        self.resolver_calls = 0  # resolve() calls (one per source and positions tensor)
        self.closed = False

    def _setup_torch(self, starts: list[int], rows: slice | torch.Tensor, key_pages: torch.Tensor, width: int,
                     query_len: int) -> None:
        """Step set-up with torch operations (any device; see ``__init__``): host-known values (starts, lengths,
        page and key-block indices of the new tokens) computed on the host and moved in one copy, the pages
        gathered from the snapshot on the device."""
        m = self._m
        pool, batch = m.pool, len(starts)
        first = np.asarray(starts, dtype=np.int64)
        positions = (first[:, None] + np.arange(query_len)).ravel()  # [B*Q], request-major
        values = to_device(torch.from_numpy(np.concatenate(
            (first, first + query_len, *np.divmod(positions, pool.page_rows),
             *np.divmod(positions, max(1, pool.keys_per_page))))), None, m.device)
        self.starts, self.lengths = values[:batch], values[batch: 2 * batch]
        page_index, within_page, key_block, within_key_page = values[2 * batch:].view(4, batch, query_len).unbind(0)
        table = self.page_table = self._batch.page_table[rows, :, :width].clone()  # [B, S, M]
        sources = table.shape[1]
        page = table.transpose(0, 1).gather(2, page_index.unsqueeze(0).expand(sources, -1, -1))  # [S, B, Q]
        new_rows = page.mul_(pool.page_rows).add_(within_page)  # negative only where a page is unmapped
        self._unmapped = (new_rows < 0).any() if m.debug_checks else None
        self._write_rows = new_rows.clamp_(min=0).view(sources, -1).unbind(0)
        write_pages = key_pages.transpose(0, 1).gather(2, key_block.unsqueeze(0).expand(key_pages.shape[1], -1, -1))
        self._key_write = (write_pages.unbind(0), within_key_page)

    def _setup_native(self, starts: list[int], slots: list[int], width: int, query_len: int) -> None:
        """The same values by one call of the native CPU library (``native.step_setup``), as views of its output;
        an unmapped new row is flagged whatever the debug mode (the flag costs no device read here)."""
        m, batch_state = self._m, self._batch
        out, flags = native.step_setup(m.kernels.native_resolver, starts, slots, batch_state.page_table,
                                       batch_state.key_pages, width, query_len, m.pool.page_rows,
                                       max(1, m.pool.keys_per_page))
        batch, sources, indexers = len(starts), batch_state.page_table.shape[1], batch_state.key_pages.shape[1]
        bq = batch * query_len
        at = 2 * batch + batch * sources * width
        self.starts, self.lengths = out[:batch], out[batch: 2 * batch]
        self.page_table = out[2 * batch: at].view(batch, sources, width)
        self._write_rows = out[at: at + sources * bq].view(sources, bq).unbind(0)
        at += sources * bq
        self._key_write = (out[at: at + indexers * bq].view(indexers, batch, query_len).unbind(0),
                           out[at + indexers * bq:].view(batch, query_len))
        self._unmapped = torch.ones((), dtype=torch.bool) if flags else None

    def _slot_rows(self, name: str) -> torch.Tensor:
        """The step's rows of one batch-state tensor: a view (consecutive slots) or a gathered copy, read once."""
        value = self._slot_state.get(name)
        if value is None:
            value = self._slot_state[name] = getattr(self._batch, name)[self._rows]
        return value

    @property
    def hot_pos(self) -> torch.Tensor:
        return self._slot_rows("hot_pos")

    @property
    def hot_stamp(self) -> torch.Tensor:
        return self._slot_rows("hot_stamp")

    @property
    def hot_loc(self) -> torch.Tensor:
        return self._slot_rows("hot_loc")

    @property
    def host_pages(self) -> torch.Tensor | None:
        return self._slot_rows("host_pages") if self._m.uses_host else None

    @property
    def staging_loc(self) -> torch.Tensor:
        return self._slot_rows("staging_loc")

    # ------------------------------------------------------------------------------------------ writes
    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Write the new tokens' rows ``[B, Q, row_dim]`` (and indexer keys ``[B, Q, index_key_dim]`` if the
        layer has an indexer) into the tail; provisional until ``end_step``."""
        self._check_open()
        m = self._m
        batch, q = len(self.requests), self.query_len
        if tuple(rows.shape) != (batch, q, m.layout.row_dim):
            raise ValueError(f"write(layer {layer}): rows must be [{batch}, {q}, {m.layout.row_dim}], "
                             f"got {list(rows.shape)}")
        source = m.layout.source_of_layer[layer]
        m.pool.arena.index_copy_(0, self._write_rows[source], m.layout.encode(rows.reshape(-1, rows.shape[-1])))
        if layer in m.indexer_layers:
            if index_keys is None or tuple(index_keys.shape) != (batch, q, m.layout.index_key_dim):
                raise ValueError(f"write(layer {layer}): index_keys [{batch}, {q}, {m.layout.index_key_dim}] "
                                 "are required for a layer with an indexer")
            # One indexed write into the requests' key pages in the arena.
            pages, within = self._key_write
            m.pool.keys.index_put_((pages[self._batch.layer_index[layer]], within), m.layout.encode_keys(index_keys))
        elif index_keys is not None:
            raise ValueError(f"layer {layer} has no indexer; pass index_keys=None")

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``[B, stop - start, index_key_dim]`` keys of positions ``start .. stop-1`` (``stop`` defaults to
        ``max_length``: every position incl. the new ones); zero past ``lengths[b]``."""
        self._check_open()
        m = self._m
        if layer not in m.indexer_layers:
            raise ValueError(f"layer {layer} has no indexer")
        stop = self.max_length if stop is None else stop
        # Keys are zero past each request's length (zero page past its blocks): one gather of the key pages covering
        # start .. stop-1, no per-request work.
        per_page = m.pool.keys_per_page
        if -(-stop // per_page) > self._key_blocks:
            raise ValueError(f"index_keys(layer {layer}): stop {stop} is past the batch state's "
                             f"{self._key_blocks * per_page} positions per slot")
        return m.layout.decode_keys(gather_keys(m.pool, self._key_pages[self._batch.layer_index[layer]], start, stop))

    # ------------------------------------------------------------------------------------------ gather
    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows ``[B, X, K, row_dim]`` of the selected ``positions`` ``[B, X, K]`` int64 (``-1`` = unused
        slot, zeros returned there). Every selected position must be below ``lengths[b]``."""
        entry = self._entry(layer, positions)
        # Unused entries (-1) read the arena's last row, the pool's zero row: one index, no mask.
        return self._m.layout.decode(self._m.pool.arena[entry.locations]).view(*positions.shape, -1)

    def attend(self, layer: int, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> torch.Tensor | None:
        """Sparse MLA ``out_lat [B, X, H, rank]`` of ``q_lat [B, X, H, rank]`` / ``q_pe [B, X, H, rope]`` over
        the rows at ``positions`` by the selected device kernel, or ``None`` (the caller computes it from
        :meth:`gather`) when the kernels are torch's (see ``dhisparse.kv.kernel_step``)."""
        if not self._m.kernels.on_device:
            return None
        return kernel_step.attend(self._m, self.locations(layer, positions), q_lat, q_pe, softmax_scale)

    def locations(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Arena rows ``[B, X, K]`` of the selected ``positions`` (``-1`` where unused), readable by work issued
        next on the current stream; resolves (and fetches) on first use per source and positions tensor."""
        return self._entry(layer, positions).locations.view_as(positions)

    def _entry(self, layer: int, positions: torch.Tensor) -> _Resolved:
        self._check_open()
        m = self._m
        known = self._resolved.get(m.layout.source_of_layer[layer])
        if known is not None and known.positions is positions:  # the same selection tensor, already checked
            m.copies.wait_for_read(known.ticket)
            return known
        if positions.dim() != 3 or positions.shape[0] != len(self.requests):
            raise ValueError(f"gather(layer {layer}): positions must be [{len(self.requests)}, X, K]")
        if positions.device != m.device or positions.dtype != torch.int64:
            positions = positions.to(m.device, torch.int64)
        source = m.layout.source_of_layer[layer]
        entry = self._lookup(source, positions)
        if entry is None:
            # Resolve this source and (for a group leader) the group's other sources, prefetching theirs.
            todo: dict[int, int] = {}  # source -> staging slot
            for other in m.layout.group_of_layer(layer):
                other_source = m.layout.source_of_layer[other]
                if other_source not in todo and self._lookup(other_source, positions) is None:
                    todo[other_source] = m.layout.staging_slot_of_layer(other)
            if len(todo) > 1 and not m.debug_checks and (self.all_direct or (
                    not self.staging_loc.shape[2] and not m.kernels.on_device)):
                self._resolve_group(list(todo.items()), positions)  # the group's sources in one resolution
            else:
                for other_source, slot in todo.items():
                    self._resolve(other_source, positions, slot)
            entry = self._lookup(source, positions)
            assert entry is not None
        m.copies.wait_for_read(entry.ticket)
        return entry

    def _lookup(self, source: int, positions: torch.Tensor) -> _Resolved | None:
        entry = self._resolved.get(source)
        if entry is None:
            return None
        same = entry.positions is positions  # the model passes the group's selection tensor itself
        if not same and entry.positions.shape == positions.shape:  # an equal copy: compare (one counted read)
            same = bool(self._m.sync.read((entry.positions != positions).any())[0][0] == 0)
        return entry if same else None

    def report(self) -> torch.Tensor:
        """What ``end_step`` reads from the device, as one int64 vector: the per-request resolution counts
        ``[B, 3]`` (flattened), the per-request staged row counts ``[B]``, then the error flags. The engine may
        read it together with its sampled tokens (one transfer) and pass the values to ``end_step(report=...)``."""
        self._settle_deferred()
        return self._report

    def check_report(self, values: list[int]) -> list[list[int]]:
        """Raise the first error flag set in ``values`` (from :meth:`report`); return per request
        ``[direct, hot, host, staged]``."""
        batch = len(self.requests)
        flags = values[4 * batch:]
        errors = (ValueError, HotCacheOverflowError, RuntimeError)
        for flag, is_set in enumerate(flags):
            if is_set:
                raise errors[flag](_FLAG_MESSAGES[flag])
        return [values[3 * b: 3 * b + 3] + [values[3 * batch + b]] for b in range(batch)]

    def reset_checks(self) -> None:
        """Clear the step's device-side flags and counts (``abort_step``: nothing of a rolled-back step is
        reported)."""
        self._deferred = []
        self._report.zero_()

    def wait_fetches(self) -> None:
        """Complete every host→device copy this step issued (called by ``end_step``)."""
        for ticket in self._tickets:
            self._m.copies.wait(ticket)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this StepKV was ended; call begin_step for the next step")
