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

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from dhisparse.host_values import to_device
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

    # The state tensors (made by ``_allocate`` from one description, ``_shapes``).
    page_table: torch.Tensor
    hot_pos: torch.Tensor
    hot_stamp: torch.Tensor
    hot_loc: torch.Tensor
    host_pages: torch.Tensor
    staging_loc: torch.Tensor
    key_pages: torch.Tensor

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

    def pages_for(self, max_model_len: int) -> int:
        """Pages per slot for requests of up to ``max_model_len`` tokens (plus a verification block)."""
        return -(-(max_model_len + self.config.max_query_len - 1) // self.config.page_rows)

    def key_blocks_for(self, pages: int) -> int:
        """Key pages per indexer layer covering ``pages`` pages of positions."""
        return -(-pages * self.config.page_rows // self.keys_per_page) if self.keys_per_page else 0

    def _shapes(self, slots: int, pages: int) -> dict[str, tuple[int, int, int]]:
        """Shape of each state tensor (every one int64 ``[slots, ...]``) for ``pages`` pages per slot."""
        s, hot = self.layout.num_sources, self.hot_rows
        return {"page_table": (slots, s, pages), "host_pages": (slots, s, pages), "hot_pos": (slots, s, hot),
                "hot_stamp": (slots, s, hot), "hot_loc": (slots, s, hot),
                "staging_loc": (slots, self.staging_slots, self.staging_rows),
                "key_pages": (slots, len(self.layout.indexer_layers), self.key_blocks_for(pages))}

    def _empty(self) -> dict[str, int]:
        """What a free slot holds in each state tensor."""
        return {"page_table": -1, "host_pages": -1, "hot_pos": -1, "hot_stamp": 0, "hot_loc": -1, "staging_loc": 0,
                "key_pages": self.zero_page}

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor (leading slot dimension)."""
        return [getattr(self, name) for name in self._empty()]

    @classmethod
    def size_bytes(cls, layout: KVLayout, config: KVConfig) -> int:
        """Device bytes of the state a fixed-size configuration allocates (``max_batch_size``/``max_model_len``)."""
        probe = cls(layout, dataclasses.replace(config, max_batch_size=0, max_model_len=0), torch.device("meta"))
        shapes = probe._shapes(config.max_batch_size, probe.pages_for(config.max_model_len))
        return sum(math.prod(shape) * 8 for shape in shapes.values())

    def _allocate(self, slots: int, pages: int) -> None:
        empty = self._empty()
        for name, shape in self._shapes(slots, pages).items():
            setattr(self, name, torch.full(shape, empty[name], dtype=torch.int64, device=self.device))

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def pages_per_slot(self) -> int:
        return self.page_table.shape[2]

    @property
    def nbytes(self) -> int:
        """Device bytes of the whole batch state."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

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
        for name, value in self._empty().items():
            getattr(self, name)[slot] = value

    def _grow(self, slots: int, pages: int, live: list[RequestKV]) -> None:
        old, n = self.tensors, self.num_slots
        self._allocate(slots, pages)
        for new, before in zip(self.tensors, old, strict=True):  # every tensor is [slots, *, width]
            new[:n, :, : before.shape[2]] = before
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
        src = to_device(old_slots, torch.int64, self.device)
        dst = to_device(new_slots, torch.int64, self.device)
        for t in self.tensors:
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
