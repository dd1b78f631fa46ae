"""Named operations that move a request's pages between tiers: the tail's mapping and backup, import, reclaim,
refill and safe free.

**The mutable tail**: a ring of arena pages per request and source for the rows generated while decoding.

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

**Optional pages** (imported history kept on device while memory is spare).

Optional-page state machine (``OPT_*`` in :mod:`request_state`, per source and complete prompt page)::

    import (memory spare) ─► READY ──reclaim, host copy valid──────────────► RETIRED ──readers done──► ABSENT
                              │  └─reclaim, backup deferred─► BACKING_UP ─copy done─┘                    │
    refill ─► REFILLING ──copy done──► READY                                                           │
                 └─reclaim─► REFILL_CANCELLED ──copy done──► RETIRED                   ◄─── refill ◄───┘

Prefix reuse adds ``OPT_SHARED`` (a held prefix page mapped to the cache's device copy, ``kv/prefix_device.py``):
``import`` or ``refill`` map it, ``reclaim`` and ``release`` unmap it (→ ``ABSENT``); the request never frees it.

Safe free: a page is given back to the pool only from ``RETIRED``, which it enters after its host copy is
valid (backup done or never needed) and after it was unmapped; it is freed once every reader issued
before it was unmapped has finished (``opt_retire_epoch <= fence.completed``). Until it is unmapped it
stays readable, so every row is ready on device or has a host copy at all times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dhisparse.host_values import to_device
from dhisparse.kv.copies import CopyEngine, ReaderFence
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.host_store import HOST_PENDING, HOST_VALID, HostStore
from dhisparse.kv.policies import KVPolicy
from dhisparse.kv.prefix_device import map_on_refill, unmap_shared
from dhisparse.kv.request_state import (
    OPT_ABSENT,
    OPT_BACKING_UP,
    OPT_READY,
    OPT_REFILL_CANCELLED,
    OPT_REFILLING,
    OPT_RETIRED,
    OPT_SHARED,
    RequestKV,
)

CPU = torch.device("cpu")


def _page_rows(pages: torch.Tensor, page_rows: int) -> torch.Tensor:
    """Row indices of whole pages, page-major: ``[len(pages) * page_rows]`` int64 on ``pages.device``."""
    return (pages.unsqueeze(1) * page_rows + torch.arange(page_rows, device=pages.device)).reshape(-1)


def import_prompt_rows(req: RequestKV, rows: torch.Tensor, policy: KVPolicy, pool: DevicePool, host: HostStore,
                       copies: CopyEngine) -> None:
    """Place the prefill's rows ``[S, T, row_dim]``: tail and (policies with optional pages) optional pages on
    device now, the remaining complete pages to host through an ``import`` copy (``req.import_ticket``)."""
    num_sources, length, _ = rows.shape
    page_rows = pool.page_rows
    device = pool.arena.device
    flat = rows.reshape(num_sources * length, -1)
    src_base = (torch.arange(num_sources) * length).unsqueeze(1)  # [S, 1]
    req.length = length

    # Tail: every page for resident, else the partial last page of the prompt.
    req.tail_first = policy.tail_first_page(length, page_rows)
    first_tail_pos = req.tail_first * page_rows
    if first_tail_pos < length:
        pos = torch.arange(first_tail_pos, length)
        pages = torch.arange(req.tail_first, -(-length // page_rows))
        tail_pages = to_device(req.tail_ring[:, pages % req.tail_pages], None, device)
        req.page_table[:, to_device(pages, None, device)] = tail_pages
        dst = req.tail_ring[:, (pos // page_rows) % req.tail_pages] * page_rows + pos % page_rows
        rows = flat[to_device((src_base + pos).reshape(-1), None, flat.device)]
        pool.arena.index_copy_(0, to_device(dst.reshape(-1), None, device), to_device(rows, None, device))
    if not policy.uses_host:
        return

    # Complete prompt pages: a policy with optional pages keeps as many as the budget allows on device, page-major.
    prompt_pages = length // page_rows
    order = torch.arange(prompt_pages).unsqueeze(0) * num_sources + torch.arange(num_sources).unsqueeze(1)
    keep_count = 0
    if req.prompt_pages:
        keep_count = min(req.prompt_pages * num_sources, max(pool.spare_bytes, 0) // pool.page_bytes)
    keep = order < keep_count  # [S, prompt_pages]
    if keep_count > 0:
        pages = pool.allocate(keep_count, optional=True)
        ks, ki = torch.nonzero(keep, as_tuple=True)
        # nonzero is source-major; assign allocated pages in page-major order for determinism
        rank = order[ks, ki]
        page_of = torch.empty(keep_count, dtype=torch.int64)
        page_of[rank] = pages
        req.opt_page[ks, ki] = page_of
        req.opt_state[ks, ki] = OPT_READY
        req.page_table[ks.to(device), ki.to(device)] = page_of.to(device)
        src = (src_base[ks] + (ki * page_rows).unsqueeze(1) + torch.arange(page_rows)).reshape(-1)
        pool.arena.index_copy_(0, _page_rows(page_of, page_rows).to(device), flat[src.to(flat.device)].to(device))
    to_host = ~keep
    hs, hi = torch.nonzero(to_host, as_tuple=True)
    if hs.numel() == 0:
        return
    assert req.host_pages is not None
    src = (src_base[hs] + (hi * page_rows).unsqueeze(1) + torch.arange(page_rows)).reshape(-1)
    dst = _page_rows(req.host_pages[hs, hi], page_rows)
    req.host_state[hs, hi] = HOST_PENDING

    def done() -> None:
        req.host_state[hs, hi] = HOST_VALID
        req.import_ticket = None
        req.may_refill = True

    req.import_ticket = copies.issue("import", host.rows, dst, flat, src, done)
    req.tickets.append(req.import_ticket)


def reclaimable_pages(req: RequestKV) -> int:
    """Optional pages a reclaim decision would still take (ready or being refilled): the request's own."""
    return int(((req.opt_state == OPT_READY) | (req.opt_state == OPT_REFILLING)).sum())


