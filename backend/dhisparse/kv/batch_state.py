"""Persistent batch state: page tables, hot caches, host page ids, staging rows and indexer-key page tables of every
admitted request in batched device tensors that requests occupy by *slot* (in the style of vLLM's persistent batch).

Each tensor has a leading slot dimension. A request gets the lowest free slot at admission and keeps it until
``release``; its :class:`~dhisparse.kv.request_state.RequestKV` holds *views* of its slot (``page_table``,
``hot_pos``, ``hot_stamp``, ``hot_loc``, ``key_pages``), so every in-place update of the request's state (tail
mapping, reclaim, refill, the resolver's hot-cache update) is an update of the batched tensor. A step
(:class:`~dhisparse.kv.step.StepKV`) reads the rows of its requests' slots — a slice view when the slots are
consecutive in step order, one gather otherwise — and writes hot-cache changes back into the slots at once; it
never stacks per-request tensors nor copies hot state back at ``end_step``.

The indexer keys themselves live in arena pages (``kv/index_keys.py``): ``key_pages[slot, i, j]`` is the arena page
holding positions ``j * keys_per_page ...`` of the request's ``i``-th indexer layer, or the pool's always-zero page
where the request owns none. So the keys cost what the requests hold, inside ``pool_bytes``, not
``max_batch_size * max_model_len``.

Between steps a free slot is empty: page table and hot positions ``-1``, stamps ``0``, key pages the zero page; an
admitted request's keys are zero past its length (``index_keys`` of a step reads them without masking).

Size: ``KVConfig.max_batch_size`` slots of ``KVConfig.max_model_len`` positions (the engine sets both, so the
state is allocated once at start; :attr:`nbytes`, :meth:`size_bytes`, is part of the workspace bound printed at
start, ``engine/workspace.py``). Without them (direct
users of ``KVManager``) the state starts small and grows by doubling when an admission needs more slots or
positions; the requests' views are re-pointed then (between steps only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.device_pool import keys_per_page

if TYPE_CHECKING:
    from dhisparse.kv.request_state import RequestKV

_GROW_SLOTS, _GROW_PAGES = 4, 8  # initial size when the config does not fix it


class BatchState:
    """Batched per-request state (see the module docstring).

    Attributes (``N`` slots, ``S`` sources, ``M`` pages per slot, ``H`` hot rows, ``G``/``T`` staging):
        page_table: ``[N, S, M]`` int64 arena page or ``-1``.
        hot_pos / hot_stamp / hot_loc: ``[N, S, H]`` int64.
        host_pages: ``[N, S, M]`` int64 host page ids (``-1`` where none), on the device for the fetch list.
        staging_loc: ``[N, G, T]`` int64 arena rows of verification staging.
        key_pages: ``[N, L, KB]`` int64 arena page of each key block of each of the ``L`` indexer layers (the
            zero page where none); ``KB = ceil(M * page_rows / keys_per_page)``.
    """

    def __init__(self, layout: KVLayout, config: KVConfig, device: torch.device, zero_page: int = -1) -> None:
        self.layout, self.config, self.device = layout, config, device
        self.zero_page = zero_page
        self.keys_per_page = keys_per_page(layout, config.page_rows)
        self.layer_index = {layer: i for i, layer in enumerate(layout.indexer_layers)}
        self.hot_rows = config.hot_rows_for(layout)
        self.staging_slots = max(1, layout.staging_slots)
        self.staging_rows = config.staging_rows(layout)
        self.fixed = config.max_batch_size > 0 and config.max_model_len > 0
        slots = config.max_batch_size or _GROW_SLOTS
        pages = self.pages_for(config.max_model_len) if config.max_model_len else _GROW_PAGES
        self._allocate(slots, pages)
        self.free_slots = list(range(slots))
        self.owner: list[object | None] = [None] * slots  # the RequestKV of each slot (identity checks)
        self._reports: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # see report_buffer

    def pages_for(self, max_model_len: int) -> int:
        """Pages per slot for requests of up to ``max_model_len`` tokens (plus a verification block)."""
        return -(-(max_model_len + self.config.max_query_len - 1) // self.config.page_rows)

    def key_blocks_for(self, pages: int) -> int:
        """Key pages per indexer layer covering ``pages`` pages of positions."""
        return -(-pages * self.config.page_rows // self.keys_per_page) if self.keys_per_page else 0

    @classmethod
    def size_bytes(cls, layout: KVLayout, config: KVConfig) -> int:
        """Device bytes of the state a fixed-size configuration allocates (``max_batch_size``/``max_model_len``)."""
        probe = cls.__new__(cls)
        probe.layout, probe.config = layout, config
        probe.keys_per_page = keys_per_page(layout, config.page_rows)
        slots, pages = config.max_batch_size, probe.pages_for(config.max_model_len)
        sources, hot, i64 = layout.num_sources, config.hot_rows_for(layout), 8
        staging = max(1, layout.staging_slots) * config.staging_rows(layout)
        return i64 * slots * (2 * sources * pages + 3 * sources * hot + staging
                              + len(layout.indexer_layers) * probe.key_blocks_for(pages))

    def _allocate(self, slots: int, pages: int) -> None:
        s, dev, lay = self.layout.num_sources, self.device, self.layout
        i64 = dict(dtype=torch.int64, device=dev)
        self.page_table = torch.full((slots, s, pages), -1, **i64)
        self.host_pages = torch.full((slots, s, pages), -1, **i64)
        self.hot_pos = torch.full((slots, s, self.hot_rows), -1, **i64)
        self.hot_stamp = torch.zeros((slots, s, self.hot_rows), **i64)
        self.hot_loc = torch.full((slots, s, self.hot_rows), -1, **i64)
        self.staging_loc = torch.zeros((slots, self.staging_slots, self.staging_rows), **i64)
        self.key_pages = torch.full((slots, len(lay.indexer_layers), self.key_blocks_for(pages)), self.zero_page,
                                    **i64)

    def report_buffer(self, requests: int, flags: int) -> tuple[torch.Tensor, ...]:
        """A step's report buffer for ``requests`` requests, zeroed: ``(buffer, counts [B, 3], staged [B], flags)``,
        the last three views of the first (one allocation per batch size, reused by later steps)."""
        cached = self._reports.get((requests, flags))
        if cached is None:
            buffer = torch.zeros(4 * requests + flags, dtype=torch.int64, device=self.device)
            cached = self._reports[(requests, flags)] = (
                buffer, buffer[: 3 * requests].view(requests, 3), buffer[3 * requests: 4 * requests],
                buffer[4 * requests:])
        else:
            cached[0].zero_()
        return cached

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def pages_per_slot(self) -> int:
        return self.page_table.shape[2]

    @property
    def nbytes(self) -> int:
        """Device bytes of the whole batch state."""
        tensors = [self.page_table, self.host_pages, self.hot_pos, self.hot_stamp, self.hot_loc, self.staging_loc,
                   self.key_pages]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------------------------------ slots
    def acquire(self, owner: object, num_pages: int, live: list[RequestKV]) -> int:
        """A free slot for a request of ``num_pages`` pages per source. Grows the state (re-pointing the views of
        the ``live`` requests) when the config does not fix its size; with a fixed size a request beyond it is a
        caller error (the engine refuses such requests and never admits more than ``max_batch_size``)."""
        if num_pages > self.pages_per_slot or not self.free_slots:
            if self.fixed:
                what = ("max_model_len" if num_pages > self.pages_per_slot else "max_batch_size")
                raise ValueError(f"the KV batch state is full: raise {what} (slots {self.num_slots}, "
                                 f"pages per slot {self.pages_per_slot}, request needs {num_pages})")
            self._grow(max(self.num_slots * (2 if not self.free_slots else 1), 1),
                       max(self.pages_per_slot, 1 << (num_pages - 1).bit_length()), live)
        slot = min(self.free_slots)
        self.free_slots.remove(slot)
        self.owner[slot] = owner
        return slot

    def release(self, slot: int) -> None:
        """Empty ``slot`` and return it to the free list (the owner must have detached its views)."""
        self.clear(slot)
        self.owner[slot] = None
        self.free_slots.append(slot)

    def clear(self, slot: int) -> None:
        self.page_table[slot] = -1
        self.host_pages[slot] = -1
        self.hot_pos[slot] = -1
        self.hot_stamp[slot] = 0
        self.hot_loc[slot] = -1
        self.staging_loc[slot] = 0
        self.key_pages[slot] = self.zero_page

    def _grow(self, slots: int, pages: int, live: list[RequestKV]) -> None:
        old = (self.page_table, self.host_pages, self.hot_pos, self.hot_stamp, self.hot_loc, self.staging_loc,
               self.key_pages)
        n, m = self.num_slots, self.pages_per_slot
        self._allocate(slots, pages)
        self.page_table[:n, :, :m] = old[0]
        self.host_pages[:n, :, :m] = old[1]
        self.hot_pos[:n], self.hot_stamp[:n], self.hot_loc[:n], self.staging_loc[:n] = old[2:6]
        self.key_pages[:n, :, : old[6].shape[2]] = old[6]
        self.free_slots += list(range(n, slots))
        self.owner += [None] * (slots - n)
        for req in live:
            self.bind(req)

    def compact(self, order: list[RequestKV], live: list[RequestKV]) -> int:
        """Give the requests of ``order`` (a step's requests, in step order) the slots ``0 .. len(order)-1`` and the
        other ``live`` requests the next ones (in their current order), so the step reads its slots as one view
        instead of a gather (slots scatter as requests come and go). Only the moved slots' rows are copied; every live
        request's views are re-pointed. Between steps only. Returns the number of requests moved."""
        others = sorted((r for r in live if all(r is not o for o in order)), key=lambda r: r.slot)
        moves = [(req, new) for new, req in enumerate([*order, *others]) if req.slot != new]
        if not moves:
            return 0
        old_slots = [req.slot for req, _ in moves]
        new_slots = [new for _, new in moves]
        src = torch.tensor(old_slots, dtype=torch.int64, device=self.device)
        dst = torch.tensor(new_slots, dtype=torch.int64, device=self.device)
        for t in (self.page_table, self.host_pages, self.hot_pos, self.hot_stamp, self.hot_loc, self.staging_loc,
                  self.key_pages):
            t[dst] = t[src]  # the right side is gathered first: overlapping moves are safe
        vacated = sorted(set(old_slots) - set(new_slots))
        for slot in vacated:
            self.clear(slot)
        owner = {slot: self.owner[slot] for slot in old_slots}
        for slot in vacated:
            self.owner[slot] = None
        for (req, new), old in zip(moves, old_slots, strict=True):
            self.owner[new] = owner[old]
            req.slot = new
        used = {r.slot for r in live}
        self.free_slots = [slot for slot in range(self.num_slots) if slot not in used]
        for req in live:
            self.bind(req)
        return len(moves)

    def bind(self, req: RequestKV) -> None:
        """Point the request's state tensors at views of its slot."""
        slot, pages = req.slot, req.footprint.num_pages
        req.page_table = self.page_table[slot, :, :pages]
        req.hot_pos = self.hot_pos[slot]
        req.hot_stamp = self.hot_stamp[slot]
        req.hot_loc = self.hot_loc[slot]
        req.staging_loc = self.staging_loc[slot]
        req.key_pages = self.key_pages[slot, :, : req.footprint.key_blocks]

    @staticmethod
    def detach(req: RequestKV) -> None:
        """Give a released request private copies of its state (its slot is reused at once)."""
        req.page_table = req.page_table.clone()
        req.hot_pos, req.hot_stamp, req.hot_loc = req.hot_pos.clone(), req.hot_stamp.clone(), req.hot_loc.clone()
        req.staging_loc = req.staging_loc.clone()
        req.key_pages = req.key_pages.clone()
        req.slot = -1
