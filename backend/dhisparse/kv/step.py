"""StepKV: the KV view of one batched forward (``B`` requests, ``Q`` new tokens each).

Built by :meth:`KVManager.begin_step`, which has already mapped the tail pages for the new rows, so the
state snapshot taken here (page tables, hot caches) stays valid for the whole step. Per layer the model
calls :meth:`write` first, then :meth:`index_keys` / :meth:`gather`. Resolution happens in :meth:`gather`,
once per source and positions tensor; when the layer leads a GLM-style index group the other sources
of the group are resolved at the same time and their host copies issued ahead (prefetch), and a source
shared by several layers reuses the first layer's location vector.

Verification staging: rows of a step's union of selections that the hot cache cannot take are copied from
host straight into the request's staging slot of the source's position in its index group (one slot per
group position, :attr:`KVLayout.staging_slots`); the location vector points there, so attention reads every
row through one vector from the arena, a hot slot or staging. The next group's resolution reuses the slots;
copies are issued after the work already queued (on CUDA the copy stream waits for the current stream, i.e.
for the previous group's attention), and a resolved entry whose staged rows were overwritten is dropped, so a
later layer sharing that source resolves again instead of reading another source's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dhisparse.kv import kernel_step
from dhisparse.kv.copies import CopyTicket
from dhisparse.kv.request_state import RequestKV
from dhisparse.kv.resolver import Resolution, resolve

if TYPE_CHECKING:
    from dhisparse.kv.manager import KVManager


@dataclass
class _Resolved:
    positions: torch.Tensor  # [B, X, K] as passed by the model
    resolution: Resolution
    ticket: CopyTicket | None  # host→device copies of the misses (None if nothing missed)
    staging_slot: int
    staged: bool  # rows may live in the staging slot


class StepKV:
    """KV access for one step. Attributes:

    lengths: ``[B]`` int64 (device) history length of each request including the ``Q`` new tokens.
    starts: ``[B]`` int64 (device) position of each request's first new token.
    query_len: ``Q``.
    """

    def __init__(self, manager: KVManager, requests: list[RequestKV], query_len: int, stamp: int) -> None:
        self._m = manager
        self.requests = requests
        self.query_len = query_len
        self.stamp = stamp
        device = manager.device
        pool = manager.pool
        self.starts = torch.tensor([r.length for r in requests], dtype=torch.int64, device=device)
        self.lengths = self.starts + query_len
        max_pages = max(r.page_table.shape[1] for r in requests)
        sources = manager.layout.num_sources
        table = torch.full((len(requests), sources, max_pages), -1, dtype=torch.int64, device=device)
        for b, r in enumerate(requests):
            table[b, :, : r.page_table.shape[1]] = r.page_table
        self.page_table = table
        self.hot_pos = torch.stack([r.hot_pos for r in requests])  # [B, S, hot_rows]
        self.hot_stamp = torch.stack([r.hot_stamp for r in requests])
        self.hot_loc = torch.stack([r.hot_loc for r in requests])
        if requests[0].host_pages is not None:
            host = torch.full((len(requests), sources, max_pages), -1, dtype=torch.int64)
            for b, r in enumerate(requests):
                assert r.host_pages is not None
                host[b, :, : r.host_pages.shape[1]] = r.host_pages
            self.host_pages: torch.Tensor | None = host
        else:
            self.host_pages = None
        # Arena rows of the new tokens: [B, S, Q].
        new_pos = self.starts.unsqueeze(1) + torch.arange(query_len, device=device)  # [B, Q]
        page = table.gather(2, (new_pos // pool.page_rows).unsqueeze(1).expand(-1, sources, -1))
        self.new_rows = page * pool.page_rows + (new_pos % pool.page_rows).unsqueeze(1)
        self.counts = torch.zeros(len(requests), 3, dtype=torch.int64, device=device)
        self.staged = torch.zeros(len(requests), dtype=torch.int64, device=device)  # rows copied into staging
        self.staging_loc = torch.stack([r.staging_loc for r in requests]).to(device)  # [B, G, T]
        self._resolved: dict[int, _Resolved] = {}
        self._tickets: list[CopyTicket] = []
        self.resolver_calls = 0  # resolve() calls (one per source and positions tensor)
        self.closed = False

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
        dst = self.new_rows[:, source, :].reshape(-1)
        if bool((dst < 0).any()):
            raise RuntimeError("tail page of a new row is not mapped (begin_step broke its contract)")
        m.pool.arena.index_copy_(0, dst, rows.reshape(-1, rows.shape[-1]).to(m.pool.arena.dtype))
        if layer in m.indexer_layers:
            if index_keys is None or tuple(index_keys.shape) != (batch, q, m.layout.index_key_dim):
                raise ValueError(f"write(layer {layer}): index_keys [{batch}, {q}, {m.layout.index_key_dim}] "
                                 "are required for a layer with an indexer")
            for b, r in enumerate(self.requests):
                r.index_keys[layer][r.length : r.length + q] = index_keys[b].to(m.layout.dtype)
        elif index_keys is not None:
            raise ValueError(f"layer {layer} has no indexer; pass index_keys=None")

    def index_keys(self, layer: int) -> torch.Tensor:
        """``[B, Tmax, index_key_dim]`` keys of all positions incl. the new ones; zero past ``lengths[b]``."""
        self._check_open()
        m = self._m
        if layer not in m.indexer_layers:
            raise ValueError(f"layer {layer} has no indexer")
        t_max = int(self.lengths.max())
        out = torch.zeros(len(self.requests), t_max, m.layout.index_key_dim, dtype=m.layout.dtype,
                          device=m.device)
        for b, r in enumerate(self.requests):
            n = r.length + self.query_len
            out[b, :n] = r.index_keys[layer][:n]
        return out

    # ------------------------------------------------------------------------------------------ gather
    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows ``[B, X, K, row_dim]`` of the selected ``positions`` ``[B, X, K]`` int64 (``-1`` = unused
        slot, zeros returned there). Every selected position must be below ``lengths[b]``."""
        loc = self.locations(layer, positions)
        rows = self._m.pool.arena[loc.clamp(min=0)]
        return rows.masked_fill((loc < 0).unsqueeze(-1), 0)

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
        self._check_open()
        m = self._m
        if positions.dim() != 3 or positions.shape[0] != len(self.requests):
            raise ValueError(f"gather(layer {layer}): positions must be [{len(self.requests)}, X, K]")
        positions = positions.to(m.device, torch.int64)
        bad = positions >= self.lengths.view(-1, 1, 1)
        if bool(bad.any()):
            raise ValueError(f"gather(layer {layer}): a selected position is at or past the request's length")
        source = m.layout.source_of_layer[layer]
        entry = self._lookup(source, positions)
        if entry is None:
            # Resolve this source and (for a group leader) the group's other sources, prefetching theirs.
            for other in m.layout.group_of_layer(layer):
                other_source = m.layout.source_of_layer[other]
                if self._lookup(other_source, positions) is None:
                    self._resolve(other_source, positions, m.layout.staging_slot_of_layer(other))
            entry = self._lookup(source, positions)
            assert entry is not None
        m.copies.wait_for_read(entry.ticket)
        return entry.resolution.locations.view_as(positions)

    def _lookup(self, source: int, positions: torch.Tensor) -> _Resolved | None:
        entry = self._resolved.get(source)
        if entry is None:
            return None
        same = entry.positions is positions or (
            entry.positions.shape == positions.shape and torch.equal(entry.positions, positions)
        )
        return entry if same else None

    def _resolve(self, source: int, positions: torch.Tensor, slot: int) -> None:
        m = self._m
        staging = self.staging_loc[:, slot] if self.staging_loc.shape[2] else None
        # CUDA kernels: resolve and fetch without a host round trip. The resolver kernel has no staging step yet,
        # so a step with verification staging resolves with the torch resolver.
        if m.kernels.on_device and staging is None:
            res, ticket = kernel_step.resolve_on_device(self, m, source, positions)
            self.resolver_calls += 1
            if ticket is not None:
                self._tickets.append(ticket)
            self._resolved[source] = _Resolved(positions, res, ticket, slot, False)
            return
        flat = positions.reshape(len(self.requests), -1)
        res = resolve(flat, self.page_table[:, source], self.hot_pos[:, source], self.hot_stamp[:, source],
                      self.hot_loc[:, source], self.stamp, m.pool.page_rows, staging)
        self.resolver_calls += 1
        self.hot_pos[:, source] = res.hot_pos
        self.hot_stamp[:, source] = res.hot_stamp
        self.counts += res.counts
        self.staged += res.staged
        # With staging, the slot's previous rows may be overwritten: their entry must not be reused (decided from
        # the configuration, not from this resolution's counts, so that it costs no host sync).
        staged = staging is not None
        if staged:
            stale = [s for s, e in self._resolved.items() if e.staged and e.staging_slot == slot and s != source]
            for s in stale:
                del self._resolved[s]
        ticket = None
        if res.copy_request.numel() > 0:
            if self.host_pages is None:
                raise RuntimeError("resolver asked for host rows under the resident policy")
            req_idx, pos = res.copy_request.cpu(), res.copy_position.cpu()
            host_rows = m.host.rows_of(self.host_pages[req_idx, source, pos // m.pool.page_rows], pos)
            ticket = m.copies.issue("fetch", m.pool.arena, res.copy_location, m.host.rows, host_rows)
            self._tickets.append(ticket)
        self._resolved[source] = _Resolved(positions, res, ticket, slot, staged)

    def wait_fetches(self) -> None:
        """Complete every host→device copy this step issued (called by ``end_step``)."""
        for ticket in self._tickets:
            self._m.copies.wait(ticket)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this StepKV was ended; call begin_step for the next step")