def holds_device_pages(req: RequestKV) -> bool:
    """Whether a reclaim of ``req`` would do anything: own optional pages to take or shared copies to unmap."""
    return reclaimable_pages(req) > 0 or bool((req.opt_state == OPT_SHARED).any())


def outgoing_pages(req: RequestKV) -> int:
    """Optional pages already decided to leave the device but not yet freed."""
    s = req.opt_state
    return int(((s == OPT_BACKING_UP) | (s == OPT_RETIRED) | (s == OPT_REFILL_CANCELLED)).sum())


def reclaim_request(req: RequestKV, pool: DevicePool, host: HostStore, copies: CopyEngine,
                    fence: ReaderFence) -> int:
    """Reclaim *all* optional pages of ``req``. Pages with a valid host copy are unmapped now; the others
    stay mapped while their deferred backup (``reclaim_backup``: device→host) runs; shared device copies of prefix
    pages are unmapped (the cache frees a copy once nobody maps it, ``kv/prefix_device.py``). Returns the request's
    own pages taken."""
    unmap_shared(req, fence)
    device = pool.arena.device
    state = req.opt_state
    hv = req.host_state[:, : req.prompt_pages] == HOST_VALID
    ready = state == OPT_READY
    refilling = state == OPT_REFILLING
    count = int(ready.sum() + refilling.sum())
    state[refilling] = OPT_REFILL_CANCELLED
    rs, ri = torch.nonzero(ready & hv, as_tuple=True)
    if rs.numel():
        req.page_table[rs.to(device), ri.to(device)] = -1
        state[rs, ri] = OPT_RETIRED
        req.opt_retire_epoch[rs, ri] = fence.issued
        req.retired_pending = True
    bs, bi = torch.nonzero(ready & ~hv, as_tuple=True)
    if bs.numel():
        assert req.host_pages is not None
        state[bs, bi] = OPT_BACKING_UP
        req.host_state[bs, bi] = HOST_PENDING
        src = _page_rows(req.opt_page[bs, bi], pool.page_rows)
        dst = _page_rows(req.host_pages[bs, bi], pool.page_rows)

        def done() -> None:
            req.host_state[bs, bi] = HOST_VALID
            moving = req.opt_state[bs, bi] == OPT_BACKING_UP
            ms, mi = bs[moving], bi[moving]
            req.page_table[ms.to(device), mi.to(device)] = -1
            req.opt_state[ms, mi] = OPT_RETIRED
            req.opt_retire_epoch[ms, mi] = fence.issued
            req.retired_pending = True

        req.tickets.append(copies.issue("reclaim_backup", host.rows, dst, pool.arena, src, done))
    req.add_stat("optional_pages_reclaimed", count)
    return count


