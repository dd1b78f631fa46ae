"""Per-request KV state: page table, host pages, tail ring, hot caches, optional pages, indexer-key pages.

Positions of a request are split into pages of ``page_rows``. For every source ``s`` and page ``i``:

- ``page_table[s, i]`` (device, int64) is the arena page the resolver may read directly, or ``-1``. It is
  set for tail pages and for *ready* optional pages only.
- ``host_pages[s, i]`` / ``host_state[s, i]`` (CPU) locate the page in the host store and say whether the
  host copy is empty, pending or valid.
- The **tail** is a ring of ``tail_pages`` arena pages per source: page ``i`` uses ring slot
  ``i % tail_pages``. Pages ``tail_first .. (length-1) // page_rows`` are in the tail (mapped). A complete
  tail page is backed up to host; once its backup is done it leaves the tail (unmapped) and its ring slot
  may be reused once the readers issued before that point have finished (``ring_free_epoch``).
- **Verification staging** (host-backed policies with a drafter and ``B < max_query_len * index_topk``):
  ``staging_loc[j]`` are the arena rows of staging slot ``j``; a verification step copies the rows of its
  union of selections that the hot cache cannot take into the slot of their source's position in its index
  group. They are valid for that step only (never looked up again) and are reused by the next group.
- **Indexer keys** live in arena pages the request holds from admission to release (``key_page_ids``), one run of
  ``key_blocks`` pages per indexer layer (``key_pages[i, j]``, a view of the batch state; ``kv/index_keys.py``).
- **Optional pages** (adaptive only) are complete pages of the imported prompt, ``i < prompt_pages``,
  with the state machine ``OPT_*`` below (``opt_state[s, i]``, ``opt_page[s, i]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dhisparse.kv.copies import CopyTicket
from dhisparse.kv.footprint import Footprint

OPT_ABSENT = 0  # not on device (rows come from the hot cache or host)
OPT_REFILLING = 1  # host→device copy issued, not visible to the resolver yet
OPT_READY = 2  # mapped in page_table, readable directly
OPT_BACKING_UP = 3  # reclaim decided; still mapped and readable; device→host backup in flight
OPT_RETIRED = 4  # unmapped; freed once the readers issued before the decision finish (retire_epoch)
OPT_REFILL_CANCELLED = 5  # reclaim decided while refilling: retired as soon as the refill copy is done
OPT_ON_DEVICE = (OPT_REFILLING, OPT_READY, OPT_BACKING_UP, OPT_RETIRED, OPT_REFILL_CANCELLED)


@dataclass
class RequestKV:
    """Everything the manager keeps for one admitted request (see the module docstring)."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    footprint: Footprint
    admit_order: int
    page_table: torch.Tensor  # [S, num_pages] int64, device (a view of the batch state's slot)
    tail_ring: torch.Tensor  # [S, tail_pages] int64 arena pages, CPU
    hot_pages: torch.Tensor  # [S, hot_pages] int64 arena pages backing the hot cache, CPU
    hot_pos: torch.Tensor  # [S, B] int64, device
    hot_stamp: torch.Tensor  # [S, B] int64, device
    hot_loc: torch.Tensor  # [S, B] int64, device
    host_pages: torch.Tensor | None  # [S, num_pages] int64 host page ids, CPU (None for resident)
    host_state: torch.Tensor  # [S, num_pages] int8, CPU
    opt_state: torch.Tensor  # [S, prompt_pages] int8, CPU
    opt_page: torch.Tensor  # [S, prompt_pages] int64 arena page or -1, CPU
    opt_retire_epoch: torch.Tensor  # [S, prompt_pages] int64, CPU
    key_pages: torch.Tensor  # [indexer layers, key_blocks] int64 arena pages of the keys, device (slot view)
    key_page_ids: torch.Tensor  # the same pages, CPU (owned, freed at release)
    length: int = 0  # accepted rows (prompt + kept decode rows)
    imported: bool = False
    tail_first: int = 0  # first page index still in the tail
    ring_free_epoch: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    staging_pages: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # CPU
    staging_loc: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.int64))  # [G, T]
    tickets: list[CopyTicket] = field(default_factory=list)  # copies touching this request's memory
    backup_tickets: dict[int, CopyTicket] = field(default_factory=dict)  # tail page -> backup in flight
    import_ticket: CopyTicket | None = None  # prompt pages → host, until done
    stats: dict[str, float] = field(default_factory=dict)
    retired_pending: bool = False  # some optional page is RETIRED (waiting for its readers)
    may_refill: bool = False  # some optional page may be ABSENT with a valid host copy
    slot: int = -1  # slot in the persistent batch state (kv/batch_state.py); -1 once released
    # Fixed at admission (plain attributes: a step reads them without a call).
    num_sources: int = field(init=False)
    prompt_pages: int = field(init=False)  # complete pages of the imported prompt: the only pages that may be optional
    tail_pages: int = field(init=False)  # pages per source of the tail ring

    def __post_init__(self) -> None:
        self.num_sources = self.page_table.shape[0]
        self.prompt_pages = self.opt_state.shape[1]
        self.tail_pages = self.tail_ring.shape[1]

    def live_tickets(self) -> list[CopyTicket]:
        self.tickets = [t for t in self.tickets if not t.done and t.error is None]
        return self.tickets

    def add_stat(self, name: str, value: float) -> None:
        self.stats[name] = self.stats.get(name, 0.0) + value

    def optional_pages_on_device(self) -> int:
        on = torch.zeros_like(self.opt_state, dtype=torch.bool)
        for state in OPT_ON_DEVICE:
            on |= self.opt_state == state
        return int(on.sum())
