"""The mutable tail: a ring of arena pages per request and source for the rows generated while decoding.

Named operations (all per request, for every source at once):

- :func:`map_tail_pages` — before a step, map the pages that will hold its new rows; a ring slot is reused
  only after its previous page has *left the tail* (backup done) and the readers issued before that have
  finished (forcing both if needed, which happens only when a step adds more than a page of rows).
- :func:`back_up_complete_pages` — after a step, issue the host backup of every tail page that the step
  completed (``tail backup``: device→host). When the copy is done the page *leaves the tail*: it is
  unmapped, so from then on its rows follow hot-cache rules (resolver steps 2 and 3).
- :func:`unmap_rejected` — after a verification step, drop the mapping of pages that only held rejected
  rows, so that rejected rows leave no trace.

For ``resident`` the ring covers every page of the request and nothing is ever backed up.
"""

from __future__ import annotations

import torch

from dhisparse.host_values import to_device
from dhisparse.kv.copies import CopyEngine, ReaderFence
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.host_store import HOST_PENDING, HOST_VALID, HostStore
from dhisparse.kv.request_state import RequestKV


def leave_tail(req: RequestKV, fence: ReaderFence, page_rows: int) -> None:
    """Pages ``tail_first ..`` that are complete and backed up leave the tail, in order."""
    assert req.host_pages is not None
    while req.tail_first < req.length // page_rows and bool(
        (req.host_state[:, req.tail_first] == HOST_VALID).all()
    ):
        i = req.tail_first
        req.page_table[:, i] = -1
        req.ring_free_epoch[i % req.tail_pages] = fence.issued
        req.backup_tickets.pop(i, None)
        req.tail_first += 1


def map_tail_pages(req: RequestKV, last_position: int, page_rows: int, copies: CopyEngine,
                   fence: ReaderFence) -> None:
    """Map the tail pages covering positions ``req.length .. last_position`` (inclusive)."""
    ring = req.tail_pages
    first_page = req.length // page_rows
    for i in range(first_page, last_position // page_rows + 1):
        if i * page_rows < req.length:  # holds accepted rows: already mapped as a tail page (no device read)
            continue
        while req.tail_first <= i - ring:  # the slot's previous page has not left the tail yet
            before = req.tail_first
            copies.wait(req.backup_tickets.get(before))
            leave_tail(req, fence, page_rows)
            if req.tail_first == before:
                raise RuntimeError(f"tail page {before} of {req.request_id} has no backup to wait for")
        slot = i % ring
        fence.wait(int(req.ring_free_epoch[slot]))
        req.page_table[:, i] = to_device(req.tail_ring[:, slot], None, req.page_table.device)


def back_up_complete_pages(req: RequestKV, pool: DevicePool, host: HostStore, copies: CopyEngine,
                           fence: ReaderFence, page_rows: int) -> int:
    """Issue the host backup of the complete tail pages not yet backed up. Returns pages issued."""
    assert req.host_pages is not None
    issued = 0
    for i in range(req.tail_first, req.length // page_rows):
        if i in req.backup_tickets or bool((req.host_state[:, i] == HOST_VALID).all()):
            continue
        ring_pages = req.tail_ring[:, i % req.tail_pages]
        src_rows = pool.page_rows_of(ring_pages)
        dst_rows = pool.page_rows_of(req.host_pages[:, i], torch.device("cpu"))
        req.host_state[:, i] = HOST_PENDING

        def done(req: RequestKV = req, i: int = i) -> None:
            req.host_state[:, i] = HOST_VALID
            leave_tail(req, fence, page_rows)

        ticket = copies.issue("tail_backup", host.rows, dst_rows, pool.arena, src_rows, done)
        req.backup_tickets[i] = ticket
        req.tickets.append(ticket)
        issued += ring_pages.numel()
    return issued


def unmap_rejected(req: RequestKV, step_end: int, page_rows: int) -> None:
    """Unmap tail pages that hold no accepted row (positions ``>= req.length``) up to ``step_end``."""
    first_empty = -(-req.length // page_rows)
    last = (step_end - 1) // page_rows
    if last >= first_empty:
        req.page_table[:, max(first_empty, req.tail_first): last + 1] = -1