def refill_one_page(req: RequestKV, pool: DevicePool, host: HostStore, copies: CopyEngine,
                    fence: ReaderFence) -> bool:
    """Refill the first missing optional page of ``req`` (page-major order) from host, if the budget
    allows (``refill``: host→device). The page is mapped only when the copy is done."""
    if not req.may_refill:
        return False
    hv = req.host_state[:, : req.prompt_pages] == HOST_VALID
    candidates = torch.nonzero(((req.opt_state == OPT_ABSENT) & hv).T)
    if candidates.shape[0] == 0:
        req.may_refill = False  # until a page becomes absent with a valid host copy again
        return False
    i, s = int(candidates[0, 0]), int(candidates[0, 1])
    if map_on_refill(req, s, i, pool.arena.device):  # a held prefix page with a shared device copy: map it (free)
        return True
    if pool.spare_bytes < pool.page_bytes:
        return False
    assert req.host_pages is not None
    page = pool.allocate(1, optional=True)
    req.opt_page[s, i] = int(page[0])
    req.opt_state[s, i] = OPT_REFILLING
    device = pool.arena.device

    def done() -> None:
        if int(req.opt_state[s, i]) == OPT_REFILLING:
            req.opt_state[s, i] = OPT_READY
            req.page_table[s, i] = to_device(page[0], torch.int64, device)
            req.add_stat("optional_pages_refilled", 1)
        else:  # reclaimed while in flight
            req.opt_state[s, i] = OPT_RETIRED
            req.opt_retire_epoch[s, i] = fence.issued
            req.retired_pending = True

    dst = _page_rows(page, pool.page_rows)
    src = _page_rows(req.host_pages[s, i : i + 1], pool.page_rows)
    req.tickets.append(copies.issue("refill", pool.arena, dst, host.rows, src, done))
    return True


def free_retired_pages(req: RequestKV, pool: DevicePool, fence: ReaderFence) -> int:
    """Give back the retired optional pages whose earlier readers have all finished. Returns pages freed."""
    if not req.retired_pending:
        return 0
    fence.poll()
    retired = req.opt_state == OPT_RETIRED
    safe = retired & (req.opt_retire_epoch <= fence.completed)
    fs, fi = torch.nonzero(safe, as_tuple=True)
    req.retired_pending = bool((retired & ~safe).any())
    if fs.numel() == 0:
        return 0
    pool.free(req.opt_page[fs, fi], optional=True)
    req.opt_state[fs, fi] = OPT_ABSENT
    req.opt_page[fs, fi] = -1
    req.may_refill = True
    return int(fs.numel())


# ------------------------------------------------------------------------------------------------- the tail
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


def map_step_tail_pages(reqs: Sequence[RequestKV], query_len: int, page_rows: int, copies: CopyEngine,
                        fence: ReaderFence) -> None:
    """Before a step of ``query_len`` new rows per request: complete each request's import, then
    :func:`map_tail_pages` for its new rows (one call for the batch)."""
    for req in reqs:
        if req.import_ticket is not None:
            copies.wait(req.import_ticket)
        map_tail_pages(req, req.length + query_len - 1, page_rows, copies, fence)


def back_up_step_pages(reqs: Sequence[RequestKV], pool: DevicePool, host: HostStore, copies: CopyEngine,
                       fence: ReaderFence, page_rows: int) -> int:
    """After a step: :func:`back_up_complete_pages` of every request of the batch. Returns pages issued."""
    return sum(back_up_complete_pages(req, pool, host, copies, fence, page_rows) for req in reqs)


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
